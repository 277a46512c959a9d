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

# The kernel's column tiles and at most this many programs, each looping over its tiles and summing
# its share of the weight gradients in registers: more programs keep more loads in flight, fewer leave
# fewer partial sums to add. Ours, untuned (no GPU yet): four programs of eight warps per H100 SM.
BLOCK_N = 256
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
    if kernel_available(kept.device):
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
    grad, weight_grads, i = None, [], 0
    while i < len(readers):
        stop = i + 1
        while stop < len(readers) and readers[stop] == readers[stop - 1] + 1:
            stop += 1
        rows = kept[readers[i] * kv : (readers[stop - 1] + 1) * kv]  # [n*kv, N]
        # [n*kv (reader, h), kv (h')]: the readers' blocks stacked, whose transpose maps rows onto heads
        mix = columns[i:stop].reshape(-1, kv)
        grad = mix.t() @ rows if grad is None else torch.addmm(grad, mix.t(), rows)
        weight_grads.append((rows @ source.t()).view(stop - i, kv, kv))
        i = stop
    assert grad is not None  # a source has at least one reader, itself
    positions = N // head_dim
    grad = grad.view(kv, positions, head_dim).transpose(0, 1).reshape(positions, kv * head_dim)
    return grad, torch.cat(weight_grads).to(_sums(kept.dtype))


def _triton_backward(kept, readers, columns, source, head_dim):
    kv, N = source.shape
    positions = N // head_dim
    padded = max(16, 1 << (kv - 1).bit_length())  # tl.dot wants sides of 16 or more
    readers_padded = 1 << (len(readers) - 1).bit_length()
    tiles = -(-N // BLOCK_N)
    programs = min(tiles, MAX_PROGRAMS)
    grad = kept.new_empty(positions, kv * head_dim)
    partial = kept.new_empty(programs, readers_padded, kv, kv, dtype=_sums(kept.dtype))
    index = _indices(tuple(readers), kept.device)
    precise = "ieee" if kept.dtype in (torch.float32, torch.float64) else "tf32"
    _kernel(interpreted())[(programs,)](
        kept, index, columns.contiguous(), source, grad, partial, len(readers), N, -(-tiles // programs),
        KV=kv, KVP=padded, HD=head_dim, RP=readers_padded, BLOCK=BLOCK_N, PRECISION=precise, num_warps=WARPS,
    )  # fmt: skip
    return grad, partial.sum(0)[: len(readers)]


@functools.lru_cache(maxsize=1024)
def _indices(readers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``readers`` as an int32 tensor on ``device``, made once (a copy from the host per call would
    be a transfer per layer and step)."""
    return torch.tensor(readers, dtype=torch.int32, device=device)


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
        kept, readers, columns, source, grad, partial, R, N, TILES,
        KV: tl.constexpr, KVP: tl.constexpr, HD: tl.constexpr, RP: tl.constexpr,
        BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h = tl.arange(0, KVP)
        heads = h < KV
        slot = tl.arange(0, RP)
        sums = partial.dtype.element_ty
        weight_grads = tl.full((RP, KVP, KVP), 0, sums)  # this program's share of every reader's
        for t in range(TILES):
            n = (pid * TILES + t) * BLOCK + tl.arange(0, BLOCK)
            mask = heads[:, None] & (n < N)[None, :]
            x = tl.load(source + h[:, None].to(tl.int64) * N + n[None, :], mask=mask, other=0.0)
            acc = tl.full((KVP, BLOCK), 0, sums)
            for i in range(R):
                row = tl.load(readers + i).to(tl.int64) * KV + h
                g = tl.load(kept + row[:, None] * N + n[None, :], mask=mask, other=0.0)
                w = tl.load(
                    columns + i * KV * KV + h[:, None] * KV + h[None, :],
                    mask=heads[:, None] & heads[None, :],
                    other=0.0,
                )
                acc = tl.dot(tl.trans(w), g, acc, input_precision=PRECISION)
                part = tl.dot(g, tl.trans(x), input_precision=PRECISION, out_dtype=sums)
                weight_grads += tl.where((slot == i)[:, None, None], part[None, :, :], 0.0)
            # as k_proj writes them: position n // HD, head h, feature n % HD
            out = (n // HD)[None, :].to(tl.int64) * (KV * HD) + h[:, None] * HD + (n % HD)[None, :]
            tl.store(grad + out, acc.to(grad.dtype.element_ty), mask=mask)
        cells = slot[:, None, None] * KV * KV + h[None, :, None] * KV + h[None, None, :]
        real = heads[None, :, None] & heads[None, None, :]
        tl.store(partial + pid * RP * KV * KV + cells, weight_grads, mask=real)

    return source_backward_kernel
