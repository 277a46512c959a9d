"""ResFormer (Zhou et al., "Value Residual Learning", 2024): every layer's values mixed with the first's.

With V_1 the first layer's values (``v_proj`` output) and V_n layer n's, layers n >= 2 attend with::

    V'_n = lambda_{n,1} V_1 + lambda_{n,2} V_n

over their own keys and attention pattern; layer 1 is a plain LLaMA layer. Both lambdas start at 0.5
(``1/2 (V_1 + V_n)``, the ResFormer paper's basic form). ``value_mix="learnable"`` (default) trains them
(the paper's Learnable-ResFormer), ``"fixed"`` keeps 0.5/0.5 (its Identity-ResFormer). The mix is per
position, so the cache stores V'_n. Layer n's lambdas are ``model.layers.{n-1}.self_attn.value_mix.weight``
(2,); every other parameter keeps LLaMA's name.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .config import LimeConfig, no_routing
from .modeling import LimeAttention, LimeDecoderLayer, LimeForCausalLM, LimeModel, register_auto

VALUE_MIX = ("learnable", "fixed")


class ResFormerConfig(LimeConfig):
    """A LLaMA config plus ``value_mix`` (``"learnable"`` or ``"fixed"`` lambdas, both starting at 0.5)."""

    model_type = "resformer"

    def __init__(self, routing: str = "none", value_mix: str = "learnable", **kwargs) -> None:
        if value_mix not in VALUE_MIX:
            raise ValueError(f"value_mix must be one of {', '.join(VALUE_MIX)}, got {value_mix!r}")
        self.value_mix = value_mix
        super().__init__(routing=no_routing(self.model_type, routing), **kwargs)

    def cross_layer_flops(self, seq_len: int) -> int:
        """Layers 2..L: two multiplies and one add per value element, (T, kv * head_dim)."""
        values = seq_len * self.num_key_value_heads * self.head_dim
        return 3 * values * (self.num_hidden_layers - 1)


class ValueMix(nn.Module):
    """The values a layer attends with: layer 1 keeps (and stores) its own, V_1; layer n >= 2 mixes them
    with ``weight`` (2,) = (lambda on V_1, lambda on its own V_n), both 0.5 at init."""

    own_init = True

    def __init__(self, layer_idx: int, learnable: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2), requires_grad=learnable) if layer_idx > 0 else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(0.5)

    def forward(self, values: torch.Tensor, first_values: dict) -> torch.Tensor:
        """``values`` V_n ``(B, T, kv * head_dim)`` -> V'_n, same shape; ``first_values`` holds this
        forward's V_1 (written by layer 1)."""
        if self.weight is None:
            first_values["v1"] = values
            return values
        return self.weight[0] * first_values["v1"] + self.weight[1] * values


class ResFormerAttention(LimeAttention):
    """LLaMA attention reading ``lambda_1 V_1 + lambda_2 V_n`` as its values (layers after the first)."""

    def __init__(self, config: ResFormerConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.value_mix = ValueMix(layer_idx, config.value_mix == "learnable")

    def mix_kv(
        self, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_buffer: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw ``keys``/``values`` ``(B, T, kv * head_dim)`` -> heads ``(B, kv, T, head_dim)``, the values
        mixed with V_1 (``kv_buffer``: this forward's first-layer values)."""
        return super().mix_kv(hidden_states, keys, self.value_mix(values, kv_buffer), kv_buffer)


class ResFormerDecoderLayer(LimeDecoderLayer):
    attention_class = ResFormerAttention


class ResFormerModel(LimeModel):
    """The decoder stack; one forward's blocks share the first layer's values."""

    config_class = ResFormerConfig
    decoder_layer_class = ResFormerDecoderLayer
    _no_split_modules = ["ResFormerDecoderLayer"]

    def run_layers(self, hidden_states: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        """Embeddings ``(B, T, hidden)`` -> the last block's output ``(B, T, hidden)``."""
        first_values: dict = {}  # V_1 of this forward's positions (the mix is per position)
        for layer in self.layers:
            hidden_states = layer(hidden_states, kv_buffer=first_values, **layer_kwargs)
        return hidden_states

    def mixing_weights(self) -> dict[str, torch.Tensor]:
        """``{"value residual lambdas": lam}``, lam ``(L, 2)``: row n-1 is layer n's (lambda on V_1,
        lambda on its own V_n); row 0 is NaN (the first layer provides V_1 and mixes nothing)."""
        lam = torch.full((self.config.num_hidden_layers, 2), float("nan"))
        for i, layer in enumerate(self.layers):
            value_mix = cast(ResFormerAttention, layer.self_attn).value_mix
            if value_mix.weight is not None:
                lam[i] = value_mix.weight.detach().float().cpu()
        return {"value residual lambdas": lam}


class ResFormerForCausalLM(LimeForCausalLM):
    """ResFormer with LLaMA's language-modelling head."""

    config_class = ResFormerConfig
    base_model_class = ResFormerModel
    _no_split_modules = ["ResFormerDecoderLayer"]


register_auto(ResFormerForCausalLM)
