"""Router analysis of LIMe checkpoints: which earlier layers each layer reads from (Figures 5 and 9).

Layer i's router mixes the buffered K/V heads of its source layers S_i (`router.sources`, ascending,
its own last). Its weights give, for every routed head h, a coefficient for head h' of source layer
`sources[p]` (column p * kv + h' of `router.weight`). With A[h, p, h'] = |coefficient|:

- per head (Figure 9): ``per_head[i, h, sources[p]] = sum_h' A[h, p, h'] / sum_{p, h'} A[h, p, h']``;
- per layer (Figure 5): ``per_layer[i, sources[p]] = sum_{h, h'} A[h, p, h'] / sum_{h, p, h'} A[h, p, h']``,
  i.e. |R| averaged over heads per buffered layer, then normalised so each row sums to 1.

Entries for layers that are not sources of layer i (above the diagonal, or skipped by first-j, last-j,
dilated-d) are NaN. How each routing variant defines A:

- full, first-j, last-j, dilated-d: ``|weight|`` reshaped [kv, |S|, kv];
- no-head-mix: ``weight [kv, |S|]``, head h reads only head h (zeros elsewhere);
- per-dim: ``weight [kv, |S| * kv, head_dim]``, the mean of |w| over the head_dim vector;
- average: the fixed uniform 1 / |S| on the same head (no learned weights);
- dynamic: the coefficients ``weight + proj(x_t)`` depend on the token's attention input x_t, so A is the
  mean over the given tokens of |weight + proj(x_t)|; `hidden_states` must be given (else ValueError);
- a layer whose only source is itself (layer 0) reads its own heads unchanged: A = identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

STATIC_MATRIX_KINDS = ("full", "first", "last", "dilated")


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


def _routing_kind(model: torch.nn.Module) -> tuple[str, str]:
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
    return parsed.kind, str(parsed)


def _check(weight: torch.Tensor, shape: tuple[int, ...], layer: int, kind: str) -> torch.Tensor:
    if tuple(weight.shape) != shape:
        raise ValueError(
            f"layer {layer}: {kind} router weight has shape {tuple(weight.shape)}, expected {shape}"
        )
    return weight.detach().float().abs()


def _abs_coefficients(
    router: torch.nn.Module, kind: str, kv: int, layer: int, x: torch.Tensor | None
) -> torch.Tensor:
    """A [kv, |S|, kv] for one layer's router (see the module docstring)."""
    S = len(router.sources)
    if S == 1:
        return torch.eye(kv).unsqueeze(1)
    if kind == "average":
        return torch.eye(kv).unsqueeze(1).expand(kv, S, kv) / S
    if kind in STATIC_MATRIX_KINDS:
        return _check(router.weight, (kv, S * kv), layer, kind).view(kv, S, kv)
    if kind == "no-head-mix":
        w = _check(router.weight, (kv, S), layer, kind)
        return w.unsqueeze(-1) * torch.eye(kv).unsqueeze(1)
    if kind == "per-dim":
        w = _check(router.weight, (kv, S * kv, router.weight.shape[-1]), layer, kind)
        return w.mean(-1).view(kv, S, kv)
    if kind == "dynamic":
        weight = router.weight.detach().float()
        _check(weight, (kv, S * kv), layer, kind)
        with torch.inference_mode():
            delta = router.proj(x.to(router.proj.weight.dtype)).float().view(-1, kv, S * kv)
        return (weight + delta).abs().mean(0).view(kv, S, kv)
    raise ValueError(f"layer {layer}: router analysis does not know routing kind {kind!r}")


def _router_inputs(
    layer: torch.nn.Module, i: int, hidden_states: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None
) -> torch.Tensor:
    """The dynamic router's input for layer i: input_layernorm of the residual stream entering it, (n, hidden)."""
    try:
        h = hidden_states[i]
    except (KeyError, IndexError):
        raise ValueError(f"routing 'dynamic': hidden_states has no entry for layer {i}") from None
    h = torch.as_tensor(h)
    if h.ndim != 2 or h.shape[0] == 0:
        raise ValueError(
            f"routing 'dynamic': hidden_states[{i}] must have shape (n_tokens, hidden), got {tuple(h.shape)}"
        )
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"routing 'dynamic': hidden_states[{i}] contains NaN or Inf")
    norm = layer.input_layernorm
    with torch.inference_mode():
        return norm(h.to(device=norm.weight.device, dtype=norm.weight.dtype))


def router_weights(
    model: Any, hidden_states: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None
) -> RouterAnalysis:
    """Normalised |router weights| of a LIMe model (or its nnsight wrapper) -> `RouterAnalysis`.

    hidden_states: only for routing "dynamic" (ignored otherwise): per layer i, the residual stream
    entering layer i for some tokens, (n_tokens, hidden_size); that is the extraction site "hidden" at
    index i (`acts["hidden"][i]`). The layer's input_layernorm is applied here to get the router's input.
    """
    module = unwrap_model(model)
    kind, spec = _routing_kind(module)
    layers = _layers(module)
    if kind == "dynamic" and hidden_states is None:
        raise ValueError(
            "routing 'dynamic' is input-dependent: pass hidden_states (the residual stream entering each layer, "
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
            raise ValueError(f"layer {i} has no self_attn.router although routing is {spec!r}")
        src = list(router.sources)
        x = _router_inputs(layer, i, hidden_states) if kind == "dynamic" and len(src) > 1 else None
        A = _abs_coefficients(router, kind, kv, i, x).double()  # [kv, |S|, kv]
        head = A.sum(-1)  # [kv, |S|]
        if not bool((head.sum(-1) > 0).all()):
            raise ValueError(f"layer {i}: a head's router weights are all zero, so they cannot be normalised")
        per_head[i][:, src] = (head / head.sum(-1, keepdim=True)).numpy()
        per_layer[i, src] = (head.sum(0) / head.sum()).numpy()
        sources.append(src)
    return RouterAnalysis(per_layer=per_layer, per_head=per_head, sources=sources, routing=spec)
