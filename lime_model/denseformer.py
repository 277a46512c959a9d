"""DenseFormer (Pagliardini et al., 2024): a Depth-Weighted Average (DWA) after every block.

With X_0 the embeddings and blocks B_1..B_L (LLaMA blocks, residuals included)::

    X_i = B_i(Y_{i-1}),   Y_i = sum_{j in S_i} alpha_{i,j} X_j,   Y_0 = X_0,   output = norm(Y_L)

S_i = {j <= i : (i - j) % dwa_dilation == 0}, and a DWA follows block i only when i % dwa_period == 0
(elsewhere Y_i = X_i). The LIMe paper's setting, dilation 1 and period 1, is the default: every block
averages the embeddings and all previous block outputs. alpha_{i,i} = 1 and all other alpha = 0 at
init, so a fresh DenseFormer is exactly LLaMA. Block i's DWA weights are
``model.layers.{i-1}.dwa.weight`` (|S_i|,); every other parameter keeps LLaMA's name.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .config import LimeConfig, no_routing
from .modeling import LimeDecoderLayer, LimeForCausalLM, LimeModel, register_auto


class DenseFormerConfig(LimeConfig):
    """A LLaMA config plus the DWA pattern (``dwa_dilation``, ``dwa_period``: both 1 in the LIMe paper)."""

    model_type = "denseformer"

    def __init__(self, routing: str = "none", dwa_dilation: int = 1, dwa_period: int = 1, **kwargs) -> None:
        if not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (dwa_dilation, dwa_period)
        ):
            raise ValueError(
                f"dwa_dilation and dwa_period must be integers >= 1, got {dwa_dilation!r}, {dwa_period!r}"
            )
        self.dwa_dilation, self.dwa_period = dwa_dilation, dwa_period
        super().__init__(routing=no_routing(self.model_type, routing), **kwargs)

    def dwa_sources(self, block: int) -> list[int]:
        """S_i for block i in 1..L: the indices j of the X_j its DWA averages (ascending, i last); [] when
        no DWA follows block i."""
        if block % self.dwa_period:
            return []
        return [j for j in range(block + 1) if (block - j) % self.dwa_dilation == 0]

    def cross_layer_flops(self, seq_len: int) -> int:
        """Each DWA over k tensors of (T, hidden) is a weighted sum, counted as a matmul
        ``(1, k) @ (k, T * hidden)``: k multiply-accumulates per output element, the paper's matmul
        convention. It is the count that reproduces Table 16's DenseFormer rows (+0.02 %, 0.0006-0.0007 T
        at 1B); k multiplies plus k - 1 adds would give +0.04 %."""
        k = [len(self.dwa_sources(i)) for i in range(1, self.num_hidden_layers + 1)]
        return sum(n * seq_len * self.hidden_size for n in k)


class DepthWeightedAverage(nn.Module):
    """``Y = sum_j weight[j] * X_{sources[j]}``; ``weight`` (|S|,) starts at (0, ..., 0, 1)."""

    own_init = True

    def __init__(self, sources: list[int]) -> None:
        super().__init__()
        self.sources = sources
        self.weight = nn.Parameter(torch.empty(len(sources)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[-1] = 1.0

    def forward(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """``outputs`` X_0..X_i, each ``(B, T, hidden)`` -> Y_i ``(B, T, hidden)``."""
        y = self.weight[0] * outputs[self.sources[0]]
        for w, j in zip(self.weight[1:], self.sources[1:], strict=True):
            y = y + w * outputs[j]
        return y


class DenseFormerDecoderLayer(LimeDecoderLayer):
    """A LLaMA block followed by its DWA (if any): returns Y_i, the stream the next block reads."""

    def __init__(self, config: DenseFormerConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        sources = config.dwa_sources(layer_idx + 1)
        self.dwa = DepthWeightedAverage(sources) if sources else None

    def forward(  # type: ignore[override]  # takes its model's list of block outputs as well
        self, hidden_states: torch.Tensor, block_outputs: list[torch.Tensor], **kwargs
    ) -> torch.Tensor:
        """``(B, T, hidden) -> (B, T, hidden)``; appends X_i to ``block_outputs`` (X_0..X_{i-1} on entry)."""
        block_outputs.append(super().forward(hidden_states, **kwargs))
        return block_outputs[-1] if self.dwa is None else self.dwa(block_outputs)


class DenseFormerModel(LimeModel):
    """The decoder stack with a DWA after each block (see the module docstring)."""

    config_class = DenseFormerConfig
    decoder_layer_class = DenseFormerDecoderLayer
    _no_split_modules = ["DenseFormerDecoderLayer"]

    def run_layers(self, hidden_states: torch.Tensor, **layer_kwargs) -> torch.Tensor:
        """Embeddings X_0 ``(B, T, hidden)`` -> Y_L ``(B, T, hidden)``, keeping every X_j for the DWAs."""
        block_outputs = [hidden_states]
        for layer in self.layers:
            hidden_states = layer(hidden_states, block_outputs=block_outputs, **layer_kwargs)
        return hidden_states

    def mixing_weights(self) -> dict[str, torch.Tensor]:
        """``{"DWA weights": alpha}``, alpha ``(L, L+1)``: row i-1 is block i's DWA, column j its weight on
        X_j (column 0 the embeddings); NaN where X_j is not averaged (j > i, dilation, no DWA)."""
        L = self.config.num_hidden_layers
        alpha = torch.full((L, L + 1), float("nan"))
        for i, layer in enumerate(self.layers):
            dwa = cast(DenseFormerDecoderLayer, layer).dwa
            if dwa is not None:
                alpha[i, dwa.sources] = dwa.weight.detach().float().cpu()
        return {"DWA weights": alpha}


class DenseFormerForCausalLM(LimeForCausalLM):
    """DenseFormer with LLaMA's language-modelling head."""

    config_class = DenseFormerConfig
    base_model_class = DenseFormerModel
    _no_split_modules = ["DenseFormerDecoderLayer"]


register_auto(DenseFormerForCausalLM)
