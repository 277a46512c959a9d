"""Router analysis of LIMe checkpoints: which earlier layers each layer reads from (Figures 5 and 9).

Layer i's router mixes the buffered K/V heads of its source layers S_i (`router.sources`, ascending,
its own last). Its weights give, for every routed head h, a coefficient for head h' of source layer
`sources[p]`. With A[h, p, h'] = |coefficient| (see below for per-token and per-feature coefficients):

- per head (Figure 9): ``per_head[i, h, sources[p]] = sum_h' A[h, p, h'] / sum_{p, h'} A[h, p, h']``;
- per layer (Figure 5): ``per_layer[i, sources[p]] = sum_{h, h'} A[h, p, h'] / sum_{h, p, h'} A[h, p, h']``,
  i.e. |R| averaged over heads per buffered layer, then normalised so each row sums to 1.

Entries for layers that are not sources of layer i (above the diagonal, or skipped by first-j, last-j,
dilated-d) are NaN. A is read from the router itself, in the one shape every router exposes
(`lime_model.router.LimeRouter.coefficients`, C [n, kv, |S|, kv, F]): A = |C| averaged over positions
n and features F. So no variant is special-cased here:

- static routers (full, first-j, last-j, dilated-d, no-head-mix, average) have n = F = 1: A = |C|;
- per-dim has F = head_dim: A is the mean of |w| over each head's feature vector;
- input-dependent routers (dynamic) have one C per token of their attention input x_t, so A is the mean
  over the given tokens of |C(x_t)|; `hidden_states` must be given (else ValueError);
- a layer whose only source is itself (layer 0) reads its own heads unchanged: A = identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RouterAnalysis:
    """per_layer (L, L) and per_head (L, kv, L), rows summing to 1 over each layer's sources, NaN
    elsewhere; sources[i] lists layer i's source layers; routing is the model's routing spec."""

    per_layer: np.ndarray
    per_head: np.ndarray
    sources: list[list[int]]
    routing: str


def unwrap_model(model: Any) -> torch.nn.Module:
    """The torch module behind an nnsight wrapper (`._module`), or the model itself."""
    module = getattr(model, "_module", model)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch model or an nnsight wrapper of one, got {type(model).__name__}")
    return module


def _layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    base = getattr(model, "model", model)  # LimeForCausalLM -> LimeModel
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers (model.layers): not a LIMe model")
    return layers


def _routing_spec(model: torch.nn.Module):
    spec = getattr(model.config, "routing", None)
    if spec is None:
        raise ValueError(
            f"{type(model).__name__} is not a LIMe model: its config has no `routing`; router analysis needs a "
            "LimeForCausalLM checkpoint"
        )
    from lime_model.routing import parse_routing  # LIMe-only analysis: import where it is needed

    parsed = parse_routing(spec)
    if not parsed.enabled:
        raise ValueError("this model has no routers (routing='none', the LLaMA baseline)")
    return parsed


def _abs_coefficients(router: torch.nn.Module, layer: int, x: torch.Tensor | None) -> torch.Tensor:
    """A [kv, |S|, kv] for one layer's router: |coefficients| averaged over positions and features."""
    with torch.inference_mode():
        c = router.coefficients(x).detach().float()
    kv, S = router.num_kv_heads, len(router.sources)
    if c.ndim != 5 or tuple(c.shape[1:4]) != (kv, S, kv):
        raise ValueError(
            f"layer {layer}: router coefficients have shape {tuple(c.shape)}, expected (n, {kv}, {S}, {kv}, F)"
        )
    return c.abs().mean(dim=(0, 4))


def _router_inputs(
    layer: torch.nn.Module,
    i: int,
    hidden_states: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    spec: str,
) -> torch.Tensor:
    """An input-dependent router's input for layer i: input_layernorm of the residual stream entering it,
    (n, hidden)."""
    try:
        h = hidden_states[i]
    except (KeyError, IndexError):
        raise ValueError(f"routing {spec!r}: hidden_states has no entry for layer {i}") from None
    h = torch.as_tensor(h)
    if h.ndim != 2 or h.shape[0] == 0:
        raise ValueError(
            f"routing {spec!r}: hidden_states[{i}] must have shape (n_tokens, hidden), got {tuple(h.shape)}"
        )
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"routing {spec!r}: hidden_states[{i}] contains NaN or Inf")
    norm = layer.input_layernorm
    with torch.inference_mode():
        return norm(h.to(device=norm.weight.device, dtype=norm.weight.dtype))


def router_weights(
    model: Any, hidden_states: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None
) -> RouterAnalysis:
    """Normalised |router weights| of a LIMe model (or its nnsight wrapper) -> `RouterAnalysis`.

    hidden_states: only for input-dependent routing ("dynamic"; ignored otherwise): per layer i, the residual stream
    entering layer i for some tokens, (n_tokens, hidden_size); that is the extraction site "hidden" at
    index i (`acts["hidden"][i]`). The layer's input_layernorm is applied here to get the router's input.
    """
    module = unwrap_model(model)
    spec = _routing_spec(module)
    layers = _layers(module)
    if spec.input_dependent and hidden_states is None:
        raise ValueError(
            f"routing {str(spec)!r} is input-dependent: pass hidden_states (the residual stream entering each layer, "
            "e.g. acts['hidden']) to average its router weights over those tokens"
        )
    L = len(layers)
    kv = module.config.num_key_value_heads
    per_layer = np.full((L, L), np.nan)
    per_head = np.full((L, kv, L), np.nan)
    sources = []
    for i, layer in enumerate(layers):
        router = getattr(layer.self_attn, "router", None)
        if router is None:
            raise ValueError(f"layer {i} has no self_attn.router although routing is {str(spec)!r}")
        src = list(router.sources)
        x = (
            _router_inputs(layer, i, hidden_states, str(spec))
            if router.input_dependent and len(src) > 1
            else None
        )
        A = _abs_coefficients(router, i, x).double()  # [kv, |S|, kv]
        head = A.sum(-1)  # [kv, |S|]
        if not bool((head.sum(-1) > 0).all()):
            raise ValueError(f"layer {i}: a head's router weights are all zero, so they cannot be normalised")
        per_head[i][:, src] = (head / head.sum(-1, keepdim=True)).numpy()
        per_layer[i, src] = (head.sum(0) / head.sum()).numpy()
        sources.append(src)
    return RouterAnalysis(per_layer=per_layer, per_head=per_head, sources=sources, routing=str(spec))
