"""The routed read: each layer writes its raw K/V into the forward's ``KVBuffer`` and reads the mix
of its sources, eagerly through a custom autograd function and under ``torch.compile`` through two
custom operators on one graph-allocated buffer.

Why a custom autograd function: building the sources with ``torch.cat`` at every layer copies the
buffer L times and makes backward keep every copy (O(L^2) memory and traffic). Here each layer
writes its own block once. In backward each layer keeps the gradient w.r.t. its routed K/V (one
small tensor per layer, so nothing is added at the step's memory peak), and the gradient w.r.t. a
layer's raw K/V is read like a routed read: its readers' kept gradients mixed by their transposed
weights, which on the CPU is faster than scattering ``R^T @ grad`` from each reader into every
source's block. A layer computes it when its own backward runs, after every reader's (see the links
below).

Under ``torch.compile`` the same read runs as two custom operators (``_read``, ``_read_backward``):
Dynamo cannot trace the custom function (its backward changes the buffer's Python state across layers,
so each routed layer would break the graph), but it puts an operator into the graph unopened. The graph
allocates the buffer (one chunk per tensor) and each layer's operator writes its heads into it and
reads its mix; the backward operator keeps the gradients across layers as the custom function does.
So the compiled step moves and keeps what the eager one does: each raw K/V written once, no
concatenated copy of a layer's sources saved for backward (O(L) memory, not O(L^2)).

Every read also returns a *link*, a scalar that its readers' reads take as an input (``KVBuffer.links``),
so that autograd runs a layer's backward after, and whenever, a reader's runs: it is that backward which
mixes the readers' gradients into the layer's raw K/V, needed even when the layer's own routed K/V reach
no loss (an intervention replaced them). Layer 0's read, linked from every other, runs backward last.
Off the CPU it takes the static matrix weights whose gradients their sources' backward computes in the
same pass as their raw K/V's (``KVBuffer.defer_weight_grads``, ``lime_model.kv_kernels``) and returns them.
"""

from __future__ import annotations

import re
import weakref
import zlib
from pathlib import Path
from typing import Any

import torch

from .kv_buffer import LAYOUTS, KVBuffer
from .kv_kernels import contiguous_runs


class _RoutedRead(torch.autograd.Function):
    """Write this layer's K/V into the buffer, then return the router-weighted mix of its sources.

    ``mode`` fixes how ``weight`` combines the ``S`` buffered source heads (``m`` indexes the B*T
    positions, ``e`` the head_dim features); the same weights mix keys and values:

    - ``"matrix"``: ``weight [kv, S]``, ``out[h, m, e] = sum_s weight[h, s] src[s, m, e]``;
      ``None`` means the identity on the layer's own heads (a single source).
    - ``"per-dim"``: ``weight [kv, S, hd]``, ``out[h, m, e] = sum_s weight[h, s, e] src[s, m, e]``.
    - ``"per-position"``: ``weight [B*T, kv, S]``, ``out[h, m, e] = sum_s weight[m, h, s] src[s, m, e]``.

    ``links`` (the first ``n_links`` of ``extra``) are the earlier reads' ``KVBuffer.links``; the rest
    are the weights whose gradients this read's backward returns (``KVBuffer.defer_weight_grads``).
    Returns routed keys and values, each ``[kv, *row]`` in the buffer's row layout, and this read's link.
    """

    @staticmethod
    def forward(
        ctx, weight, keys, values, buffer: KVBuffer, layer_idx: int, sources, mode: str, n_links, *extra
    ):
        buffer.write(layer_idx, keys, values, weight, sources, mode)
        out = [buffer.read(data, layer_idx, weight, sources, mode) for data in buffer.data]
        ctx.buffer, ctx.layer_idx, ctx.runs = buffer, layer_idx, contiguous_runs(sources)
        ctx.mode, ctx.kv_shape, ctx.n_links = mode, keys.shape, n_links
        ctx.carried = list(buffer.deferred) if len(extra) > n_links else []
        return out[0], out[1], keys.new_zeros(())

    @staticmethod
    def backward(ctx, grad_keys, grad_values, grad_link):
        grad_w, grad_k, grad_v = ctx.buffer.backward(
            ctx.layer_idx, (grad_keys, grad_values), ctx.runs, ctx.mode, ctx.kv_shape, ctx.needs_input_grad[0]
        )
        links = [grad_link] * ctx.n_links  # zeros: the link carries no gradient, only the order
        carried = ctx.buffer.pop_weight_grads(ctx.carried)
        return grad_w, grad_k, grad_v, None, None, None, None, None, *links, *carried


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
        weight: routing weights for ``mode`` (see ``_RoutedRead``); ``None`` = own heads only.
        sources: ascending layer indices, ``layer_idx`` last.

    Returns:
        Routed ``(keys, values)``, each ``(B, kv, T, head_dim)`` (keys before RoPE).
    """
    B, T, _ = keys.shape
    # layer 0's read, the last to run backward, returns the deferred weights' gradients
    carried = [w for w in buffer.deferred.values() if w is not None] if layer_idx == 0 else []
    # every read links to its sources' and to layer 0's, whose backward must follow its own
    links = [link for j in sorted({0, *sources} - {layer_idx}) if (link := buffer.links[j]) is not None]
    if torch.compiler.is_compiling():  # the operators below: the graph allocates the buffer, one chunk
        if buffer.tensor is None:
            buffer.layout = LAYOUTS[mode]
            buffer.tensor = keys.new_empty(2, *buffer.chunk_shape(buffer.num_layers, B * T))
        deferred = layer_idx in buffer.deferred
        layers = list(buffer.deferred) if carried else []
        args = (weight, layer_idx, sources, mode, buffer.kv, deferred, carried, layers, links)
        routed = READ(buffer.tensor, keys, values, *args)
    else:
        routed = _RoutedRead.apply(
            weight, keys, values, buffer, layer_idx, sources, mode, len(links), *links, *carried
        )
    # a link's node holds the buffer: kept until the last layer's read, it would close a reference cycle
    if torch.is_grad_enabled():
        buffer.links[layer_idx] = routed[2]
    if layer_idx == buffer.num_layers - 1:
        buffer.links = [None] * buffer.num_layers
    return buffer.attention_heads(routed[0], B, T), buffer.attention_heads(routed[1], B, T)


# The operators hide the buffer's Python state from the compiler, which takes them as pure: ``read``
# writes its layer's block of ``data`` without saying so. That is safe because nothing else reads the
# buffer and every layer's call depends, through the residual stream, on the previous layer's; the
# compiler keeps the order, and ``data`` (saved for backward) alive until the last backward operator.
# Not for CUDA graphs: the backward operators' state lives between their calls.
# One namespace per module name and source (this module's and the modules its operators run): a
# checkpoint's copy (remote code, perhaps of another version) may be imported beside this one; the same
# sources under the same name reuse their operators.
_MODULE = re.sub(r"\W", "_", __name__)
_SOURCES = b"".join((Path(__file__).parent / name).read_bytes() for name in ("kv_buffer.py", "kv_kernels.py"))
_LIB = f"lime_{_MODULE}_{zlib.crc32(_SOURCES + Path(__file__).read_bytes()):08x}"
_TAGS = tuple(t for t in [getattr(torch.Tag, "cudagraph_unsafe", None)] if t is not None)  # torch >= 2.8

# per buffer (by its data's address; alive while the buffer is), the state of a backward pass
_BACKWARD: dict[int, KVBuffer] = {}


def _read(
    data: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weight: torch.Tensor | None,
    layer_idx: int,
    sources: list[int],
    mode: str,
    kv: int,
    deferred: bool,
    carried: list[torch.Tensor],
    carried_layers: list[int],
    links: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write ``keys``/``values`` into the buffer ``data`` (``KVBuffer.over``) and read the routed heads,
    each ``[kv, *row]`` as ``KVBuffer.read`` gives them, made contiguous (``_read_fake``), and this
    read's link (``KVBuffer.links``; ``links``: its sources'). ``deferred``: the sources' backward
    computes this layer's weight gradient; ``carried`` (layer 0's read): the weights of
    ``carried_layers``, whose gradients its backward returns (``KVBuffer.defer_weight_grads``)."""
    buffer = KVBuffer.over(_unversioned(data), kv, mode)
    buffer.put(layer_idx, keys, values)
    k, v = (buffer.read(d, layer_idx, weight, sources, mode).contiguous() for d in buffer.data)
    return k, v, keys.new_zeros(())


def _unversioned(x: torch.Tensor) -> torch.Tensor:
    """``x``'s memory under a version counter of its own. Autograd saves the buffer for every layer's
    backward and refuses a saved tensor written since (run eagerly, as the ``eager`` compile backend
    does); each layer's backward reads only the blocks written before its forward, which later
    layers' writes leave alone."""
    with torch.no_grad():
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.shape, x.stride())


def _read_fake(data, keys, values, weight, layer_idx, sources, mode, kv, *rest):
    """Shapes only: each routed tensor is ``kv`` rows like one buffered head's; the link a scalar."""
    row = data[0].select(1 if mode == "per-position" else 0, 0).shape
    return data.new_empty(kv, *row), data.new_empty(kv, *row), keys.new_empty(())


def _read_backward(
    grad_keys: torch.Tensor,
    grad_values: torch.Tensor,
    data: torch.Tensor,
    weight: torch.Tensor | None,
    layer_idx: int,
    sources: list[int],
    mode: str,
    kv: int,
    shape: list[int],
    weight_grad: bool,
    deferred: bool,
    carried: list[torch.Tensor],
    carried_layers: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``KVBuffer.backward`` of layer ``layer_idx`` on the buffer ``data``; the weight's gradient is
    empty unless ``weight_grad``, and so is a carried weight's whose reader's backward did not run
    (``_read``). The pass's state (readers, kept gradients, deferred weight gradients) starts at the
    first layer to run backward and is dropped after layer 0's or with ``data``."""
    key = data.data_ptr()
    buffer = _BACKWARD.get(key)
    if buffer is None or layer_idx >= buffer.last_backward:  # a new pass
        buffer = _BACKWARD[key] = KVBuffer.over(data, kv, mode)
        weakref.finalize(data, _BACKWARD.pop, key, None)
    buffer.last_backward = layer_idx
    buffer.add_reader(layer_idx, weight, sources)
    if deferred:
        buffer.deferred[layer_idx] = None
    grad_w, grad_k, grad_v = buffer.backward(
        layer_idx, (grad_keys, grad_values), contiguous_runs(sources), mode, torch.Size(shape), weight_grad
    )
    grads = buffer.pop_weight_grads(carried_layers)
    if layer_idx == 0:
        _BACKWARD.pop(key, None)
    # contiguous, as the fake's (per-dim gradients come out permuted)
    grad_w = grad_w.contiguous() if grad_w is not None else grad_keys.new_empty(0)
    carried_grads = [
        w.new_empty(0) if g is None else g.to(w.dtype) for g, w in zip(grads, carried, strict=True)
    ]
    return grad_w, grad_k.contiguous(), grad_v.contiguous(), carried_grads


def _read_backward_fake(
    grad_keys, grad_values, data, weight, layer_idx, sources, mode, kv, shape, weight_grad, *carry
):
    grad_w = grad_keys.new_empty(0) if weight is None or not weight_grad else torch.empty_like(weight)
    carried = [torch.empty_like(w) for w in carry[1]]
    return grad_w, grad_keys.new_empty(shape), grad_keys.new_empty(shape), carried


def _setup_read(ctx, inputs, output) -> None:
    (
        data,
        keys,
        _,
        weight,
        ctx.layer_idx,
        ctx.sources,
        ctx.mode,
        ctx.kv,
        ctx.deferred,
        carried,
        ctx.layers,
        links,
    ) = inputs
    ctx.shape, ctx.n_links = list(keys.shape), len(links)
    ctx.save_for_backward(data, weight, *carried)


def _read_grad(ctx, grad_keys, grad_values, grad_link):
    data, weight, *carried = ctx.saved_tensors
    # outputs that reach no loss (an intervention replaced them) may come without a gradient
    row = data[0].select(1 if ctx.mode == "per-position" else 0, 0).shape
    grad_keys, grad_values = (
        g if g is not None else data.new_zeros(ctx.kv, *row) for g in (grad_keys, grad_values)
    )
    weight_grad = weight is not None and ctx.needs_input_grad[3] and not ctx.deferred
    grad_w, grad_k, grad_v, carried_grads = READ_BACKWARD(
        grad_keys,
        grad_values,
        data,
        weight,
        ctx.layer_idx,
        ctx.sources,
        ctx.mode,
        ctx.kv,
        ctx.shape,
        weight_grad,
        ctx.deferred,
        carried,
        ctx.layers,
    )
    carried_grads = [g if g.numel() else None for g in carried_grads]  # empty: no backward ran
    # the gradients' structure follows the inputs': a list of tensors is a list, a list of ints one leaf
    # unless empty
    layers = None if ctx.layers else []
    links = [data.new_zeros(()) for _ in range(ctx.n_links)]  # the links carry no gradient, only the order
    return None, grad_k, grad_v, grad_w if weight_grad else None, *[None] * 5, carried_grads, layers, links


def _operators() -> tuple[Any, Any]:
    """The operators ``read`` and ``read_backward`` of ``_LIB``, registered at the first import."""
    ops = getattr(torch.ops, _LIB)
    if not hasattr(ops, "read"):
        read = torch.library.custom_op(f"{_LIB}::read", _read, mutates_args=(), tags=_TAGS)
        read.register_fake(_read_fake)
        read.register_autograd(_read_grad, setup_context=_setup_read)
        backward = torch.library.custom_op(
            f"{_LIB}::read_backward", _read_backward, mutates_args=(), tags=_TAGS
        )
        backward.register_fake(_read_backward_fake)
    return ops.read, ops.read_backward


READ, READ_BACKWARD = _operators()
