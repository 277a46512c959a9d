"""Text loading, and packing of token streams into fixed-length training sequences (cached).

A data spec is one of

* a ``.txt`` file: documents are separated by blank lines (a line holding only whitespace counts as
  blank, as in WikiText's files); the lines of one document are joined with ``\\n``;
* a ``.jsonl`` file: one JSON object per line with a ``"text"`` field;
* a ``.parquet`` file with a ``"text"`` column;
* a folder: every such file under it, in sorted order (with ``split``, only files whose name
  starts with it, e.g. ``train.txt`` for ``split="train"``);
* ``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face hub dataset with a ``"text"`` field, streamed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .digests import texts_hash, tokenizer_hash
from .files import atomic_write

SUFFIXES = (".txt", ".jsonl", ".parquet")


def _txt_documents(path: Path) -> Iterator[str]:
    block: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                block.append(line.rstrip("\n"))
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file, read lazily; ValueError in one line
    naming the file and line of a line that is not a JSON object (the file, of text that is not UTF-8). The one
    reader of JSON lines: documents here, BLiMP, clean/corrupt pairs and training metrics."""
    with open(path, encoding="utf-8") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{lineno}: not a JSON object")
                yield lineno, record
        except UnicodeDecodeError as e:  # decoded in blocks, so no line can be named
            raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None


def _jsonl_documents(path: Path) -> Iterator[str]:
    for lineno, record in jsonl_records(path):
        if "text" not in record:
            raise ValueError(f'{path}:{lineno}: expected a JSON object with a "text" field')
        text = record["text"]
        if text is None:  # an empty document, as a null in a parquet column
            continue
        if not isinstance(text, str):
            raise ValueError(f'{path}:{lineno}: "text" is {json.dumps(text)[:40]}, expected a string')
        yield text


def _parquet_documents(path: Path) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if "text" not in table.schema_arrow.names:
        raise ValueError(f'{path}: no "text" column (columns: {", ".join(table.schema_arrow.names)})')
    kind = table.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f'{path}: the "text" column holds {kind}, expected strings')
    for batch in table.iter_batches(columns=["text"]):
        yield from batch.column(0).to_pylist()


def _file_documents(path: Path) -> Iterator[str]:
    reader = {".txt": _txt_documents, ".jsonl": _jsonl_documents, ".parquet": _parquet_documents}[path.suffix]
    try:
        yield from reader(path)
    except UnicodeDecodeError as error:  # names the file, which a folder spec does not
        bad = error.object[error.start : error.start + 1].hex()
        raise ValueError(
            f"{path} is not UTF-8 text (byte 0x{bad}: {error.reason}); convert it to UTF-8"
        ) from None


def _hub_documents(spec: str, split: str | None) -> Iterator[str]:
    import datasets

    name, config, spec_split = ([*spec[len("hf:") :].split(":"), None, None])[:3]
    if not name:
        raise ValueError(f"bad data spec {spec!r}: expected hf:NAME[:CONFIG][:SPLIT]")
    ds = datasets.load_dataset(name, config or None, split=spec_split or split or "train", streaming=True)
    for row in ds:
        yield row["text"]


def data_files(spec: str, split: str | None = None) -> list[Path]:
    """The local files a (non-hub) spec names; FileNotFoundError/ValueError if there are none."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data not found: {spec}")
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ValueError(f"unsupported data file {spec}: expected one of {', '.join(SUFFIXES)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    if split is not None:
        files = [p for p in files if p.name.startswith(split)]
    if not files:
        what = f" starting with {split!r}" if split else ""
        raise FileNotFoundError(f"no {'/'.join(SUFFIXES)} files{what} in folder {spec}")
    return files


def iter_texts(spec: str, split: str | None = None) -> Iterator[str]:
    """The non-empty documents of ``spec`` (see the module docstring), lazily."""
    if spec.startswith("hf:"):
        docs: Iterator[str] = _hub_documents(spec, split)
    else:
        docs = (d for f in data_files(spec, split) for d in _file_documents(f))
    return (d for d in docs if d and d.strip())


def load_texts(spec: str, split: str | None = None, max_texts: int | None = None) -> list[str]:
    """The first ``max_texts`` (default: all) non-empty documents of ``spec``; ValueError if none."""
    if max_texts is not None and max_texts < 1:
        raise ValueError(f"max_texts must be >= 1, got {max_texts}")
    texts = list(islice(iter_texts(spec, split), max_texts))
    if not texts:
        raise ValueError(f"no text in {spec}" + (f" (split {split!r})" if split else ""))
    return texts


def check_source(spec: str, split: str | None = None) -> None:
    """Check a data spec reading no more than its first document, as a command line does before it loads
    torch: a local file or folder must exist in a supported format (`data_files`), be UTF-8 and hold text
    (`load_texts`' errors). A hub spec is left to the hub, asked when it is read."""
    if not spec.startswith("hf:"):
        load_texts(spec, split, max_texts=1)


@dataclass(frozen=True)
class TextSource:
    """The first ``max_texts`` (default: all) documents of a data ``spec``, not read until ``load``.

    ``key`` identifies them without reading any text, so a cache keyed on it is checked first:
    local files by resolved path, size and modification time (rewriting a file changes the key);
    hub specs by the spec itself (a dataset changed upstream needs a fresh cache folder).
    """

    spec: str
    split: str | None = None
    max_texts: int | None = None

    def key(self) -> dict:
        if self.max_texts is not None and self.max_texts < 1:
            raise ValueError(f"max_texts must be >= 1, got {self.max_texts}")
        if self.spec.startswith("hf:"):
            where: object = self.spec
        else:
            where = [
                [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                for f in data_files(self.spec, self.split)
            ]
        return {"source": where, "split": self.split, "max_texts": self.max_texts}

    def load(self) -> list[str]:
        return load_texts(self.spec, self.split, self.max_texts)

    def iter(self) -> Iterator[str]:
        """The documents, lazily (streamed for ``hf:`` specs)."""
        return islice(iter_texts(self.spec, self.split), self.max_texts)


def pack(token_lists: Sequence[Sequence[int]], eos_id: int, seq_len: int) -> np.ndarray:
    """Concatenate documents, each followed by ``eos_id``, and cut into rows of ``seq_len``.

    Returns (n_sequences, seq_len) int32; the incomplete tail is dropped.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    lengths = np.array([len(t) + 1 for t in token_lists], dtype=np.int64)
    stream = np.empty(int(lengths.sum()), dtype=np.int32)
    ends = np.cumsum(lengths)
    for toks, end, n in zip(token_lists, ends, lengths, strict=True):
        stream[end - n : end - 1] = toks
        stream[end - 1] = eos_id
    n_rows = len(stream) // seq_len
    return stream[: n_rows * seq_len].reshape(n_rows, seq_len)


def _tokenize(tokenizer, batch: list[str]) -> list[list[int]]:
    """The token ids of each document of ``batch``, without special tokens."""
    # whole documents, cut into rows afterwards: transformers' "longer than the maximum sequence length"
    # warning does not apply (verbose=False skips it)
    return tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]


_worker_tokenizer = None  # a pool worker's copy of the tokenizer (see _token_chunks)


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    # the processes are the parallelism: Rust's own threads in each would oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = tokenizer


def _tokenize_in_worker(batch: list[str]) -> list[list[int]]:
    return _tokenize(_worker_tokenizer, batch)


def _token_chunks(
    docs: Iterable[str], tokenizer, chunk: int, num_proc: int
) -> Generator[list[list[int]], None, None]:
    """The token ids of ``docs``, ``chunk`` documents at a time, in order; with ``num_proc`` > 1 the
    chunks are tokenised by that many worker processes, reading at most ``2 * num_proc`` chunks ahead
    (a streamed corpus is never read further than that)."""
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    docs = iter(docs)
    chunks = iter(lambda: list(islice(docs, chunk)), [])
    if num_proc == 1:
        yield from (_tokenize(tokenizer, batch) for batch in chunks)
        return
    # spawn, not fork: a forked tokenizer that has run its Rust threads may deadlock
    with get_context("spawn").Pool(num_proc, _init_worker, (tokenizer,)) as pool:
        while window := list(islice(chunks, 2 * num_proc)):
            yield from pool.map(_tokenize_in_worker, window)


def tokenize_and_pack(
    texts: Sequence[str],
    tokenizer,
    seq_len: int,
    progress: bool = False,
    chunk: int = 1000,
    num_proc: int = 1,
) -> np.ndarray:
    """(n_sequences, seq_len) int32 token ids of ``texts`` packed with eos between documents
    (tokenised by ``num_proc`` processes: the same array for any number)."""
    token_lists: list[list[int]] = []
    bar = tqdm(total=-(-len(texts) // chunk), desc="tokenize", disable=not progress, unit="chunk")
    for ids in _token_chunks(texts, tokenizer, chunk, num_proc):
        token_lists += ids
        bar.update(1)
    bar.close()
    return pack(token_lists, tokenizer.eos_token_id, seq_len)


def stream_pack(
    docs: Iterator[str],
    tokenizer,
    seq_len: int,
    out: np.ndarray,
    progress: bool = False,
    chunk: int = 1000,
    num_proc: int = 1,
) -> int:
    """Pack documents (as ``pack``) into the rows of ``out`` (max_rows, seq_len), reading only as
    many documents as fill it (tokenised by ``num_proc`` processes); returns the number of rows
    filled (fewer when the documents run out)."""
    eos, filled = tokenizer.eos_token_id, 0
    carry = np.empty(0, dtype=np.int32)
    bar = tqdm(total=len(out), desc="tokenize", disable=not progress, unit="row")
    chunks = _token_chunks(docs, tokenizer, chunk, num_proc)
    for ids in chunks:
        carry = np.concatenate([carry, *(np.array([*t, eos], dtype=np.int32) for t in ids)])
        n = min(len(carry) // seq_len, len(out) - filled)
        out[filled : filled + n] = carry[: n * seq_len].reshape(n, seq_len)
        carry, filled = carry[n * seq_len :], filled + n
        bar.update(n)
        if filled == len(out):
            break
    chunks.close()  # stops the workers
    bar.close()
    return filled


class NotPrepared(FileNotFoundError):
    """A cache that was to be read, not made (``build=False``), is missing."""


def packed_sequences(
    texts: Sequence[str] | TextSource,
    tokenizer,
    seq_len: int,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
    max_rows: int | None = None,
    num_proc: int = 1,
    build: bool = True,
) -> np.ndarray:
    """``tokenize_and_pack``, cached in ``cache_dir`` under a key of (texts, tokenizer, seq_len).

    ``texts`` is a list of documents (keyed by their hash) or a ``TextSource`` (keyed by
    ``TextSource.key``, and read only when the cache misses). The cache is ``packed-KEY.npy``
    beside ``packed-KEY.json`` (what the key was made of), each written atomically, so an
    interrupted run never leaves a truncated array; a hit is memory-mapped (copy-on-write), not read.
    With ``max_rows``, documents are streamed and only the first ``max_rows`` rows are made (written
    straight into the cache file, so they need not fit in memory). ``num_proc`` processes tokenise
    (the same rows for any number). With ``build=False`` a miss raises ``NotPrepared`` instead
    (nothing is read). Returns (n_sequences, seq_len) int32. Raises ValueError if the texts do not
    fill one sequence.
    """
    meta = {
        "texts": texts.key() if isinstance(texts, TextSource) else texts_hash(texts),
        "tokenizer": tokenizer_hash(tokenizer),
        "seq_len": seq_len,
        "eos": tokenizer.eos_token_id,
    }
    if max_rows is not None:
        meta["max_rows"] = max_rows
    npy = cache_path(cache_dir, "packed", meta, ".npy")
    if npy is not None and npy.exists():
        return np.load(npy, mmap_mode="c", allow_pickle=False)
    if not build:
        raise NotPrepared(f"no packed tokens at {npy}")
    if max_rows is None:
        docs = texts.load() if isinstance(texts, TextSource) else texts
        seqs = tokenize_and_pack(docs, tokenizer, seq_len, progress=progress, num_proc=num_proc)
        _check_rows(len(seqs), seq_len)
        if npy is not None:
            atomic_write(npy.with_suffix(".json"), json.dumps({**meta, "n_sequences": len(seqs)}, indent=1))
            atomic_write(npy, lambda f: np.save(f, seqs, allow_pickle=False))  # last: its presence is the hit
        return seqs
    docs_iter = texts.iter() if isinstance(texts, TextSource) else iter(texts)
    if npy is None:
        seqs = np.empty((max_rows, seq_len), dtype=np.int32)
        filled = stream_pack(docs_iter, tokenizer, seq_len, seqs, progress, num_proc=num_proc)
        _check_rows(filled, seq_len)
        return seqs[:filled]
    tmp = npy.with_name(f".{npy.name}.{os.getpid()}.tmp")
    try:
        rows = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int32, shape=(max_rows, seq_len))
        filled = stream_pack(docs_iter, tokenizer, seq_len, rows, progress, num_proc=num_proc)
        _check_rows(filled, seq_len)
        if filled < max_rows:  # the data ran out: keep what there is
            short = np.array(rows[:filled])
            del rows
            atomic_write(tmp, lambda f: np.save(f, short, allow_pickle=False))
        else:
            rows.flush()
            del rows
        atomic_write(npy.with_suffix(".json"), json.dumps({**meta, "n_sequences": filled}, indent=1))
        os.replace(tmp, npy)
    finally:
        tmp.unlink(missing_ok=True)
    return np.load(npy, mmap_mode="c", allow_pickle=False)


def _check_rows(n_rows: int, seq_len: int) -> None:
    if n_rows == 0:
        raise ValueError(f"the data holds fewer tokens than one sequence of seq_len={seq_len}")


def cache_path(cache_dir: str | os.PathLike | None, prefix: str, key: dict, suffix: str = "") -> Path | None:
    """``cache_dir/PREFIX-HASH[SUFFIX]`` for a JSON-able ``key`` (the folder is created), or None
    without a ``cache_dir``."""
    if cache_dir is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return Path(cache_dir) / f"{prefix}-{digest}{suffix}"
