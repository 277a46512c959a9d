"""Router modules: the learned (or fixed) weights that mix buffered K/V heads, one per layer.

Every router reads ``(buffer, hidden_states, keys, values)`` and returns the routed
``(keys, values)``, each ``(B, kv, T, head_dim)``: exactly what the layer's heads attend to, so a
forward hook (or nnsight) on ``self_attn.router`` reads the routed K/V. ``weight`` columns follow
the buffer order: column ``p * kv + h'`` weights head ``h'`` of layer ``sources[p]``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import LimeConfig
from .kv_buffer import KVBuffer, routed_read


def init_router_matrix(weight: torch.Tensor, num_sources: int, kv: int) -> None:
    """Identity on the own (last) block, uniform(+-sqrt(3 / fan_in)) elsewhere; ``weight [kv, S*kv, ...]``."""
    bound = math.sqrt(3.0 / (num_sources * kv))
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        own = weight[:, -kv:]
        own.zero_()
        own[torch.arange(kv), torch.arange(kv)] = 1.0


class LimeRouter(nn.Module):
    """Base router: a static ``weight [kv, S * kv]`` over ``sources`` (full, first-j, last-j, dilated-d).

    A layer whose only source is itself has no parameters and passes its own K/V through.
    """

    mode = "matrix"

    def __init__(self, config: LimeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sources: list[int] = config.routing_spec.sources(layer_idx)
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.weight = nn.Parameter(torch.empty(*self.weight_shape())) if self.learned else None
        self.reset_parameters()

    @property
    def learned(self) -> bool:
        return len(self.sources) > 1

    def weight_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, len(self.sources) * self.num_kv_heads)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            init_router_matrix(self.weight, len(self.sources), self.num_kv_heads)

    def mixing_weight(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The weight in the layout :func:`routed_read` expects for ``self.mode``."""
        return self.weight

    def forward(
        self, buffer: KVBuffer, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: raw ``(B, T, kv * head_dim)``; returns routed ``(B, kv, T, head_dim)`` each."""
        weight = self.mixing_weight(hidden_states)
        return routed_read(buffer, self.layer_idx, keys, values, weight, self.sources, self.mode)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, sources={self.sources}, mode={self.mode}"


class AverageRouter(LimeRouter):
    """Fixed uniform average over the sources, head h of each source feeding head h; nothing learned."""

    def __init__(self, config: LimeConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        eye = torch.eye(self.num_kv_heads) / len(self.sources)
        self.register_buffer("average", eye.repeat(1, len(self.sources)), persistent=False)

    @property
    def learned(self) -> bool:
        return False

    def mixing_weight(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.average.to(hidden_states.dtype) if len(self.sources) > 1 else None


class NoHeadMixRouter(LimeRouter):
    """``weight [kv, S]``: head h mixes only head h of each source layer."""

    def weight_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, len(self.sources))

    def reset_parameters(self) -> None:
        if self.weight is not None:
            bound = math.sqrt(3.0 / len(self.sources))
            with torch.no_grad():
                self.weight.uniform_(-bound, bound)
                self.weight[:, -1] = 1.0

    def mixing_weight(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.weight is None:
            return None
        eye = torch.eye(self.num_kv_heads, dtype=self.weight.dtype, device=self.weight.device)
        # [kv, S, 1] * [kv, 1, kv] -> block-diagonal [kv, S * kv]
        return (self.weight[:, :, None] * eye[:, None, :]).flatten(1)


class PerDimRouter(LimeRouter):
    """``weight [kv, S * kv, head_dim]``: each source head scaled feature-wise before summing."""

    mode = "per-dim"

    def weight_shape(self) -> tuple[int, ...]:
        return (*super().weight_shape(), self.head_dim)


class DynamicRouter(LimeRouter):
    """Input-dependent weights ``weight + proj(x_t)`` per position (paper Appendix E).

    ``x_t`` is the layer's normalised attention input; ``proj`` starts at zero, so at
    initialisation the router equals the static ``full`` one.
    """

    mode = "per-position"

    def __init__(self, config: LimeConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if self.learned:
            self.proj = nn.Linear(config.hidden_size, self.weight.numel(), bias=False)
            self.proj.zero_init = True  # read by LimePreTrainedModel._init_weights
            nn.init.zeros_(self.proj.weight)

    def mixing_weight(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.weight is None:
            return None
        delta = self.proj(hidden_states.reshape(-1, hidden_states.shape[-1]))  # [B*T, kv*S*kv]
        return self.weight + delta.view(-1, *self.weight.shape)


ROUTERS: dict[str, type[LimeRouter]] = {
    "full": LimeRouter,
    "first": LimeRouter,
    "last": LimeRouter,
    "dilated": LimeRouter,
    "average": AverageRouter,
    "no-head-mix": NoHeadMixRouter,
    "per-dim": PerDimRouter,
    "dynamic": DynamicRouter,
}


def build_router(config: LimeConfig, layer_idx: int) -> LimeRouter | None:
    """The router of layer ``layer_idx``, or ``None`` for the LLaMA baseline (``routing="none"``)."""
    spec = config.routing_spec
    return ROUTERS[spec.kind](config, layer_idx) if spec.enabled else None
