"""On-disk cache of extracted activations: safetensors shards plus a JSON manifest.

Layout of one cached extraction (``<cache_dir>/<model_type>-<key hash>/``)::

    manifest.json            {"key": {...}, "shards": [{"file", "n_sequences", "n_rows", "n_tokens"}, ...],
                              "complete": bool, "uses": [str, ...], "about": str}
    shard-00000.safetensors  tensors "<site>/<layer>" (rows, dim), "offsets" (n_seq+1,), "token_ids" (rows,)

The key holds everything that decides the result: the checkpoint's identity (its path, a
fingerprint of its config and weights and the size and mtime of its weight files, or the hub
revision, or, for a model built in memory, a hash of its parameters), hashes of the texts and of
the tokenizer with the truncation limits, the extraction settings and the library versions.
A second run with the same key reuses the shards; a run that was interrupted resumes after the last
shard listed in the manifest. Every file is written to a temporary name and moved into place with
`os.replace`, shard first and manifest second, so a crash never leaves a listed shard half-written.
``uses`` (what wrote or reused the entry: `lime_probe.extraction.cachedir.cache_use` labels, e.g. "blimp") and
``about`` (the start of its data) only name the entry in ``lime-probe cache``; they are not part of the key.
Opening an entry touches its last-used stamp, and a writer marks the entry as its own until it finishes (see
`lime_probe.extraction.cachedir`: least-recently-used eviction, and the temporary files of killed writers).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from lime_model.digests import texts_hash, tokenizer_hash
from lime_model.files import atomic_path, atomic_write
from lime_probe.extraction import provenance
from lime_probe.extraction.cachedir import (
    CACHE_USE,
    MANIFEST,
    WRITER,
    clean_entry,
    format_size,
    opened,
    owner_tag,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def fingerprint(obj: Any) -> str:
    """A stable hash of a JSON-serialisable object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def checkpoint_identity(model: torch.nn.Module) -> dict[str, Any]:
    """What identifies the weights of a Hugging Face `model`.

    A local or hub checkpoint: `lime_probe.output.provenance.checkpoint_identity` of the folder it was loaded
    from (path, config and weights fingerprint, each weight file's size and mtime, so rewriting the
    weights changes it) or of its hub id and commit. A model built in memory: a hash of all
    parameters and buffers (exact, costs one pass over the weights).
    A loaded checkpoint whose weights are then changed in memory still reads as the checkpoint:
    give such a model a fresh cache folder.
    """
    source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    commit = getattr(model.config, "_commit_hash", None)
    if source and (Path(source).is_dir() or commit):
        return provenance.checkpoint_identity(source, revision=commit)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return {"parameters": digest.hexdigest()}


def extraction_key(
    model: PreTrainedModel,
    tokenizer: Any,
    texts: Iterable[str | Sequence[int]],
    *,
    max_length: int,
    max_tokens: int | None,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The cache key of one extraction: everything that decides its result.

    The checkpoint's identity (`checkpoint_identity`) and model type; the data (digests of the texts and
    the tokenizer, the truncation limits); ``settings`` (sites and layers, pooling, batching, padding side,
    selected token ids), completed here with the weights' dtype and device type; the library versions.
    """
    param = next(model.parameters())
    return {
        "checkpoint": checkpoint_identity(model),
        "model_type": model.config.model_type,
        "data": {
            "texts": texts_hash(texts),
            "tokenizer": tokenizer_hash(tokenizer),
            "max_length": max_length,
            "max_tokens": max_tokens,
        },
        "settings": {**settings, "dtype": str(param.dtype), "device": param.device.type},
        "versions": provenance.versions(),
    }


def read_tensor(shard: Path, name: str, rows: int | None = None) -> torch.Tensor:
    """One tensor from a shard file (only that tensor is read), or its first ``rows`` rows."""
    with safe_open(str(shard), framework="pt") as f:
        return f.get_tensor(name) if rows is None else f.get_slice(name)[:rows]


def describe_texts(texts: Iterable[str | Sequence[int]], width: int = 48) -> str:
    """A short human description of an extraction's data for the cache listing: the start of its first
    text (at most `width` characters, whitespace collapsed), or the token count of pre-tokenised input."""
    first = next(iter(texts), None)
    if first is None:
        return ""
    if not isinstance(first, str):
        return f"{len(first)} token ids"
    text = " ".join(first.split())
    return text if len(text) <= width else text[: width - 3] + "..."


class ShardCache:
    """The shards and manifest of one extraction, identified by `key`, under `root`.

    Attributes: directory, shards (paths of the complete shards, in order), done_sequences (how
    many sequences those shards hold), complete (whether the extraction finished), uses (what wrote or
    reused it: the `cachedir.cache_use` labels active when it was opened), about (its data, for people).
    """

    def __init__(self, root: str | Path, key: dict[str, Any], prefix: str = "acts", about: str = ""):
        self.key = json.loads(json.dumps(key, sort_keys=True, default=str))
        self.directory = Path(root) / f"{prefix}-{fingerprint(self.key)[:16]}"
        self.directory.mkdir(parents=True, exist_ok=True)
        clean_entry(self.directory)  # what a killed writer left
        self._writer = self.directory / (WRITER + owner_tag())
        self._writer.touch()
        opened(self.directory)
        self._entries: list[dict[str, Any]] = []
        self.complete = False
        self.uses: list[str] = []
        self.about = about
        manifest = self.directory / MANIFEST
        if manifest.is_file():
            try:
                stored = json.loads(manifest.read_text())
            except json.JSONDecodeError:
                stored = {}
            entries = stored.get("shards", [])
            if stored.get("key") == self.key and all((self.directory / e["file"]).is_file() for e in entries):
                self._entries = entries
                self.complete = bool(stored.get("complete"))
                self.uses = list(stored.get("uses", []))
        use = CACHE_USE.get()
        if use and use not in self.uses:
            self.uses.append(use)
            if self._entries:  # a reused entry records its new use at once; a new one with its first shard
                self._write_manifest()
        if self.complete:  # read only from here on
            self._writer.unlink(missing_ok=True)

    @property
    def shards(self) -> list[Path]:
        return [self.directory / e["file"] for e in self._entries]

    @property
    def done_sequences(self) -> int:
        return sum(e["n_sequences"] for e in self._entries)

    def _write_manifest(self) -> None:
        text = json.dumps(
            {
                "key": self.key,
                "shards": self._entries,
                "complete": self.complete,
                "uses": self.uses,
                "about": self.about,
            },
            indent=1,
        )
        atomic_write(self.directory / MANIFEST, text)

    def add_shard(self, tensors: dict[str, torch.Tensor]) -> Path:
        """Write one shard and list it in the manifest. `tensors` as in the module docstring, plus
        "n_tokens" (a 1-element tensor: tokens run through the model), which goes to the manifest."""
        path = self.directory / f"shard-{len(self._entries):05d}.safetensors"
        tensors = dict(tensors)
        n_tokens = int(tensors.pop("n_tokens"))
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp))
        self._entries.append(
            {
                "file": path.name,
                "n_sequences": len(tensors["offsets"]) - 1,
                "n_rows": len(tensors["token_ids"]),
                "n_tokens": n_tokens,
            }
        )
        self._write_manifest()
        return path

    def finish(self) -> None:
        """Mark the extraction complete, so later runs reuse it without any forward pass."""
        self.complete = True
        self._write_manifest()
        self._writer.unlink(missing_ok=True)

    def announce(
        self, row_bytes: int, seqs: Iterable[Sequence[int]], *, pooled: bool, token_ids: Iterable[int] | None
    ) -> None:
        """Say on stderr, in one line, about how much the extraction about to run adds to the cache
        (`estimate_bytes` of `seqs`, the token ids of the sequences still to extract; the other arguments
        as there)."""
        n_bytes = estimate_bytes(seqs, row_bytes, pooled=pooled, token_ids=token_ids)
        tqdm.write(
            f"cache: this run adds about {format_size(n_bytes)} under {self.directory.parent}",
            file=sys.stderr,
        )


def estimate_bytes(
    seqs: Iterable[Sequence[int]], row_bytes: int, *, pooled: bool, token_ids: Iterable[int] | None = None
) -> int:
    """The bytes the shards of an extraction of `seqs` hold, but for the safetensors headers: per row (a
    sequence when `pooled`, else a token, only those in `token_ids` if given) `row_bytes` and an int64
    token id, per sequence an int64 offset and a float64 log-probability. `seqs` is read once.

    Args:
        seqs: each sequence's token ids.
        row_bytes: bytes of one row of every site and layer (the sites' widths x layers x 4 bytes).
        pooled: one row per sequence.
        token_ids: the ids whose tokens make rows (None: all).
    """
    wanted = None if token_ids is None else set(token_ids)
    rows = n_seqs = 0
    for seq in seqs:
        n_seqs += 1
        rows += 1 if pooled else len(seq) if wanted is None else sum(t in wanted for t in seq)
    return rows * (row_bytes + 8) + 16 * n_seqs
