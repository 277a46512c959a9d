"""The K/V buffer shared by the attention layers of one LIMe forward pass, and the routed read.

Layout: keys and values each live in one contiguous tensor in which layer j's raw heads form the
head block ``j * kv .. (j + 1) * kv`` of a head axis, so a layer's sources are one strided range of
that axis, read without copying. Where the head axis sits depends on how the weights vary, so that
each read mode is one (batched) GEMM on views:

- position-major ``[L * kv, B * T, head_dim]`` (static matrices, mode "matrix"): mixing with
  ``R [kv, S * kv]`` is one GEMM over a contiguous row range, and routed heads come out with
  ``head_dim`` innermost, as attention wants them;
- feature-major ``[L * kv, head_dim, B * T]`` (per-dim weights, one mixing matrix per feature): each
  feature's sources are a strided matrix with unit-stride rows, so the mix is one GEMM batched over
  features instead of a permuted copy of every source at every layer;
- position-outer ``[B * T, L * kv, head_dim]`` (per-position weights, the dynamic router): each
  position's sources are a ``[S * kv, head_dim]`` matrix with unit-stride rows, so the mix is one GEMM
  batched over positions, and the routed heads come out ``(B, T, kv, head_dim)`` as ``k_proj`` writes them.

Why a custom autograd function: building the sources with ``torch.cat`` at every layer copies the
buffer L times and makes backward keep every copy (O(L^2) memory and traffic). Here each layer
writes its own block once; backward accumulates ``R^T @ grad`` into a matching gradient buffer, and
a layer hands its block's gradient to ``k_proj``/``v_proj`` when its own backward runs. That is
always after every later layer's backward: a later layer's K/V depend, through the residual stream,
on this layer's output, so autograd's reverse topological order guarantees the block is complete.
"""

from __future__ import annotations

import torch

LAYOUTS = {"matrix": "position-major", "per-dim": "feature-major", "per-position": "position-outer"}


class KVBuffer:
    """Per-forward storage of every layer's raw K/V heads (see module docstring for the layouts).

    Args:
        num_layers: number of attention layers L.
        num_kv_heads: K/V heads per layer (``kv``).
        head_dim: features per head.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers, self.kv, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layout = "position-major"  # fixed by the first write
        self.data: list[torch.Tensor] = []  # [keys, values]
        self.grad: list[torch.Tensor] = []
        self.grad_ready = [False] * num_layers  # has a gradient block received its first contribution?

    def block(self, data: torch.Tensor, start_layer: int, stop_layer: int) -> torch.Tensor:
        """The heads of layers ``start_layer .. stop_layer - 1`` in ``data`` (a buffer or its gradient)
        as a view ``[n, *row]`` with the head axis first, whatever the layout."""
        heads = slice(start_layer * self.kv, stop_layer * self.kv)
        if self.layout == "position-outer":
            return data[:, heads].transpose(0, 1)
        return data[heads]

    def heads(self, rows: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """A ``(n, B, T, head_dim)`` view of ``n`` heads ``rows [n, *row]`` (as :meth:`block` gives)."""
        if self.layout == "feature-major":
            return rows.view(-1, self.head_dim, B, T).permute(0, 2, 3, 1)
        return rows.view(-1, B, T, self.head_dim)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, mode: str) -> None:
        """Store layer ``layer_idx``'s raw ``keys``/``values``, each ``(B, T, kv * head_dim)``;
        the first write allocates the buffer in the layout of read ``mode`` (:data:`LAYOUTS`)."""
        B, T, _ = keys.shape
        if not self.data:
            self.layout = LAYOUTS[mode]
            shape = {
                "position-major": (self.num_layers * self.kv, B * T, self.head_dim),
                "feature-major": (self.num_layers * self.kv, self.head_dim, B * T),
                "position-outer": (B * T, self.num_layers * self.kv, self.head_dim),
            }[self.layout]
            self.data = [keys.new_empty(shape) for _ in range(2)]
        for store, x in zip(self.data, (keys, values), strict=True):
            block = self.heads(self.block(store, layer_idx, layer_idx + 1), B, T)
            block.copy_(x.view(B, T, self.kv, self.head_dim).permute(2, 0, 1, 3))

    def split_ready(self, start_layer: int, stop_layer: int) -> list[tuple[int, int]]:
        """Split a layer range into maximal sub-ranges whose gradient blocks share one ready state."""
        parts: list[tuple[int, int]] = []
        for layer in range(start_layer, stop_layer):
            if parts and self.grad_ready[parts[-1][0]] == self.grad_ready[layer]:
                parts[-1] = (parts[-1][0], layer + 1)
            else:
                parts.append((layer, layer + 1))
        return parts

    def add_to_grad(self, grad: torch.Tensor, start_layer: int, stop_layer: int, value: torch.Tensor) -> None:
        """``grad[blocks] += value`` over layers of one ready state (assigns into fresh blocks)."""
        block = self.block(grad, start_layer, stop_layer)
        block.add_(value) if self.grad_ready[start_layer] else block.copy_(value)

    def beta(self, start_layer: int) -> float:
        """``beta`` for an in-place ``addmm_``/``baddbmm_`` into gradient blocks of one ready state:
        0 overwrites fresh blocks (and ignores their uninitialised memory, NaN included)."""
        return 1.0 if self.grad_ready[start_layer] else 0.0

    def mark_ready(self, layers: list[int]) -> None:
        for layer in layers:
            self.grad_ready[layer] = True

    def take_grad(self, layer_idx: int, shape: torch.Size) -> list[torch.Tensor]:
        """Gradients w.r.t. layer ``layer_idx``'s raw keys and values, each of ``shape`` (B, T, kv*hd)."""
        B, T, _ = shape
        grads = []
        for grad in self.grad:
            block = self.heads(self.block(grad, layer_idx, layer_idx + 1), B, T)
            grads.append(block.permute(1, 2, 0, 3).reshape(shape))
        self.grad_ready[layer_idx] = False  # a second backward over a retained graph starts afresh
        return grads


def contiguous_runs(sources: list[int]) -> list[tuple[int, int, int]]:
    """Split ascending layer indices into runs ``(first_layer, stop_layer, position_in_sources)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, layer in enumerate(sources):
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1, runs[-1][2])
        else:
            runs.append((layer, layer + 1, pos))
    return runs


def _mix(weight: torch.Tensor | None, data: torch.Tensor, buffer: KVBuffer, own: int, runs, mode: str):
    """Routed heads ``[kv, *row]`` (head axis first, as :meth:`KVBuffer.block` gives) from buffered
    ``data`` in its layout (modes: :class:`_RoutedRead`)."""
    kv = buffer.kv
    if weight is None:
        return buffer.block(data, own, own + 1).clone()
    if mode == "matrix":
        out = None
        for first, stop, pos in runs:
            src = buffer.block(data, first, stop).flatten(1)
            w = weight[:, pos * kv : (pos + stop - first) * kv]
            out = w @ src if out is None else torch.addmm(out, w, src)
        return out.view(kv, *data.shape[1:])
    ((first, stop, _),) = runs  # per-dim and per-position read a contiguous range
    src = buffer.block(data, first, stop)
    if mode == "per-dim":  # feature-major: one [kv, S] @ [S, B*T] product per feature e
        return torch.bmm(weight.permute(2, 0, 1), src.transpose(0, 1)).transpose(0, 1)
    # position-outer: one [kv, S] @ [S, hd] product per position m
    return torch.bmm(weight, src.transpose(0, 1)).transpose(0, 1)


def _mix_backward(
    weight, grad_out, data, grad_data, buffer: KVBuffer, own: int, runs, mode: str, need_w: bool
):
    """Add ``d out / d data`` into ``grad_data``; return ``d out / d weight`` (or None).

    Gradient blocks no later layer has written yet are assigned rather than added, which spares
    zero-filling the gradient buffer.
    """
    kv = buffer.kv
    if weight is None:
        buffer.add_to_grad(grad_data, own, own + 1, grad_out)
        return None
    if mode == "matrix":
        g = grad_out.flatten(1)
        grad_w = torch.empty_like(weight) if need_w else None
        for first, stop, pos in runs:
            if need_w:
                cols = slice(pos * kv, (pos + stop - first) * kv)
                grad_w[:, cols] = g @ buffer.block(data, first, stop).flatten(1).t()
            for a, b in buffer.split_ready(first, stop):
                w = weight[:, (pos + a - first) * kv : (pos + b - first) * kv]
                buffer.block(grad_data, a, b).flatten(1).addmm_(w.t(), g, beta=buffer.beta(a))
        return grad_w
    ((first, stop, _),) = runs
    src = buffer.block(data, first, stop)
    if mode == "per-dim":  # feature-major, batched over features e as in _mix
        g = grad_out.transpose(0, 1)  # [hd, kv, B*T]
        for a, b in buffer.split_ready(first, stop):
            w = weight[:, (a - first) * kv : (b - first) * kv].permute(2, 1, 0)  # [hd, s, kv]
            buffer.block(grad_data, a, b).transpose(0, 1).baddbmm_(w, g, beta=buffer.beta(a))
        return torch.bmm(g, src.permute(1, 2, 0)).permute(1, 2, 0) if need_w else None
    g = grad_out.transpose(0, 1)  # position-outer, batched over positions m as in _mix: [B*T, kv, hd]
    # One bmm, then an add: baddbmm_ into these strided gradient blocks loops over positions in torch.
    contribution = torch.bmm(weight.transpose(1, 2), g).transpose(0, 1)  # [S*kv, B*T, hd]
    for a, b in buffer.split_ready(first, stop):
        buffer.add_to_grad(grad_data, a, b, contribution[(a - first) * kv : (b - first) * kv])
    return torch.bmm(g, src.permute(1, 2, 0)) if need_w else None


class _RoutedRead(torch.autograd.Function):
    """Write this layer's K/V into the buffer, then return the router-weighted mix of its sources.

    ``mode`` fixes how ``weight`` combines the ``S`` buffered source heads (``m`` indexes the B*T
    positions, ``e`` the head_dim features); the same weights mix keys and values:

    - ``"matrix"``: ``weight [kv, S]``, ``out[h, m, e] = sum_s weight[h, s] src[s, m, e]``;
      ``None`` means the identity on the layer's own heads (a single source).
    - ``"per-dim"``: ``weight [kv, S, hd]``, ``out[h, m, e] = sum_s weight[h, s, e] src[s, m, e]``.
    - ``"per-position"``: ``weight [B*T, kv, S]``, ``out[h, m, e] = sum_s weight[m, h, s] src[s, m, e]``.

    Returns routed keys and values, each ``[kv, *row]`` in the buffer's row layout.
    """

    @staticmethod
    def forward(ctx, weight, keys, values, buffer: KVBuffer, layer_idx: int, sources, mode: str):
        buffer.write(layer_idx, keys, values, mode)
        runs = contiguous_runs(sources)
        out = [_mix(weight, data, buffer, layer_idx, runs, mode) for data in buffer.data]
        ctx.buffer, ctx.layer_idx, ctx.sources, ctx.runs = buffer, layer_idx, sources, runs
        ctx.mode, ctx.kv_shape = mode, keys.shape
        ctx.save_for_backward(weight)
        return out[0], out[1]

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        (weight,) = ctx.saved_tensors
        buffer = ctx.buffer
        if not buffer.grad:
            buffer.grad = [torch.empty_like(d) for d in buffer.data]
        grad_w = None
        for grad_out, data, grad_data in zip((grad_keys, grad_values), buffer.data, buffer.grad, strict=True):
            gw = _mix_backward(
                weight,
                grad_out,
                data,
                grad_data,
                buffer,
                ctx.layer_idx,
                ctx.runs,
                ctx.mode,
                ctx.needs_input_grad[0],
            )
            grad_w = gw if grad_w is None else grad_w + gw
        buffer.mark_ready(ctx.sources)
        grad_k, grad_v = buffer.take_grad(ctx.layer_idx, ctx.kv_shape)
        return grad_w, grad_k, grad_v, None, None, None, None


def routed_read(
    buffer: KVBuffer,
    layer_idx: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    weight: torch.Tensor | None,
    sources: list[int],
    mode: str = "matrix",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append this layer's raw K/V to ``buffer`` and read the routed mix of its ``sources``.

    Args:
        keys, values: raw ``k_proj``/``v_proj`` outputs ``(B, T, kv * head_dim)``.
        weight: routing weights for ``mode`` (see :class:`_RoutedRead`); ``None`` = own heads only.
        sources: ascending layer indices, ``layer_idx`` last.

    Returns:
        Routed ``(keys, values)``, each ``(B, kv, T, head_dim)`` (keys before RoPE).
    """
    B, T, _ = keys.shape
    routed = _RoutedRead.apply(weight, keys, values, buffer, layer_idx, sources, mode)
    return tuple(buffer.heads(x, B, T).transpose(0, 1) for x in routed)
