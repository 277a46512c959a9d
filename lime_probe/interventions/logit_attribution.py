"""Direct logit attribution: what each block's attention and MLP output, and the embeddings, add to the last
position's logit difference along the direct path through the final norm and the unembedding.

The residual stream at the last block's output is X_L = X_0 + sum_l (attn_out_l + mlp_out_l) (checked, and
a model where it is not, e.g. one with norms after its sublayers, is refused). The final norm is linear in
X once its scale is frozen at the run's own value (as TransformerLens's ``apply_ln_to_stack`` freezes it):
``N(c) = w * center(c) / s`` with ``s`` the norm's scale of X_L, ``center`` subtracting the mean for a
LayerNorm and nothing for an RMSNorm (checked against the module: N(X_L) + bias must be its output). Each
component's attribution is ``N(c) . (W_U[answer] - W_U[wrong])``; with the norm's and the head's bias terms
they sum to the logit difference exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lime_probe.extraction.adapters import adapter_for
from lime_probe.extraction.tracing import as_nnsight
from lime_probe.interventions.pairs import Pair
from lime_probe.interventions.patching import logit_diff, pair_tokens
from lime_probe.interventions.run import run_with_edits


@dataclass
class LogitAttribution:
    """Per pair and component, its direct contribution to the clean run's logit difference.

    Attributes:
        components: names, "embed" then "attn_out/<l>" and "mlp_out/<l>" in block order.
        values: (n_pairs, n_components) float64.
        bias: (n_pairs,) what the final norm's and the unembedding's biases add.
        logit_diff: (n_pairs,) the run's own logit difference (= values.sum(1) + bias).
    """

    components: list[str]
    values: torch.Tensor
    bias: torch.Tensor
    logit_diff: torch.Tensor

    def rows(self) -> list[dict]:
        """Tidy rows: component, site, layer, mean attribution over pairs, its share of the mean logit difference."""
        means = self.values.mean(0)
        total = float(self.logit_diff.mean())
        out = []
        for name, value in zip(self.components, means.tolist(), strict=True):
            site, _, layer = name.partition("/")
            out.append(
                {
                    "component": name,
                    "site": site,
                    "layer": int(layer) if layer else None,
                    "attribution": value,
                }
                | {"share": value / total if total else float("nan")}
            )
        return out


def direct_logit_attribution(
    model: Any, tokenizer: Any, pairs: Sequence[Pair], batch_size: int = 32
) -> LogitAttribution:
    """The direct logit attribution of the clean prompts of `pairs` (module doc).

    Raises:
        ValueError: a model whose residual stream is not the sum of its components, or whose final norm is
            neither a LayerNorm nor an RMSNorm as the frozen-scale map needs.
    """
    nn_model, tokenizer = as_nnsight(model, tokenizer)
    hf = nn_model._module
    clean, _, answers = pair_tokens(tokenizer, pairs)
    run = run_with_edits(
        nn_model, tokenizer, clean, read=["hidden", "attn_out", "mlp_out"], batch_size=batch_size
    )
    assert run.acts is not None
    last = run.acts.offsets[1:] - 1  # each sequence's last token row
    n_layers = len(run.acts.layers("attn_out"))
    parts = {"embed": run.acts["hidden"][0][last].double()}
    for layer in range(n_layers):
        parts[f"attn_out/{layer}"] = run.acts["attn_out"][layer][last].double()
        parts[f"mlp_out/{layer}"] = run.acts["mlp_out"][layer][last].double()
    residual = run.acts["hidden"][n_layers][last].double()
    _check_sum(residual, torch.stack(list(parts.values())).sum(0))
    norm = hf.base_model.get_submodule(_final_norm(hf))
    frozen, norm_bias = _frozen_norm(norm, residual)
    unembed = hf.get_output_embeddings()
    direction = (unembed.weight[answers[:, 0]] - unembed.weight[answers[:, 1]]).double().detach()  # (n, d)
    values = torch.stack([(frozen(c) * direction).sum(-1) for c in parts.values()], dim=1)
    bias = (norm_bias * direction).sum(-1)
    if getattr(unembed, "bias", None) is not None:
        bias = bias + (unembed.bias[answers[:, 0]] - unembed.bias[answers[:, 1]]).double().detach()
    return LogitAttribution(list(parts), values, bias, logit_diff(run.last_logits, answers))


def _final_norm(hf: Any) -> str:
    path = adapter_for(hf).final_norm
    if path is None:
        raise ValueError(
            f"direct logit attribution needs a final norm, and {type(hf).__name__} has none found"
        )
    return path


def _check_sum(residual: torch.Tensor, total: torch.Tensor) -> None:
    """ValueError unless the last block's output equals the embeddings plus every attention and MLP output."""
    gap = float((residual - total).abs().max() / residual.abs().max().clamp_min(1e-12))
    if gap > 1e-4:
        raise ValueError(
            "direct logit attribution needs a residual stream that is the sum of the embeddings and every "
            f"attention and MLP output; this model's differs by {gap:.2g} of its size (norms after sublayers?)"
        )


def _frozen_norm(norm: Any, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The final norm's map with its scale frozen at `x` (n, d): (c -> w * center(c) / s, the norm's bias),
    checked against the module's own output on `x`."""
    weight = norm.weight.detach().double()
    bias = (
        norm.bias.detach().double() if getattr(norm, "bias", None) is not None else torch.zeros_like(weight)
    )
    eps = next(float(getattr(norm, a)) for a in ("variance_epsilon", "eps", "epsilon") if hasattr(norm, a))
    centered = isinstance(norm, torch.nn.LayerNorm)
    center = (lambda c: c - c.mean(-1, keepdim=True)) if centered else (lambda c: c)
    scale = (center(x).pow(2).mean(-1, keepdim=True) + eps).sqrt()

    def frozen(c: torch.Tensor) -> torch.Tensor:
        return weight * center(c) / scale

    with torch.no_grad():
        own = norm(x.to(norm.weight.dtype)).double()
    if not torch.allclose(frozen(x) + bias, own, rtol=1e-4, atol=1e-5):
        raise ValueError(
            f"direct logit attribution: the final norm ({type(norm).__name__}) is neither a LayerNorm nor an "
            "RMSNorm (w * x / rms(x)), so its frozen-scale map is not known"
        )
    return frozen, bias
