"""HyperConnections (Zhu et al., "Hyper-Connections", ICLR 2025) as the LIMe paper's baseline: dynamic, n = 4.

The residual stream becomes ``n = expansion_rate`` streams ``H (n, d)`` per token. Before each sub-layer
(attention and MLP separately) a hyper-connection with matrices ``A_m (n, 1)``, ``A_r (n, n)``, ``B (1, n)``
computes::

    h = A_m^T H                      # width connection: the sub-layer input, (1, d)
    H <- B^T T(norm(h)) + A_r^T H    # depth connection writes the output back; A_r mixes the streams

Dynamic variant: ``A = A_static + s_a * tanh(LN(H) W_a)``, ``B = B_static + s_b * tanh(LN(H) W_b)`` per
token, ``LN`` a parameter-free LayerNorm of each stream, ``W_a (d, n+1)`` and ``W_b (d,)`` zero-initialised,
scales ``s_a = s_b = 0.01``. Static init: ``A_m = e_{i mod n}`` (block i), ``A_r = I``, ``B = 1``. The first block
replicates the embeddings into n streams; the final norm reads their sum. So at init every stream holds the
Pre-Norm residual stream and the model is a Pre-Norm transformer (the final RMSNorm sees n times that
stream, which changes its output only through its eps).

As the official LIMe code (``src/lm/hc.py``): both hyper-connections of block i start on stream ``i mod n``,
and the sub-layer norms are parameter-free LayerNorms (not LLaMA's RMSNorm). The HC parameters keep its
names and shapes (``layers.N.hc_attn.static_alpha`` ...); every other parameter keeps LLaMA's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from .config import LimeConfig, no_routing
from .modeling import LimeDecoderLayer, LimeForCausalLM, LimeModel, register_auto


class HyperConnectionsConfig(LimeConfig):
    """A LLaMA config plus HyperConnections' ``expansion_rate`` (n streams) and ``dynamic`` (DHC vs SHC).

    Defaults are the LIMe paper's baseline: dynamic, expansion rate 4. ``routing`` must stay "none".
    """

    model_type = "hyperconnections"

    def __init__(
        self, expansion_rate: int = 4, dynamic: bool = True, routing: str = "none", **kwargs
    ) -> None:
        if int(expansion_rate) < 1:
            raise ValueError(f"expansion_rate must be >= 1, got {expansion_rate}")
        self.expansion_rate = int(expansion_rate)
        self.dynamic = bool(dynamic)
        super().__init__(routing=no_routing(self.model_type, routing), **kwargs)

    def cross_layer_flops(self, seq_len: int) -> int:
        """Forward FLOPs HyperConnections adds to the LLaMA count of ``flops_breakdown``, one sequence.

        Counted with the paper's convention (MACs for matmuls, output size for element-wise ops, a
        LayerNorm without affine 4 per element as fvcore, a sum its input size). Per hyper-connection
        and token: width connection ``(n+1) n d`` MACs, depth connection ``2 n d`` (scale, add); dynamic
        also the stream LayerNorm ``4 n d``, ``W_a`` and ``W_b`` ``(n+2) n d`` MACs and tanh/scale/add
        ``3 n (n+2)``. Plus the final stream sum ``n d``, minus what HC removes from the LLaMA count per
        block: two residual adds (``2 d``) and two RMSNorms (``5 d + 8`` each) replaced by
        parameter-free LayerNorms (``4 d`` each).
        """
        n, d, L = self.expansion_rate, self.hidden_size, self.num_hidden_layers
        per_hc = (n + 1) * n * d + 2 * n * d
        if self.dynamic:
            per_hc += 4 * n * d + (n + 2) * n * d + 3 * n * (n + 2)
        removed = 2 * d + 2 * (5 * d + 8) - 2 * 4 * d
        return seq_len * (2 * L * per_hc + n * d - L * removed)


class HyperConnection(nn.Module):
    """One hyper-connection around a sub-layer: streams ``(B, T, n, d)`` -> streams ``(B, T, n, d)``.

    ``static_alpha (n, n+1)`` is ``[A_m | A_r]`` (row = source stream), ``static_beta (n,)`` is ``B``.
    """

    own_init = True  # LimePreTrainedModel._init_weights calls reset_parameters (Pre-Norm-equivalent)

    # AdamW decay as the official code's configure_optimizers: the static matrices stay undecayed,
    # the dynamic projections and scales are decayed (read by lime_model.optim.param_groups).
    weight_decay_overrides = {
        "static_alpha": False,
        "static_beta": False,
        "dynamic_alpha_fn": True,
        "dynamic_alpha_scale": True,
        "dynamic_beta_fn": True,
        "dynamic_beta_scale": True,
    }

    def __init__(self, config: HyperConnectionsConfig, layer_idx: int) -> None:
        super().__init__()
        n, d = config.expansion_rate, config.hidden_size
        self.rate, self.layer_idx, self.dynamic = n, layer_idx, config.dynamic
        self.static_alpha = nn.Parameter(torch.empty(n, n + 1))
        self.static_beta = nn.Parameter(torch.empty(n))
        if self.dynamic:
            self.dynamic_alpha_fn = nn.Parameter(torch.empty(d, n + 1))
            self.dynamic_alpha_scale = nn.Parameter(torch.empty(1))
            self.dynamic_beta_fn = nn.Parameter(torch.empty(d))
            self.dynamic_beta_scale = nn.Parameter(torch.empty(1))
            self.norm = nn.LayerNorm(d, elementwise_affine=False, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HC's Pre-Norm-equivalent init: ``A_m = e_{layer mod n}``, ``A_r = I``, ``B = 1``, dynamic off."""
        n = self.rate
        self.static_alpha.zero_()
        self.static_alpha[self.layer_idx % n, 0] = 1.0
        self.static_alpha[:, 1:] = torch.eye(n)
        self.static_beta.fill_(1.0)
        if self.dynamic:
            self.dynamic_alpha_fn.zero_()
            self.dynamic_beta_fn.zero_()
            self.dynamic_alpha_scale.fill_(0.01)
            self.dynamic_beta_scale.fill_(0.01)

    def forward(
        self, streams: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``streams (B, T, n, d)``; ``sublayer`` maps its input ``(B, T, d)`` to its output ``(B, T, d)``."""
        alpha: torch.Tensor = self.static_alpha
        beta: torch.Tensor = self.static_beta
        if self.dynamic:
            normed = self.norm(streams)
            alpha = alpha + self.dynamic_alpha_scale * torch.tanh(normed @ self.dynamic_alpha_fn)
            beta = beta + self.dynamic_beta_scale * torch.tanh(normed @ self.dynamic_beta_fn)
        mixed = alpha.transpose(-1, -2) @ streams  # (..., n+1, d): row 0 the sub-layer input
        return mixed[..., 1:, :] + beta.unsqueeze(-1) * sublayer(mixed[..., 0, :]).unsqueeze(-2)


class HyperConnectionsDecoderLayer(LimeDecoderLayer):
    """A LLaMA block whose two residual connections are hyper-connections ``hc_attn`` and ``hc_mlp``."""

    def __init__(self, config: HyperConnectionsConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        d = config.hidden_size
        self.input_layernorm = nn.LayerNorm(d, elementwise_affine=False, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(d, elementwise_affine=False, bias=False)
        self.hc_attn = HyperConnection(config, layer_idx)
        self.hc_mlp = HyperConnection(config, layer_idx)

    def forward(  # type: ignore[override]  # its model's run_layers reads the streams as well
        self, hidden_states: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams ``(B, T, n, d)`` (the first block: embeddings ``(B, T, d)``, replicated n times) ->
        (their sum ``(B, T, d)``, the hidden state probes and ``output_hidden_states`` see; the streams)."""
        streams = hidden_states
        if streams.dim() == 3:
            streams = streams.unsqueeze(-2).expand(-1, -1, self.hc_attn.rate, -1)
        streams = self.hc_attn(streams, lambda x: self.self_attn(self.input_layernorm(x), **kwargs)[0])
        streams = self.hc_mlp(streams, lambda x: self.mlp(self.post_attention_layernorm(x)))
        return streams.sum(-2), streams


class HyperConnectionsModel(LimeModel):
    """Embeddings, L HC blocks over n residual streams, the streams' sum, final RMSNorm.

    The streams are per position, so a cache of the attention K/V is all generation needs.
    """

    config_class = HyperConnectionsConfig
    decoder_layer_class = HyperConnectionsDecoderLayer
    _no_split_modules = ["HyperConnectionsDecoderLayer"]

    def run_layers(self, hidden_states: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        """Embeddings ``(B, T, d)`` -> the sum of the n streams after the last block ``(B, T, d)``."""
        streams = hidden_states
        for layer in self.layers:
            hidden_states, streams = layer(streams, **layer_kwargs)
        return hidden_states

    def mixing_weights(self) -> dict[str, torch.Tensor]:
        """Static parts of the connection matrices, rows = sub-layers in order (attn 0, mlp 0, attn 1, ...).

        ``A_m (2L, n)``: cols = the source streams of each sub-layer's input. ``B (2L, n)``: cols = the
        destination streams of each sub-layer's output. ``A_r^T (2L*n, n)``: row ``s*n + j`` = destination
        stream j of sub-layer s, cols = source streams. The dynamic parts (per token) are not included.
        """
        blocks = [cast(HyperConnectionsDecoderLayer, layer) for layer in self.layers]
        hcs = [hc for layer in blocks for hc in (layer.hc_attn, layer.hc_mlp)]
        alpha = torch.stack([hc.static_alpha.detach() for hc in hcs])  # (2L, n, n+1)
        return {
            "HC width A_m (sub-layer x source stream)": alpha[:, :, 0],
            "HC width A_r^T (sub-layer, stream x source stream)": alpha[:, :, 1:]
            .transpose(1, 2)
            .flatten(0, 1),
            "HC depth B (sub-layer x destination stream)": torch.stack(
                [hc.static_beta.detach() for hc in hcs]
            ),
        }


class HyperConnectionsForCausalLM(LimeForCausalLM):
    """HyperConnections with LLaMA's language-modelling head and loss."""

    config_class = HyperConnectionsConfig
    base_model_class = HyperConnectionsModel
    _no_split_modules = ["HyperConnectionsDecoderLayer"]


register_auto(HyperConnectionsForCausalLM)
