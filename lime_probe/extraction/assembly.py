"""Where an extraction's rows are written as their batches land: `Assembly` holds the result of a run of
consecutive input sequences (a block, or the whole input) and puts each batch's rows straight into their
final places, in input order, converting them to the result's dtype in the same copy.

Why: batches run sorted by length, and a batch's rows arrive in the model's dtype (bf16 rows are half the
bytes). Converting each batch, then concatenating the batches and gathering them back into input order,
passed over every row three times on the host: about a third of a bf16 extraction's time on a GPU.
Here each row is copied once, and a bf16 or fp16 model's rows stay in its dtype (`host_dtype`: half the
memory, and placing them as float32 took 1.9-2.7x as long on the project's CPU machine,
`bench/extract_host.py`; `Activations` widens them to float32, exactly, as they are read). What a row is
and how many a sequence has is known from its token ids before any forward pass (`row_counts`), so the
result is allocated at its full size when the first batch lands. `Placer` does the placing, on a worker
thread where the model runs on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain, pairwise

import numpy as np
import torch

# A batch is copied in slices, one per run of sequences that are consecutive in the input, when its runs
# average at least this many rows; else its rows are converted and scattered by index, two passes (ours,
# not tuned: a slice's copy costs a few microseconds of Python and dispatch, near what copying 32 rows of
# 512 features takes on one core).
MIN_ROWS_PER_RUN = 32


def row_counts(seqs: Sequence[list[int]], pool: str, select_ids: torch.Tensor | None) -> np.ndarray:
    """Rows each sequence gives (int64, one per sequence): one when pooled, else its tokens, or the tokens
    whose id is in ``select_ids`` (as `tracing` keeps them)."""
    return _rows(seqs, pool, select_ids)[0]


def _rows(
    seqs: Sequence[list[int]], pool: str, select_ids: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    """`row_counts`, and each row's token id (-1 per sequence when pooled)."""
    if pool != "none":
        return np.ones(len(seqs), dtype=np.int64), np.full(len(seqs), -1, dtype=np.int64)
    ids = np.fromiter(chain.from_iterable(seqs), dtype=np.int64)
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    if select_ids is None:
        return lengths, ids
    kept = np.isin(ids, select_ids.numpy())
    counts = np.add.reduceat(kept, np.concatenate([[0], np.cumsum(lengths)[:-1]])).astype(np.int64)
    return counts, ids[kept]


HALF = (torch.bfloat16, torch.float16)  # held as they come: half float32's memory, exactly widened on reading


def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that rows of ``dtype`` are held in on the host: float64, float32 and the half types
    (bfloat16, float16: `Activations` converts them to float32 when they are read) as they are, any
    other float32."""
    return dtype if dtype in (torch.float64, torch.float32, *HALF) else torch.float32


class Assembly:
    """The result of input sequences ``first .. first + len(seqs) - 1``, filled batch by batch (`place`).

    Attributes:
        offsets: LongTensor (n+1,), rows offsets[i]:offsets[i+1] belong to sequence first + i.
        token_ids: LongTensor (n_rows,), each row's token id (-1 per sequence when pooled).
        n_tokens: LongTensor (1,), the sequences' tokens.
        rows: name -> (n_rows, ...) in `host_dtype` of the rows' (per-sequence "logprobs": (n,) float64),
            made at the first batch that has the name, from its rows' trailing shape and dtype.
    """

    def __init__(self, seqs: Sequence[list[int]], first: int, pool: str, select_ids: torch.Tensor | None):
        self.first, self.n = first, len(seqs)
        self.counts, ids = _rows(seqs, pool, select_ids)
        self.offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(self.counts)]))
        self.token_ids = torch.from_numpy(ids)
        self.n_tokens = torch.tensor([sum(map(len, seqs))])
        self.rows: dict[str, torch.Tensor] = {}

    def place(self, index: Sequence[int], rows: dict[str, torch.Tensor]) -> None:
        """Write one batch's rows: ``index`` are its sequences' input positions in the order they ran, and
        ``rows`` name -> that batch's rows in the same order (a sequence's rows consecutive; "logprobs"
        one per sequence), in any floating dtype (held in its `host_dtype`)."""
        local = np.asarray(index, dtype=np.int64) - self.first
        if local.size and (local.min() < 0 or local.max() >= self.n):
            raise IndexError(
                f"sequences {list(index)} are not all in {self.first}..{self.first + self.n - 1}"
            )
        per_token = _Spans(self.counts[local], self.offsets.numpy()[local])
        per_sequence = _Spans(np.ones(len(local), dtype=np.int64), local)
        for name, x in rows.items():
            spans = per_sequence if name == "logprobs" else per_token
            if len(x) != spans.total:
                raise RuntimeError(f"{name}: a batch of {spans.total} expected rows gave {len(x)}")
            spans.copy(x, self._destination(name, x))

    def _destination(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name not in self.rows:
            n_rows = self.n if name == "logprobs" else int(self.offsets[-1])
            self.rows[name] = torch.empty((n_rows, *x.shape[1:]), dtype=host_dtype(x.dtype))
        return self.rows[name]

    def result(self) -> dict[str, torch.Tensor]:
        """The part as `Activations` holds it: offsets, token ids, token count and every placed name."""
        return {"offsets": self.offsets, "token_ids": self.token_ids, "n_tokens": self.n_tokens, **self.rows}


class _Spans:
    """Where a batch's rows go: its sequences' ``counts`` rows, in batch order, to rows ``starts`` onwards
    of the destination; a run of sequences that follow one another in both is one span."""

    def __init__(self, counts: np.ndarray, starts: np.ndarray):
        ends = np.cumsum(counts)
        self.total = int(ends[-1]) if len(ends) else 0
        self.sources, self.counts, self.starts = ends - counts, counts, starts  # sources: first rows in x
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + counts[:-1]) + 1
        bounds = np.concatenate([[0], breaks, [len(counts)]]).tolist()
        self.runs = [(int(self.sources[a]), int(ends[b - 1]), int(starts[a])) for a, b in pairwise(bounds)]

    def copy(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Copy ``x`` (the batch's rows) into ``out``, converting its dtype on the way."""
        if len(self.runs) == 1 or self.total >= MIN_ROWS_PER_RUN * len(self.runs):
            for begin, end, at in self.runs:
                out[at : at + end - begin].copy_(x[begin:end])
            return
        index = np.repeat(self.starts - self.sources, self.counts) + np.arange(self.total)
        out.index_copy_(0, torch.from_numpy(index), x.to(out.dtype))


class Placer:
    """Places each landed batch into its `Assembly`: inline, or with ``threaded`` on one worker thread, so
    that on a GPU the host's copies run while its main thread traces the next batch (torch's copies release
    the GIL). At most one placement is in flight, so at most about three batches' rows wait in pinned
    memory: one placed, one landing, one traced.

    Attributes:
        busy: what the placement in flight was given as its ``owner`` (None when none is).
    """

    def __init__(self, threaded: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lime-probe-place") if threaded else None
        self._last: Future[None] | None = None
        self.busy: object = None

    def place(
        self, assembly: Assembly, index: list[int], rows: Callable[[], dict[str, torch.Tensor]], owner: object
    ) -> None:
        """Place the rows that ``rows()`` waits for (`Assembly.place`), once the placement before is done;
        an error of that one, or of this one inline, is raised here."""
        self.wait()
        if self._pool is None:
            assembly.place(index, rows())
            return
        self._last, self.busy = self._pool.submit(lambda: assembly.place(index, rows())), owner

    def wait(self) -> None:
        """Wait for the placement in flight; its error is raised here, once."""
        last, self._last, self.busy = self._last, None, None
        if last is not None:
            last.result()

    def close(self) -> None:
        """Let the placement in flight finish (its error is not raised) and stop the worker."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
