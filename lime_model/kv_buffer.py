"""The K/V buffer shared by the attention layers of one LIMe forward pass, and the routed read.

Layout: one contiguous tensor ``[L * kv, a, 2, b]`` holds every layer's raw keys (pair index 0) and
values (1); row block ``j`` (rows ``j * kv .. (j + 1) * kv``) is layer j's heads. The same router
weights mix keys and values, so mixing both with ``R [kv, S * kv]`` is ONE GEMM over a contiguous
row range. The K/V pair axis sits between the position and feature axes so that both per-position
and per-feature weights can still batch over theirs; the row order depends on how the weights vary:

- position-major ``a, b = B * T, head_dim`` (default): routed heads come out in the layout
  attention wants (``head_dim`` innermost), and per-position weights batch over positions;
- feature-major ``a, b = head_dim, B * T`` for per-dim weights (one mixing matrix per feature):
  each feature's sources are then a strided matrix with unit-stride rows, so the mix is one batched
  GEMM over features instead of a permuted copy of every source at every layer.

Why a custom autograd function: building the sources with ``torch.cat`` at every layer copies the
buffer L times and makes backward keep every copy (O(L^2) memory and traffic). Here each layer
writes its own block once. In backward, layer l stores the gradient of its routed K/V (its block of
``grad_out``, same layout) and computes its router's gradient; the gradient of layer j's *raw* K/V,
``sum over readers l of R_l[:, block j]^T @ grad_out_l``, is computed when layer j's own backward
runs, as one mix of the readers' stored gradients with their transposed weight blocks. Layer j's
backward always runs after every later layer's: a later layer's K/V depend, through the residual
stream, on this layer's output, so autograd's reverse topological order guarantees that every reader
has stored its gradient by then. Compared with accumulating ``R_l^T @ grad_out_l`` into a gradient
buffer at every layer, this reads each stored gradient once per reader and writes each raw gradient
once, instead of a read-modify-write of every source block at every layer.
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
        self.feature_major = False  # fixed by the first write
        self.data: torch.Tensor | None = None  # [L * kv, a, 2, b]
        self.grad_out: torch.Tensor | None = None  # same layout: d loss / d (layer l's routed K/V)
        self.grad_ready = [False] * num_layers  # has layer l stored its grad_out block in this backward?
        # per layer, from its forward: (sources, read mode, detached weight or None = own heads only)
        self.reads: list[tuple[list[int], str, torch.Tensor | None] | None] = [None] * num_layers

    def rows(self, start_layer: int, stop_layer: int) -> slice:
        return slice(start_layer * self.kv, stop_layer * self.kv)

    def pair(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``rows [n, a, 2, b]`` (either layout), each as an ``[n, B*T, head_dim]`` view."""
        keys, values = rows.unbind(2)
        if self.feature_major:
            return keys.transpose(1, 2), values.transpose(1, 2)
        return keys, values

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, feature_major: bool) -> None:
        """Store layer ``layer_idx``'s raw ``keys``/``values``, each ``(B, T, kv * head_dim)``;
        the first write allocates the buffer in the layout ``feature_major`` names."""
        B, T, _ = keys.shape
        if self.data is None:
            self.feature_major = feature_major
            a, b = (self.head_dim, B * T) if feature_major else (B * T, self.head_dim)
            self.data = keys.new_empty(self.num_layers * self.kv, a, 2, b)
        block = self.data[self.rows(layer_idx, layer_idx + 1)]
        for dst, x in zip(self.pair(block), (keys, values), strict=True):
            dst.copy_(x.view(B * T, self.kv, self.head_dim).transpose(0, 1))

    def store_grad_out(
        self, layer_idx: int, grad_keys: torch.Tensor, grad_values: torch.Tensor
    ) -> torch.Tensor:
        """Keep layer ``layer_idx``'s routed-K/V gradients (each ``[kv, B*T, hd]``); returns its block."""
        if self.grad_out is None:  # pages are touched block by block as layers store theirs
            self.grad_out = torch.empty_like(self.data)
        block = self.grad_out[self.rows(layer_idx, layer_idx + 1)]
        for dst, g in zip(self.pair(block), (grad_keys, grad_values), strict=True):
            dst.copy_(g)
        self.grad_ready[layer_idx] = True
        return block

    def raw_grad(self, layer_idx: int, shape: torch.Size) -> list[torch.Tensor]:
        """Gradients w.r.t. layer ``layer_idx``'s raw keys and values, each of ``shape (B, T, kv*hd)``:
        the readers' stored gradients mixed with their transposed weight blocks for this layer."""
        readers = [
            (reader, read[0].index(layer_idx))
            for reader, read in enumerate(self.reads)
            if reader >= layer_idx and read is not None and layer_idx in read[0] and self.grad_ready[reader]
        ]
        first, stop = readers[0][0], readers[-1][0] + 1
        modes = {self.reads[reader][1] for reader, _ in readers}
        # a single-source layer reads in "matrix" mode; it joins the finer mode of the other readers
        mode = "per-position" if "per-position" in modes else "per-dim" if "per-dim" in modes else "matrix"
        blocks = {reader: self._weight_block(reader, pos, mode) for reader, pos in readers}
        gap = torch.zeros_like(next(iter(blocks.values())))  # a layer in [first, stop) that is no reader
        for layer in range(first, stop):
            if layer not in blocks and not self.grad_ready[layer]:  # its block was never stored: no NaN
                self.grad_out[self.rows(layer, layer + 1)].zero_()
        blocks = [blocks.get(layer, gap) for layer in range(first, stop)]
        weight = torch.cat(blocks, dim=-2 if mode == "per-dim" else -1)
        g = _mix(weight, self.grad_out, self, [(first, stop, 0)], mode)
        for reader, read in enumerate(self.reads):  # layer_idx was the last consumer of these blocks
            if read is not None and read[0][0] == layer_idx:
                self.grad_ready[reader] = False  # a second backward over a retained graph starts afresh
        return [x.transpose(0, 1).reshape(shape) for x in self.pair(g)]

    def _weight_block(self, reader: int, pos: int, mode: str) -> torch.Tensor:
        """``reader``'s weight for its source ``pos``, transposed (source head first), in ``mode``'s
        shape: ``[kv, kv]`` matrix, ``[kv, kv, hd]`` per-dim, ``[B*T, kv, kv]`` per-position."""
        _, reader_mode, weight = self.reads[reader]
        kv = self.kv
        if weight is None:  # own heads only
            block = torch.eye(kv, dtype=self.data.dtype, device=self.data.device)
        elif reader_mode == "per-position":
            return weight[:, :, pos * kv : (pos + 1) * kv].transpose(1, 2)
        elif reader_mode == "per-dim":
            return weight[:, pos * kv : (pos + 1) * kv].transpose(0, 1)
        else:
            block = weight[:, pos * kv : (pos + 1) * kv].t()
        if mode == "per-dim":
            return block[:, :, None].expand(kv, kv, self.head_dim)
        if mode == "per-position":
            return block.expand(self.data.shape[1], kv, kv)
        return block


def contiguous_runs(sources: list[int]) -> list[tuple[int, int, int]]:
    """Split ascending layer indices into runs ``(first_layer, stop_layer, position_in_sources)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, layer in enumerate(sources):
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1, runs[-1][2])
        else:
            runs.append((layer, layer + 1, pos))
    return runs


def _mix(weight: torch.Tensor | None, data: torch.Tensor, buffer: KVBuffer, runs, mode: str) -> torch.Tensor:
    """Routed heads ``[kv, a, 2, b]`` from ``data [L*kv, a, 2, b]``'s ``runs`` (modes: :class:`_RoutedRead`);
    ``weight`` None: the one run's heads unchanged (a copy)."""
    kv = buffer.kv
    if weight is None:
        ((first, stop, _),) = runs
        return data[buffer.rows(first, stop)].clone()
    if mode == "matrix":  # [kv, S*kv] @ [S*kv, a*2*b]: keys and values in one product
        out = None
        for first, stop, pos in runs:
            src = data[buffer.rows(first, stop)].flatten(1)
            w = weight[:, pos * kv : (pos + stop - first) * kv]
            out = w @ src if out is None else torch.addmm(out, w, src)
        return out.view(-1, *data.shape[1:])
    ((first, stop, _),) = runs  # per-dim and per-position read a contiguous range
    src = data[buffer.rows(first, stop)].flatten(2).transpose(0, 1)  # [a, S*kv, 2*b]
    # per-dim (feature-major): one [kv, S] @ [S, 2*B*T] product per feature; per-position: one
    # [kv, S] @ [S, 2*hd] product per position
    out = torch.bmm(weight.permute(2, 0, 1) if mode == "per-dim" else weight, src)
    return out.transpose(0, 1).unflatten(2, data.shape[2:])  # [a, kv, 2*b] -> [kv, a, 2, b]


def _weight_grad(grad_out: torch.Tensor, data: torch.Tensor, buffer: KVBuffer, runs, weight, mode: str):
    """``d loss / d weight`` from ``grad_out [kv, a, 2, b]`` (keys' and values' parts summed)."""
    kv = buffer.kv
    if mode == "matrix":
        g = grad_out.flatten(1)
        grad_w = torch.empty_like(weight)
        for first, stop, pos in runs:
            src = data[buffer.rows(first, stop)].flatten(1)
            grad_w[:, pos * kv : (pos + stop - first) * kv] = g @ src.t()
        return grad_w
    ((first, stop, _),) = runs
    src = data[buffer.rows(first, stop)].flatten(2).permute(1, 2, 0)  # [a, 2*b, S*kv]
    grad_w = torch.bmm(grad_out.flatten(2).transpose(0, 1), src)  # [a, kv, S*kv]
    return grad_w.permute(1, 2, 0) if mode == "per-dim" else grad_w


class _RoutedRead(torch.autograd.Function):
    """Write this layer's K/V into the buffer, then return the router-weighted mix of its sources.

    ``mode`` fixes how ``weight`` combines the ``S`` buffered source heads (``m`` indexes the B*T
    positions, ``e`` the head_dim features); the same weights mix keys and values:

    - ``"matrix"``: ``weight [kv, S]``, ``out[h, m, e] = sum_s weight[h, s] src[s, m, e]``;
      ``None`` means the identity on the layer's own heads (a single source).
    - ``"per-dim"``: ``weight [kv, S, hd]``, ``out[h, m, e] = sum_s weight[h, s, e] src[s, m, e]``.
    - ``"per-position"``: ``weight [B*T, kv, S]``, ``out[h, m, e] = sum_s weight[m, h, s] src[s, m, e]``.

    Returns routed keys and values, each an ``[kv, B*T, hd]`` view.
    """

    @staticmethod
    def forward(ctx, weight, keys, values, buffer: KVBuffer, layer_idx: int, sources, mode: str):
        buffer.write(layer_idx, keys, values, feature_major=mode == "per-dim")
        runs = contiguous_runs(sources)
        # detached: the buffer must not hold a per-position weight's graph (a reference cycle via ctx)
        buffer.reads[layer_idx] = (sources, mode, None if weight is None else weight.detach())
        out = _mix(weight, buffer.data, buffer, runs, mode)
        ctx.buffer, ctx.layer_idx, ctx.runs, ctx.kv_shape = buffer, layer_idx, runs, keys.shape
        return buffer.pair(out)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        buffer, layer_idx = ctx.buffer, ctx.layer_idx
        _, mode, weight = buffer.reads[layer_idx]
        grad_out = buffer.store_grad_out(layer_idx, grad_keys, grad_values)
        grad_w = None
        if ctx.needs_input_grad[0]:
            grad_w = _weight_grad(grad_out, buffer.data, buffer, ctx.runs, weight, mode)
        grad_k, grad_v = buffer.raw_grad(layer_idx, ctx.kv_shape)
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
    return tuple(x.unflatten(1, (B, T)).transpose(0, 1) for x in routed)
