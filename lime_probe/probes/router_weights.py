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

A trained map alone misleads: at initialisation every router is identity on its own heads and uniform
elsewhere, so a layer already reads much of its |R| from earlier layers before any training.
`initial_weights` gives the same numbers at step 0: exactly, for a lime-model run folder (its
recipe.json seed rebuilds the initial weights, as `lime_model.train` built them), else as the expected
map of the init (mean |R| over draws of each router's own initialisation).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from lime_probe.extraction.loading import onloaded
from lime_probe.extraction.sites import routes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lime_model.modeling import LimeDecoderLayer
    from lime_model.router import LimeRouter


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


def _hf_model(model: Any) -> PreTrainedModel:
    """`unwrap_model` of a model the router analysis reads: a Hugging Face (LIMe) model, checked by
    `_routing_spec`."""
    return cast("PreTrainedModel", unwrap_model(model))


def _layers(model: torch.nn.Module) -> Sequence[LimeDecoderLayer]:
    base = getattr(model, "model", model)  # LimeForCausalLM -> LimeModel
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers (model.layers): not a LIMe model")
    return layers


def _routing_spec(model: torch.nn.Module):
    """The model's parsed routing (``config.routing_spec``, a `lime_model.routing.RoutingSpec`)."""
    spec = getattr(model.config, "routing_spec", None)
    if spec is None:
        raise ValueError(
            f"{type(model).__name__} is not a LIMe model: its config has no `routing`; router analysis needs a "
            "LimeForCausalLM checkpoint"
        )
    if not routes(model):
        raise ValueError("this model has no routers (routing='none', the LLaMA baseline)")
    return spec


def _abs_coefficients(router: LimeRouter, layer: int, x: torch.Tensor | None) -> torch.Tensor:
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
    layer: LimeDecoderLayer,
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
    return _weights(_hf_model(model), hidden_states, _abs_coefficients)


def _weights(
    module: PreTrainedModel,
    hidden_states: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None,
    abs_coefficients: Callable[[LimeRouter, int, torch.Tensor | None], torch.Tensor],
) -> RouterAnalysis:
    """`router_weights` with A [kv, |S|, kv] of each layer's router from ``abs_coefficients(router,
    layer, x)``."""
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
        with onloaded(layer):  # a layer offloaded by a device map: its router and norm from the offload store
            x = (
                _router_inputs(layer, i, hidden_states, str(spec))
                if router.input_dependent and len(src) > 1 and hidden_states is not None  # checked above
                else None
            )
            A = abs_coefficients(router, i, x).double().cpu()  # [kv, |S|, kv]
        head = A.sum(-1)  # [kv, |S|]
        if not bool((head.sum(-1) > 0).all()):
            raise ValueError(f"layer {i}: a head's router weights are all zero, so they cannot be normalised")
        per_head[i][:, src] = (head / head.sum(-1, keepdim=True)).numpy()
        per_layer[i, src] = (head.sum(0) / head.sum()).numpy()
        sources.append(src)
    return RouterAnalysis(per_layer=per_layer, per_head=per_head, sources=sources, routing=str(spec))


def run_seed(source: str | os.PathLike) -> int | None:
    """The training seed of a lime-model run folder (its recipe.json), or None (not such a folder)."""
    recipe = Path(source) / "recipe.json"
    if not recipe.is_file():
        return None
    seed = json.loads(recipe.read_text()).get("seed")
    return seed if isinstance(seed, int) else None


def run_init(source: str | os.PathLike) -> str | None:
    """The folder a lime-model run started from (its recipe's ``init``), or None (a random init). A
    recorded folder that is gone is a one-line ValueError: the run's step 0 cannot be rebuilt without it."""
    recipe = Path(source) / "recipe.json"
    init = json.loads(recipe.read_text()).get("init") if recipe.is_file() else None
    if init is None:
        return None
    if not (Path(init) / "config.json").is_file():
        raise ValueError(
            f"{source} started from --init {init}, which is not here: its step 0 cannot be rebuilt"
        )
    return str(init)


def step0_model(model: Any, seed: int) -> torch.nn.Module:
    """The model at step 0 of a lime-model run trained with ``seed``: `lime_model.train` seeds torch
    (``torch.manual_seed(recipe.seed)``) right before it builds the model from its config, so the same
    seed and the checkpoint's config rebuild the initial weights exactly. The global RNG is left as
    it was."""
    module = _hf_model(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = type(module)._from_config(copy.deepcopy(module.config))  # AutoModel.from_config's path
    return fresh.eval()


INIT_DRAWS = 64  # draws of each router's init averaged into the expected step-0 map (ours)


def _expected_abs_coefficients(router: LimeRouter, layer: int, x: torch.Tensor | None) -> torch.Tensor:
    """A [kv, |S|, kv] of ``router``'s init: |coefficients| averaged over `INIT_DRAWS` draws of its
    ``reset_parameters`` (seeds 0..INIT_DRAWS-1), on a copy (the model is untouched)."""
    fresh = copy.deepcopy(router)
    total = torch.zeros(())
    with torch.random.fork_rng(devices=[]):
        for k in range(INIT_DRAWS):
            torch.manual_seed(k)
            fresh.reset_parameters()
            total = total + _abs_coefficients(fresh, layer, x)
    return total / INIT_DRAWS


def initial_weights(
    model: Any,
    source: str | os.PathLike | None = None,
    hidden_states: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None,
) -> tuple[RouterAnalysis, str]:
    """`router_weights` at initialisation, and what they are in words.

    ``source`` a lime-model run folder (recipe.json with its seed): the run's own step 0, rebuilt
    (`step0_model`). Otherwise the expected step-0 map of the model's init: A averaged over
    `INIT_DRAWS` draws of each router's initialisation (the ratio of those means, not the mean of the
    ratios). ``hidden_states`` as for `router_weights` (dynamic routing)."""
    seed = run_seed(source) if source is not None else None
    if seed is not None:
        step0 = step0_model(model, seed)
        init = run_init(source) if source is not None else None
        if init is None:
            return router_weights(step0, hidden_states), f"step 0, rebuilt from the run's seed {seed}"
        from lime_model.upcycle import load_init

        load_init(init, step0)  # the weights it started from: a LLaMA's give self-only routers
        return router_weights(step0, hidden_states), f"step 0, the weights of its --init {Path(init).name}"
    return (
        _weights(_hf_model(model), hidden_states, _expected_abs_coefficients),
        f"expected step 0 of the init (mean |R| over {INIT_DRAWS} draws)",
    )


def mixing_layers(router_model: Any) -> int:
    """The number of layers whose values ``router_model``'s routers mix (`mix_by_router`). ValueError, one
    line, for a model that is not a LIMe, has no routers (LLaMA) or routes by its own inputs (dynamic)."""
    module = _hf_model(router_model)
    spec = _routing_spec(module)
    if spec.input_dependent:
        raise ValueError(
            f"routing {str(spec)!r} is input-dependent: its mixing of another model's values is undefined"
        )
    return len(_layers(module))


def mix_by_router(router_model: Any, values: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Values of every layer mixed across layers by ``router_model``'s routers, as its heads would read
    them: ``out[i][n, h, e] = sum_{p, h'} C_i[h, p, h', e] values[sources_i[p]][n, h', e]`` (e over each
    head's features; C_i of layer i's router, `LimeRouter.coefficients`).

    ``values``: per layer, (n_tokens, kv * head_dim), e.g. another model's W_V output (site "values") on
    the same tokens. Given a LIMe model's own raw values it returns that model's routed values; given
    LLaMA's, what LIMe's learned mixing makes of them: the mixing null (routing mixes layers, so entropy
    may rise whatever the values learned). Input-dependent routers (dynamic) are refused: their weights
    depend on the model's own hidden states. Returns ``{layer: (n_tokens, kv * head_dim)}``.
    """
    module = _hf_model(router_model)
    layers = mixing_layers(module)
    extra = sorted(set(values) - set(range(layers)))
    if extra:
        raise ValueError(f"values of layers {extra} given; the routers mix a model of {layers} layers")
    kv, hd = module.config.num_key_value_heads, module.config.head_dim
    out = {}
    for i, layer in enumerate(_layers(module)):
        router = layer.self_attn.router
        if router is None:
            raise ValueError(
                f"layer {i} has no self_attn.router although routing is {module.config.routing!r}"
            )
        missing = [j for j in router.sources if j not in values]
        if missing:
            raise ValueError(
                f"layer {i} mixes layers {router.sources}; values of layers {missing} are missing"
            )
        V = torch.stack([torch.as_tensor(values[j]).float() for j in router.sources])  # (S, n, kv * hd)
        if V.shape[-1] != kv * hd:
            raise ValueError(
                f"values have {V.shape[-1]} features per token; the router mixes {kv} heads of {hd} ({kv * hd})"
            )
        with torch.inference_mode(), onloaded(router):
            C = router.coefficients(None).detach().float().to(V.device)[0]  # (kv, S, kv, F), F in {1, hd}
        V = V.view(len(router.sources), -1, kv, hd)  # (S, n, kv, hd)
        out[i] = torch.einsum("hpqe,pnqe->nhe", C.expand(kv, len(router.sources), kv, hd), V).reshape(
            -1, kv * hd
        )
    return out
