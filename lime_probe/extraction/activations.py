"""The container `extract` returns: `Activations`, each site's rows per layer (``acts[site][layer]`` ->
(n_rows, dim) float32 on CPU) with the sequence offsets and token ids they belong to, held in memory or read
back shard by shard from the activation cache; and `merge_parts`, which joins consecutive parts (blocks
of a stream, or of a cache shard; each built by `assembly`). A bf16 or fp16 model's rows are held (and
cached) in its dtype, half of float32's memory, and widened to float32 as they are read: exactly, so
every probe sees the numbers it saw when they were widened at extraction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from lime_probe.extraction.assembly import HALF
from lime_probe.extraction.cache import read_tensor


class Activations(Mapping):
    """Extracted representations: ``acts[site][layer]`` -> float32 CPU tensor (n_rows, dim).

    Attributes:
        offsets: LongTensor (n_sequences+1,), rows offsets[i]:offsets[i+1] belong to sequence i.
        token_ids: LongTensor (n_rows,), the token id of each row (-1 for mean-pooled rows).
        sites: the extracted site names.
        heads: site -> (kv_heads, head_dim) for the keys/values sites (see `per_head`).
        shards: the cache shard files backing this result ([] when held in memory).
        attn_implementation: the attention implementation the forward passes ran ("eager" for attn_pattern).
        all_tokens: whether every token has a row (pool="none", no token_ids), as `pattern` needs.
        logprobs: DoubleTensor (n_sequences,), each sequence's summed token log-probability
            sum_{i>=1} log p(t_i | t_<i), when extracted with ``logprobs=True``; else None.

    A result held in memory hands out its float32 tensors (do not modify them in place); rows held in a
    half type (`held_dtype`) are widened to a new float32 tensor on each access, and a cached result
    reads and concatenates its shards on each access, keeping memory flat: so bind
    ``acts[site][layer]`` to a name rather than indexing it in a hot loop.
    """

    def __init__(
        self,
        parts: Sequence[dict[str, torch.Tensor] | Path],
        site_layers: dict[str, list[int]],
        heads: dict[str, tuple[int, int]],
        logprobs: bool = False,
        attn_implementation: str | None = None,
        all_tokens: bool = True,
    ):
        self._parts = parts
        self._site_layers = site_layers
        self.heads = heads
        self.attn_implementation, self.all_tokens = attn_implementation, all_tokens
        counts = torch.cat([self._load(p, "offsets").diff() for p in parts])
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        self.token_ids = self._cat("token_ids")
        self.logprobs = self._cat("logprobs") if logprobs else None

    @staticmethod
    def _load(part: dict[str, torch.Tensor] | Path, name: str) -> torch.Tensor:
        return part[name] if isinstance(part, dict) else read_tensor(part, name)

    def _cat(self, name: str) -> torch.Tensor:
        if len(self._parts) == 1 and isinstance(self._parts[0], dict):
            return self._parts[0][name]  # held in memory: no copy
        return torch.cat([self._load(p, name) for p in self._parts])

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(self._site_layers)

    @property
    def shards(self) -> list[Path]:
        return [p for p in self._parts if isinstance(p, Path)]

    @property
    def n_sequences(self) -> int:
        return len(self.offsets) - 1

    def held_dtype(self, site: str) -> torch.dtype:
        """The dtype `site`'s rows are held in: the model's when it is bfloat16 or float16 (read as
        float32), else float32."""
        part, name = self._parts[0], f"{site}/{self.layers(site)[0]}"
        return part[name].dtype if isinstance(part, dict) else read_tensor(part, name, rows=0).dtype

    def layers(self, site: str) -> list[int]:
        """The extracted layer indices of `site`."""
        return list(self[site])

    def __getitem__(self, site: str) -> _SiteView:
        if site not in self._site_layers:
            raise KeyError(f"site {site!r} was not extracted; available: {list(self._site_layers)}")
        return _SiteView(self, site)

    def __iter__(self) -> Iterator[str]:
        return iter(self._site_layers)

    def __len__(self) -> int:
        return len(self._site_layers)

    def sequences(self, site: str, layer: int) -> list[torch.Tensor]:
        """The rows of `site`/`layer` split per sequence: a list of (t_i, dim) tensors."""
        return list(torch.split(self[site][layer], self.offsets.diff().tolist()))

    def iter_sequences(self, site: str, layer: int, chunk: int = 256) -> Iterator[list[torch.Tensor]]:
        """The sequences of `site`/`layer` in order, `chunk` at a time (the last chunk may be smaller):
        lists of (t_i, dim) tensors.

        A cached result reads one shard at a time, so memory holds about one shard's rows of this layer
        rather than the whole layer (what `sequences` returns). The chunks do not depend on how the
        result is sharded, so streamed statistics are the same with or without the cache.
        """
        if layer not in self[site]:
            raise KeyError(
                f"layer {layer} of site {site!r} was not extracted; available: {self.layers(site)}"
            )
        pending: list[torch.Tensor] = []
        for part in self._parts:
            lengths = self._load(part, "offsets").diff().tolist()
            pending += torch.split(widened(self._load(part, f"{site}/{layer}")), lengths)
            while len(pending) >= chunk:
                yield pending[:chunk]
                pending = pending[chunk:]
        if pending:
            yield pending

    def stack(self, site: str, layers: Iterable[int] | None = None) -> torch.Tensor:
        """`site`'s layers as one tensor: (n_layers, n_rows, dim), entry k being layer ``layers[k]`` (default:
        every extracted layer, ascending), rows as in ``acts[site][layer]`` (a token, or a sequence when
        pooled). One copy of those layers; ``acts.stack("hidden").numpy()`` for an array."""
        chosen = self.layers(site) if layers is None else list(layers)
        return torch.stack([self[site][layer] for layer in chosen])

    def per_head(self, site: str, layer: int) -> torch.Tensor:
        """`site`/`layer` viewed per head: (n_rows, kv_heads, head_dim) for keys/values sites, (n_rows, heads,
        W) for ``attn_pattern`` (each query token's weights over key positions 0..W-1)."""
        if site not in self.heads:
            raise ValueError(f"site {site!r} has no heads; per-head views exist for {sorted(self.heads)}")
        return self[site][layer].unflatten(-1, self.heads[site])

    def pattern(self, layer: int, sequence: int) -> torch.Tensor:
        """Sequence `sequence`'s attention pattern at block `layer`: (heads, t, t), entry [h, q, k] the weight
        head h gives at token q to token k (each row sums to 1). Needs ``attn_pattern`` with a row per token."""
        if not self.all_tokens:
            raise ValueError(
                "pattern needs a row per token: extract attn_pattern with pool='none', no token_ids"
            )
        if not 0 <= sequence < self.n_sequences:
            raise IndexError(f"sequence {sequence} out of range: this result holds {self.n_sequences}")
        start, stop = self.offsets[sequence : sequence + 2].tolist()
        rows = self.per_head("attn_pattern", layer)[start:stop, :, : stop - start]
        return rows.transpose(0, 1)

    def __repr__(self) -> str:
        sites = ", ".join(f"{s}: layers {v}" for s, v in self._site_layers.items())
        return f"Activations({self.n_sequences} sequences, {len(self.token_ids)} rows; {sites})"


class _SiteView(Mapping):
    """``acts[site]``: layer index -> (n_rows, dim) tensor."""

    def __init__(self, acts: Activations, site: str):
        self._acts, self._site = acts, site

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self._acts._site_layers[self._site]:
            raise KeyError(
                f"layer {layer} of site {self._site!r} was not extracted; "
                f"available: {self._acts._site_layers[self._site]}"
            )
        return widened(self._acts._cat(f"{self._site}/{layer}"))

    def __iter__(self) -> Iterator[int]:
        return iter(self._acts._site_layers[self._site])

    def __contains__(self, layer: object) -> bool:  # Mapping's default would read the whole layer
        return layer in self._acts._site_layers[self._site]

    def __len__(self) -> int:
        return len(self._acts._site_layers[self._site])


def widened(rows: torch.Tensor) -> torch.Tensor:
    """Rows held in a half type as float32 (exact); others as they are."""
    return rows.float() if rows.dtype in HALF else rows


def merge_parts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate consecutive parts (emptying `parts`, so each piece is freed once copied: the peak is
    the result plus one site/layer, not twice the result); offsets are rebased, token counts summed.
    A single part is returned as it is (no copy)."""
    if len(parts) == 1:
        return parts.pop()
    counts = torch.cat([p.pop("offsets").diff() for p in parts])
    out = {
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
        "n_tokens": sum((p.pop("n_tokens") for p in parts), torch.zeros(1, dtype=torch.long)),
    }
    for name in list(parts[0]):
        out[name] = torch.cat([p.pop(name) for p in parts])
    return out
