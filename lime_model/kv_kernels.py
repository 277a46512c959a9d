"""One source layer's routed-read backward in one pass over its readers' gradients (static matrix weights).

A layer ``j``'s raw K/V are read by every later layer ``r`` that routes from it, with the column block
``W_r[:, j] (kv, kv)`` of ``r``'s weight. In backward, once every reader has kept ``g_r``, the gradient
w.r.t. its routed heads ``[kv, N]`` (``N = B*T*head_dim``, position-major, ``lime_model.kv_buffer``):

- the gradient w.r.t. ``j``'s raw heads is ``sum_r W_r[:, j]^T g_r``;
- the gradient w.r.t. ``W_r[:, j]`` is ``g_r x_j^T``, with ``x_j [kv, N]`` ``j``'s buffered raw heads.

Both read every ``g_r``; computed here, at the source's backward, one kernel reads each ``g_r`` and
``x_j`` once for both (the readers' own backward then reads no source for their weight gradients:
``KVBuffer.defer_weight_grads``). The kernel is Triton's, on a CUDA device when Triton is installed (it
comes with PyTorch's CUDA builds), or anywhere under Triton's interpreter (``TRITON_INTERPRET=1``, which
the tests use on the CPU); elsewhere the same sums run as two GEMMs per contiguous run of readers.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Any

import torch

# A program's tile of the readers' gradients holds about TILE_ELEMENTS numbers (its columns: that over
# the readers' rows, at most MAX_BLOCK); at most MAX_PROGRAMS programs, each looping over its tiles and
# summing its share of the weight gradients in registers: more programs keep more loads in flight, fewer
# leave fewer partial sums to add. Ours, untuned (no GPU yet; bench/routed_backward.py --sweep), sized
# so that the 1B shapes' kernels compile for an H100 without spilling registers (bench/kernel_resources.py).
TILE_ELEMENTS = 4096
MAX_BLOCK = 64
MAX_PROGRAMS = 4 * 132
WARPS = 8


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on any device, CPU tensors included)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# devices where the kernel failed to build or launch: their passes take the GEMMs from then on
_FAILED: set[str] = set()


def kernel_available(device: torch.device) -> bool:
    """Whether ``source_backward`` runs the Triton kernel for tensors on ``device``: a CUDA device of
    compute capability 8.0 or later (``tl.dot`` on bf16), or any under the interpreter."""
    if importlib.util.find_spec("triton") is None or str(device) in _FAILED:
        return False
    if interpreted():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def source_backward(
    kept: torch.Tensor,
    readers: list[int],
    columns: torch.Tensor,
    source: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of one source layer's routed reads, from its readers' kept gradients.

    Args:
        kept: ``[L * kv, N]``, every layer's kept gradient w.r.t. its routed heads (rows ``r*kv ..``).
        readers: the ``R`` layers whose rows are read, ascending.
        columns: ``[R, kv, kv]``, ``columns[i, h, h']`` = reader ``i``'s weight on source head ``h'``
            in its routed head ``h`` (the identity for a reader of its own heads).
        source: ``[kv, N]``, the source layer's buffered raw heads.
        head_dim: features per head (``N = positions * head_dim``).

    Returns:
        The gradient w.r.t. the source's raw heads as ``k_proj`` wrote them, ``(positions, kv * head_dim)``
        in ``kept``'s dtype, and w.r.t. ``columns``, ``[R, kv, kv]`` in float32 (float64 from float64).
    """
    columns = columns.to(kept.dtype)  # as the forward's mix casts its weight (``kv_buffer._mix``)
    if kernel_available(kept.device) and kept.numel() < 2**31:  # the kernel's int32 offsets
        try:
            return _triton_backward(kept, readers, columns, source, head_dim)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # an untuned kernel on a GPU it never ran on must not stop a training
            _FAILED.add(str(kept.device))
            message = f"the Triton kernel failed on {kept.device} ({type(err).__name__}: {err}); using GEMMs"
            warnings.warn(f"lime_model.kv_kernels: {message}", RuntimeWarning, stacklevel=2)
    return _torch_backward(kept, readers, columns, source, head_dim)


def _torch_backward(kept, readers, columns, source, head_dim):
    """``source_backward`` as two GEMMs per run of consecutive readers (a view of ``kept`` each)."""
    kv, N = source.shape
    grad, weight_grads = None, []
    for start, stop, first in contiguous_runs(readers):
        rows = kept[start * kv : stop * kv]  # [n*kv, N]
        # [n*kv (reader, h), kv (h')]: the readers' blocks stacked, whose transpose maps rows onto heads
        mix = columns[first : first + stop - start].reshape(-1, kv)
        grad = mix.t() @ rows if grad is None else torch.addmm(grad, mix.t(), rows)
        weight_grads.append((rows @ source.t()).view(stop - start, kv, kv))
    assert grad is not None  # a source has at least one reader, itself
    positions = N // head_dim
    grad = grad.view(kv, positions, head_dim).transpose(0, 1).reshape(positions, kv * head_dim)
    return grad, _joined(weight_grads).to(_sums(kept.dtype))


def _triton_backward(kept, readers, columns, source, head_dim):
    """``source_backward`` as one kernel launch per run of consecutive readers (one run but for
    dilated-back routings); a later run adds to the gradient that the first wrote."""
    kv, N = source.shape
    grad = kept.new_empty(N // head_dim, kv * head_dim)
    columns, weight_grads = columns.contiguous(), []
    for start, stop, first in contiguous_runs(readers):
        block = kept[start * kv : stop * kv]
        weight_grads.append(_launch(block, columns[first:], source, grad, head_dim, accumulate=first > 0))
    return grad, _joined(weight_grads)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` concatenated; one part as it is (a copy is a kernel launch, per source and step)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def contiguous_runs(sources: list[int]) -> list[tuple[int, int, int]]:
    """Split ascending layer indices into runs ``(first_layer, stop_layer, position_in_sources)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, layer in enumerate(sources):
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1, runs[-1][2])
        else:
            runs.append((layer, layer + 1, pos))
    return runs


def _launch(kept, columns, source, grad, head_dim: int, accumulate: bool) -> torch.Tensor:
    """One launch over consecutive readers' gradient rows ``kept [rows, N]``; their weight gradients
    ``[rows / kv, kv, kv]``."""
    (kv, N), rows = source.shape, kept.shape[0]
    padded = max(16, 1 << (kv - 1).bit_length())  # tl.dot wants sides of 16 or more
    rows_padded = max(16, 1 << (rows - 1).bit_length())
    block = max(16, min(MAX_BLOCK, TILE_ELEMENTS // rows_padded))
    tiles = -(-N // block)
    programs = min(tiles, MAX_PROGRAMS)
    partial = kept.new_empty(programs, rows, kv, dtype=_sums(kept.dtype))
    precise = "ieee" if kept.dtype in (torch.float32, torch.float64) else "tf32"
    _kernel(interpreted())[(programs,)](
        kept, columns, source, grad, partial, rows, N, -(-tiles // programs),
        KV=kv, KVP=padded, HD=head_dim, RPK=rows_padded, BLOCK=block, PRECISION=precise, ACCUMULATE=accumulate,
        num_warps=WARPS,
    )  # fmt: skip
    return partial.sum(0).view(rows // kv, kv, kv)


def _sums(dtype: torch.dtype) -> torch.dtype:
    """The dtype that the products of ``dtype`` values are summed in."""
    return torch.promote_types(dtype, torch.float32)


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The Triton kernel, built at first use (``triton.jit`` reads the interpreter setting then)."""
    del interpret  # the cache's key only
    import triton
    import triton.language as tl

    @triton.jit
    def source_backward_kernel(
        kept, columns, source, grad, partial, ROWS, N, TILES,
        KV: tl.constexpr, KVP: tl.constexpr, HD: tl.constexpr, RPK: tl.constexpr,
        BLOCK: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h = tl.arange(0, KVP)
        heads = h < KV
        # row r of the readers' gradients is reader r // KV's head r % KV; wt[h', r] = its weight on
        # the source's head h' (columns[r // KV, r % KV, h'] is at r * KV + h')
        rows = tl.arange(0, RPK)
        real = rows < ROWS
        wt = tl.load(
            columns + rows[None, :] * KV + h[:, None], mask=heads[:, None] & real[None, :], other=0.0
        )
        sums = partial.dtype.element_ty
        weight_grads = tl.full((RPK, KVP), 0, sums)  # this program's share, every reader's
        for t in range(TILES):
            # int32 offsets (the caller checks that rows x N fits): half the registers of int64 ones
            n = (pid * TILES + t) * BLOCK + tl.arange(0, BLOCK)
            inside = (n < N)[None, :]
            g = tl.load(kept + rows[:, None] * N + n[None, :], mask=real[:, None] & inside, other=0.0)
            mask = heads[:, None] & inside
            x = tl.load(source + h[:, None] * N + n[None, :], mask=mask, other=0.0)
            acc = tl.dot(wt, g, input_precision=PRECISION, out_dtype=sums)
            weight_grads = tl.dot(g, tl.trans(x), weight_grads, input_precision=PRECISION)
            # as k_proj writes them: position n // HD, head h, feature n % HD
            out = grad + (n // HD)[None, :] * (KV * HD) + h[:, None] * HD + (n % HD)[None, :]
            if ACCUMULATE:  # another run of readers wrote its share already
                acc += tl.load(out, mask=mask, other=0.0).to(sums)
            tl.store(out, acc.to(grad.dtype.element_ty), mask=mask)
        at = pid * ROWS * KV + rows[:, None] * KV + h[None, :]
        tl.store(partial + at, weight_grads, mask=real[:, None] & heads[None, :])

    return source_backward_kernel
