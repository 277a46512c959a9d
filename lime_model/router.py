"""Router modules: the learned (or fixed) weights that mix buffered K/V heads, one per layer.

Every router reads ``(buffer, hidden_states, keys, values)`` and returns the routed
``(keys, values)``, each ``(B, kv, T, head_dim)``: exactly what the layer's heads attend to, so a
forward hook (or nnsight) on ``self_attn.router`` reads the routed K/V.

All routers describe their mixing in one shape, ``LimeRouter.coefficients``:
``C (n, kv, S, kv, F)``, where ``C[m, h, p, h', e]`` weights feature ``e`` of head ``h'`` of layer
``sources[p]`` in routed head ``h`` at position ``m``. ``n`` is 1 (the same weights at every position)
unless the router is ``input_dependent``, and ``F`` is 1 (one weight per head) except for ``per-dim``
(``head_dim``). The forward pass, the FLOP count and the router analysis all read this one description.

Each class declares the routing spec kinds it implements in ``routes`` (``"<kind>"`` or ``"<kind>-<n>"``
-> the source layers of layer ``i``), from which ``lime_model.routing.ROUTINGS`` is built: a new
routing variant is one class here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .kv_buffer import KVBuffer
from .kv_read import routed_read

if TYPE_CHECKING:  # routers read a LimeConfig, whose module imports the routing table, which imports this one
    from transformers import PreTrainedConfig

# (layer i, the spec's n or None) -> the ascending layers whose K/V layer i mixes, i last
Sources = Callable[[int, Any], list[int]]  # (layer, the spec's n: int, or None for "full")


def all_layers(i: int, n: None) -> list[int]:
    return list(range(i + 1))


def first_layers(i: int, j: int) -> list[int]:
    return list(range(min(j, i))) + [i]


def last_layers(i: int, j: int) -> list[int]:
    return list(range(max(0, i - j + 1), i + 1))


def dilated_layers(i: int, d: int) -> list[int]:
    return list(range(0, i, d)) + [i]


def dilated_back_layers(i: int, d: int) -> list[int]:
    return list(range(i, -1, -d))[::-1]


def init_router_matrix(weight: torch.Tensor, num_sources: int, kv: int) -> None:
    """Identity on the own (last) block, uniform(+-sqrt(3 / fan_in)) elsewhere; ``weight (kv, S*kv, ...)``."""
    bound = math.sqrt(3.0 / (num_sources * kv))
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        own = weight[:, -kv:]
        own.zero_()
        own[torch.arange(kv), torch.arange(kv)] = 1.0


def own_heads_only(kv: int, num_sources: int) -> torch.Tensor:
    """Coefficients ``(1, kv, S, kv, 1)`` that read each head of the own (last) source unchanged."""
    c = torch.zeros(1, kv, num_sources, kv, 1)
    c[0, torch.arange(kv), -1, torch.arange(kv), 0] = 1.0
    return c


def buffer_layout(coefficients: torch.Tensor, per_position: bool) -> tuple[torch.Tensor, str]:
    """``C (n, kv, S, kv, F)`` as the weight and mode ``lime_model.kv_read.routed_read`` takes:
    ``(n, kv, S*kv)`` "per-position", ``(kv, S*kv, F)`` "per-dim" (F > 1) or ``(kv, S*kv)`` "matrix"."""
    n, kv, S, _, F = coefficients.shape
    if per_position:
        return coefficients.reshape(n, kv, S * kv), "per-position"
    if F > 1:
        return coefficients.reshape(kv, S * kv, F), "per-dim"
    return coefficients.reshape(kv, S * kv), "matrix"


class LimeRouter(nn.Module):
    """Static router: ``weight (kv, S * kv)`` over ``sources`` (full, first-j, last-j, dilated-d).

    Column ``p * kv + h'`` of ``weight`` weights head ``h'`` of layer ``sources[p]``. Initialised to
    the identity on the own heads and uniform(+-sqrt(3 / (S * kv))) elsewhere (official code). A layer
    whose only source is itself has no parameters and passes its own K/V through.
    """

    # the routing spec kinds this class implements, "<kind>" or "<kind>-<n>" -> source layers
    # (lime_model.routing builds its table from every router class's own routes)
    routes: dict[str, Sources] = {
        "full": all_layers,
        "first-<n>": first_layers,
        "last-<n>": last_layers,
        "dilated-<n>": dilated_layers,
        "dilated-back-<n>": dilated_back_layers,
    }
    input_dependent = False  # True: coefficients differ per position and need the hidden states
    # The K/V buffer layout is fixed by layer 0's write, so every layer of a variant, the single-source
    # ones included, names the same read mode (per-dim routers store the buffer feature-major).
    own_only_mode = "matrix"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A class defined after lime_model.routing built its table (a user's variant) joins it here; the
        # classes defined before are found there by walking the subclasses.
        routing = sys.modules.get("lime_model.routing")
        if routing is not None and hasattr(routing, "ROUTINGS"):
            routing.add_routes(routing.ROUTINGS, cls)

    def __init__(self, config: PreTrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sources: list[int] = config.routing_spec.sources(layer_idx)
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.weight: nn.Parameter | None = None
        if self.learned:
            self.make_parameters(config)
        self.reset_parameters()

    @property
    def learned(self) -> bool:
        return len(self.sources) > 1

    def make_parameters(self, config: PreTrainedConfig) -> None:
        """Create the learned parameters (only called when there is more than one source)."""
        self.weight = nn.Parameter(torch.empty(*self.weight_shape()))

    def weight_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, len(self.sources) * self.num_kv_heads)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init_router_matrix(self.weight, len(self.sources), self.num_kv_heads)

    def reset_self_only(self) -> None:
        """Reinitialise at self-only routing: each head reads its own layer's head unchanged (the
        coefficients are ``own_heads_only``), so the layer computes LLaMA's attention exactly; a
        pretrained LLaMA upcycled to LIMe starts here (``lime_model.upcycle``). Learned parameters
        that do not set the coefficients at this point keep their ``reset_parameters`` init."""
        self.reset_parameters()
        if self.weight is not None:
            with torch.no_grad():
                self.weight[:, : -self.num_kv_heads].zero_()  # the other sources' columns

    def coefficients(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Mixing coefficients ``C (n, kv, S, kv, F)`` (see the module docstring).

        Args:
            hidden_states: the layer's normalised attention input ``(..., hidden)``; read only by
                ``input_dependent`` routers, whose ``n`` is the number of positions in it.
        """
        kv, S = self.num_kv_heads, len(self.sources)
        if self.weight is None:
            return own_heads_only(kv, S)
        return self.weight.view(1, kv, S, kv, 1)

    def forward(
        self, buffer: KVBuffer, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: raw ``(B, T, kv * head_dim)``; returns routed ``(B, kv, T, head_dim)`` each."""
        weight, mode = self.read_weight(hidden_states)
        return routed_read(buffer, self.layer_idx, keys, values, weight, self.sources, mode)

    def read_weight(self, hidden_states: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
        """The weight and mode of this layer's routed read (``buffer_layout``); a single source
        (the own heads) is ``None``: no arithmetic."""
        if len(self.sources) == 1:
            return None, self.own_only_mode
        return buffer_layout(self.coefficients(hidden_states), self.input_dependent)

    def deferred_weight(self) -> torch.Tensor | None:
        """This layer's weight as ``KVBuffer.defer_weight_grads`` takes it before layer 0 runs: a learned
        static ``"matrix"`` weight, unsharded (FSDP2 gathers a layer's parameters for its own forward
        only); else ``None``."""
        if self.input_dependent or any(_sharded(p) for p in self.parameters()):
            return None
        weight, mode = self.read_weight(None)
        return weight if weight is not None and mode == "matrix" and weight.requires_grad else None

    def reread(self, buffer: KVBuffer, hidden_states: torch.Tensor, which: int) -> torch.Tensor:
        """The routed keys (``which=0``) or values (1) of ``forward``, ``(B, kv, T, head_dim)``,
        recomputed from ``buffer`` without autograd, for backward (static routers: their weights do
        not change between forward and backward). Of ``hidden_states`` only the shape ``(B, T, ...)``,
        dtype and device are read: a stand-in without data serves."""
        B, T = hidden_states.shape[:2]
        weight, mode = self.read_weight(hidden_states)
        with torch.no_grad():
            heads = buffer.read(buffer.data[which], self.layer_idx, weight, self.sources, mode)
        return buffer.attention_heads(heads, B, T)

    @classmethod
    def flops(cls, config: PreTrainedConfig, num_sources: int, seq_len: int) -> dict[str, int]:
        """Forward cost of one layer's routing over ``seq_len`` tokens, in the paper's convention
        (see ``lime_model.flops``): ``router`` multiply-accumulates, ``elementwise`` ops."""
        if num_sources == 1:
            return {}  # own K/V only: a slice
        kv = config.num_key_value_heads
        # keys and values each mix S * kv buffered heads into kv heads, per position and feature
        return {"router": 2 * seq_len * kv * num_sources * kv * config.head_dim}

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, sources={self.sources}"


class AverageRouter(LimeRouter):
    """Fixed uniform average over the sources, head h of each source feeding head h; nothing learned."""

    routes = {"average": all_layers}

    @property
    def learned(self) -> bool:
        return False

    def reset_self_only(self) -> None:
        if len(self.sources) > 1:
            raise ValueError(
                "routing 'average' has fixed weights 1/(i+1) on every source: it cannot start at self-only routing"
            )

    def coefficients(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        kv, S = self.num_kv_heads, len(self.sources)
        like: dict[str, Any] = (
            {} if hidden_states is None else {"dtype": hidden_states.dtype, "device": hidden_states.device}
        )
        eye = torch.eye(kv, **like)
        return (eye[:, None, :, None] / S).expand(kv, S, kv, 1).unsqueeze(0)


class NoHeadMixRouter(LimeRouter):
    """``weight (kv, S)``: head h mixes only head h of each source layer (own layer initialised to 1)."""

    routes = {"no-head-mix": all_layers}

    def weight_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, len(self.sources))

    def reset_parameters(self) -> None:
        if self.weight is not None:
            bound = math.sqrt(3.0 / len(self.sources))
            with torch.no_grad():
                self.weight.uniform_(-bound, bound)
                self.weight[:, -1] = 1.0

    def reset_self_only(self) -> None:
        self.reset_parameters()
        if self.weight is not None:
            with torch.no_grad():
                self.weight[:, :-1].zero_()  # weight (kv, S): one column per source

    def coefficients(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is None:
            return super().coefficients(hidden_states)
        eye = torch.eye(self.num_kv_heads, dtype=self.weight.dtype, device=self.weight.device)
        return (self.weight[:, :, None] * eye[:, None, :]).unsqueeze(0).unsqueeze(-1)  # [1, kv, S, kv, 1]


class PerDimRouter(LimeRouter):
    """``weight (kv, S * kv, head_dim)``: each source head scaled feature-wise before summing."""

    routes = {"per-dim": all_layers}
    own_only_mode = "per-dim"

    def weight_shape(self) -> tuple[int, ...]:
        return (*super().weight_shape(), self.head_dim)

    def coefficients(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is None:
            return super().coefficients(hidden_states)
        return self.weight.view(1, self.num_kv_heads, len(self.sources), self.num_kv_heads, self.head_dim)


class DynamicRouter(LimeRouter):
    """Per-token routing weights from queries on the hidden state against learnable keys (paper App. E).

    For the layer's normalised attention input ``x_t`` and every routed (kv) head ``h``, a query
    ``q_{t,h} = query[h] @ x_t`` (``head_dim`` wide) is dotted with a learnable key ``keys[p*kv + h']``
    for every source layer ``sources[p]`` and head ``h'``; a learnable offset ``weight (kv, S * kv)``
    is added::

        C[t, h, p, h'] = weight[h, p*kv + h'] + q_{t,h} . keys[p*kv + h']      (no normalisation)

    The weights are not normalised (no softmax): the initial router must read exactly the own heads,
    as LLaMA does, which a softmax cannot represent, and the official static router (``lime.py``) is
    unnormalised too. (The official repository's earlier dynamic router, commit 601cd30, mixed hidden
    states with a softmax over source layers from a randomly initialised projection; the paper's
    Appendix E form is what is implemented here.) Init: ``weight`` identity on the own heads and zero
    elsewhere, ``keys`` zero, ``query`` uniform(+-sqrt(3 / hidden)), so the initial model equals LLaMA
    and ``keys`` receive gradients from the first step (``query`` from the second). The query width
    (``head_dim``) and the offset are our choices where the paper gives none.
    """

    routes = {"dynamic": all_layers}
    input_dependent = True
    own_only_mode = "per-position"

    def make_parameters(self, config: PreTrainedConfig) -> None:
        super().make_parameters(config)
        S, kv = len(self.sources), self.num_kv_heads
        self.query = nn.Parameter(torch.empty(kv * self.head_dim, config.hidden_size))
        self.keys = nn.Parameter(torch.empty(S * kv, self.head_dim))

    def reset_parameters(self) -> None:
        if self.weight is None:
            return
        with torch.no_grad():
            self.weight.copy_(own_heads_only(self.num_kv_heads, len(self.sources)).view_as(self.weight))
            bound = math.sqrt(3.0 / self.query.shape[1])
            self.query.uniform_(-bound, bound)
            self.keys.zero_()

    def coefficients(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.weight is None:
            return super().coefficients(hidden_states)
        if hidden_states is None:
            raise ValueError("routing 'dynamic' depends on the token: pass hidden_states (..., hidden)")
        kv, S = self.num_kv_heads, len(self.sources)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        q = (x @ self.query.t()).view(-1, kv, self.head_dim)  # [n, kv, head_dim]
        scores = q @ self.keys.t()  # [n, kv, S * kv]
        # in place: the product is ours (mm's backward keeps its inputs), and a fresh (n, kv, S*kv)
        # tensor per layer costs page faults as well as a pass
        return scores.add_(self.weight).view(-1, kv, S, kv, 1)

    @classmethod
    def flops(cls, config: PreTrainedConfig, num_sources: int, seq_len: int) -> dict[str, int]:
        cost = super().flops(config, num_sources, seq_len)
        if num_sources > 1:
            kv, D, S = config.num_key_value_heads, config.head_dim, num_sources
            cost["router"] += seq_len * kv * D * (config.hidden_size + S * kv)  # queries, then scores
            cost["elementwise"] = seq_len * kv * S * kv  # adding the offset
        return cost


def _sharded(parameter: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor)


def build_router(config: PreTrainedConfig, layer_idx: int) -> LimeRouter | None:
    """The router of layer ``layer_idx``, or ``None`` for the LLaMA baseline (``routing="none"``)."""
    router = config.routing_spec.router
    return None if router is None else router(config, layer_idx)
