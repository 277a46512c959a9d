"""The K/V buffer shared by the attention layers of one LIMe forward pass, and the routed read.

Layout: one contiguous tensor ``data`` of shape ``[L * kv, B * T, 2 * head_dim]``: row block ``j``
holds layer j's raw keys (first ``head_dim`` features) and values (last ``head_dim``), one row per
K/V head. Mixing the buffered heads with a router matrix ``R [kv, S * kv]`` is then a single GEMM
over a contiguous row range, for keys and values at once.

Why a custom autograd function: building the sources with ``torch.cat`` at every layer copies the
whole buffer L times and makes backward keep all those copies (O(L^2) memory and traffic). Here each
layer writes its own block once; backward accumulates ``R^T @ grad`` into a matching gradient buffer,
and a layer hands its block's gradient to ``k_proj``/``v_proj`` when its own backward runs. That is
always after every later layer's backward: a later layer's keys depend, through the residual stream,
on this layer's output, so autograd's reverse topological order guarantees the block is complete.
"""

from __future__ import annotations

import torch


class KVBuffer:
    """Per-forward storage of every layer's raw K/V heads (see module docstring for the layout).

    Args:
        num_layers: number of attention layers L.
        num_kv_heads: K/V heads per layer (``kv``).
        head_dim: features per head.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers, self.kv, self.head_dim = num_layers, num_kv_heads, head_dim
        self.data: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None

    def rows(self, start_layer: int, stop_layer: int) -> slice:
        return slice(start_layer * self.kv, stop_layer * self.kv)

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store layer ``layer_idx``'s raw ``keys``/``values``, each ``(B, T, kv * head_dim)``."""
        B, T, _ = keys.shape
        if self.data is None:
            self.data = keys.new_empty(self.num_layers * self.kv, B * T, 2 * self.head_dim)
        block = self.data[self.rows(layer_idx, layer_idx + 1)].view(self.kv, B, T, 2 * self.head_dim)
        block[..., : self.head_dim].copy_(keys.view(B, T, self.kv, self.head_dim).permute(2, 0, 1, 3))
        block[..., self.head_dim :].copy_(values.view(B, T, self.kv, self.head_dim).permute(2, 0, 1, 3))

    def take_grad(self, layer_idx: int, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient w.r.t. layer ``layer_idx``'s raw keys and values, each of ``shape`` (B, T, kv*hd)."""
        B, T, _ = shape
        block = self.grad[self.rows(layer_idx, layer_idx + 1)].view(self.kv, B, T, 2 * self.head_dim)
        block = block.permute(1, 2, 0, 3)
        grad_k = block[..., : self.head_dim].reshape(shape)
        grad_v = block[..., self.head_dim :].reshape(shape)
        block.zero_()  # a second backward over a retained graph starts from zero
        return grad_k, grad_v


def contiguous_runs(sources: list[int]) -> list[tuple[int, int, int]]:
    """Split ascending layer indices into runs ``(first_layer, stop_layer, position_in_sources)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, layer in enumerate(sources):
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1, runs[-1][2])
        else:
            runs.append((layer, layer + 1, pos))
    return runs


class _RoutedRead(torch.autograd.Function):
    """Write this layer's K/V into the buffer, then return the router-weighted mix of its sources.

    ``mode`` fixes how ``weight`` combines the ``S`` source heads (``m`` indexes B*T positions,
    ``e`` the 2*head_dim K|V features):

    - ``"matrix"``: ``weight [kv, S]``, ``out[h, m, e] = sum_s weight[h, s] src[s, m, e]``;
      ``None`` means the identity on the layer's own heads (a single source).
    - ``"per-dim"``: ``weight [kv, S, 2*hd]``, ``out[h, m, e] = sum_s weight[h, s, e] src[s, m, e]``.
    - ``"per-position"``: ``weight [B*T, kv, S]``, ``out[h, m, e] = sum_s weight[m, h, s] src[s, m, e]``.

    Returns ``[kv, B*T, 2*hd]``.
    """

    @staticmethod
    def forward(ctx, weight, keys, values, buffer: KVBuffer, layer_idx: int, sources, mode: str):
        buffer.write(layer_idx, keys, values)
        data, kv = buffer.data, buffer.kv
        runs = contiguous_runs(sources)
        if weight is None:
            out = data[buffer.rows(layer_idx, layer_idx + 1)].clone()
        elif mode == "matrix":
            out = None
            for first, stop, pos in runs:
                src = data[buffer.rows(first, stop)].flatten(1)
                w = weight[:, pos * kv : (pos + stop - first) * kv]
                out = w @ src if out is None else torch.addmm(out, w, src)
            out = out.view(kv, *data.shape[1:])
        else:
            ((first, stop, _),) = runs  # per-dim and per-position read a contiguous range
            src = data[buffer.rows(first, stop)]
            out = torch.einsum("hse,sme->hme" if mode == "per-dim" else "mhs,sme->hme", weight, src)
        ctx.buffer, ctx.layer_idx, ctx.runs, ctx.mode, ctx.kv_shape = (
            buffer,
            layer_idx,
            runs,
            mode,
            keys.shape,
        )
        ctx.save_for_backward(weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        buffer, kv = ctx.buffer, ctx.buffer.kv
        if buffer.grad is None:
            buffer.grad = torch.zeros_like(buffer.data)
        data, grad_data = buffer.data, buffer.grad
        grad_w = None
        if weight is None:
            grad_data[buffer.rows(ctx.layer_idx, ctx.layer_idx + 1)] += grad_out
        elif ctx.mode == "matrix":
            g = grad_out.flatten(1)
            grad_w = torch.empty_like(weight) if ctx.needs_input_grad[0] else None
            for first, stop, pos in ctx.runs:
                cols = slice(pos * kv, (pos + stop - first) * kv)
                rows = buffer.rows(first, stop)
                if grad_w is not None:
                    grad_w[:, cols] = g @ data[rows].flatten(1).t()
                grad_data[rows].flatten(1).addmm_(weight[:, cols].t(), g)
        else:
            ((first, stop, _),) = ctx.runs
            rows = buffer.rows(first, stop)
            w_spec, g_spec = ("hse", "hme") if ctx.mode == "per-dim" else ("mhs", "hme")
            if ctx.needs_input_grad[0]:
                grad_w = torch.einsum(f"{g_spec},sme->{w_spec}", grad_out, data[rows])
            grad_data[rows] += torch.einsum(f"{w_spec},{g_spec}->sme", weight, grad_out)
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
    out = _RoutedRead.apply(weight, keys, values, buffer, layer_idx, sources, mode)
    out = out.view(buffer.kv, B, T, 2 * buffer.head_dim).transpose(0, 1)
    return out[..., : buffer.head_dim], out[..., buffer.head_dim :]
