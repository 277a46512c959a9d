"""Direct logit attribution against a hand-written computation: each block's attention and MLP outputs read with
plain forward hooks, the final norm's scale frozen and applied by hand (LayerNorm for GPT-2 and NeoX, RMSNorm for
LLaMA and LIMe), dotted with the unembedding's answer - wrong direction; and the closed form: the components and
the biases sum to the model's own logit difference."""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_checkpoint

import lime_probe
from lime_probe import Pair, direct_logit_attribution

PAIRS = [
    Pair("The cat is on the mat and the dog", "The cat was on the mat and the dog", " is", " was"),
    Pair("The cat was on the mat and the dog", "The cat is on the mat and the dog", " was", " is"),
]
MODULES = {  # (blocks, attention, mlp, final norm) as the architecture names them
    "gpt2": ("transformer.h", "attn", "mlp", "transformer.ln_f"),
    "gpt_neox": ("gpt_neox.layers", "attention", "mlp", "gpt_neox.final_layer_norm"),
    "llama": ("model.layers", "self_attn", "mlp", "model.norm"),
    "lime": ("model.layers", "self_attn", "mlp", "model.norm"),
}


def by_hand(hf, tok, pair: Pair) -> tuple[list[float], float]:
    """(the embeddings' then each block's attention and MLP attribution, the logit difference), one prompt."""
    blocks, attn, mlp, norm_path = MODULES[hf.config.model_type]
    outs: dict[str, torch.Tensor] = {}
    handles = []
    for i, block in enumerate(hf.get_submodule(blocks)):
        for name in (attn, mlp):
            module = block.get_submodule(name)

            def keep(m, args, out, key=f"{name}/{i}"):
                outs[key] = (out[0] if isinstance(out, tuple) else out)[0, -1].double()

            handles.append(module.register_forward_hook(keep))
    ids = tok(pair.clean, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    for h in handles:
        h.remove()
    a, w = (tok(t, add_special_tokens=False)["input_ids"][0] for t in (pair.answer, pair.wrong))
    norm = hf.get_submodule(norm_path)
    x = sum(outs.values()) + out.hidden_states[0][0, -1].double()  # the residual at the last block's output
    layer_norm = isinstance(norm, torch.nn.LayerNorm)
    center = (lambda c: c - c.mean()) if layer_norm else (lambda c: c)
    eps = norm.eps if layer_norm else norm.variance_epsilon
    scale = torch.sqrt(center(x).pow(2).mean() + eps)
    direction = (hf.get_output_embeddings().weight[a] - hf.get_output_embeddings().weight[w]).double()
    parts = [out.hidden_states[0][0, -1].double()] + [
        outs[f"{n}/{i}"] for i in range(len(outs) // 2) for n in (attn, mlp)
    ]
    values = [float((norm.weight.double() * center(c) / scale) @ direction) for c in parts]
    return values, float(out.logits[0, -1, a] - out.logits[0, -1, w])


@pytest.mark.parametrize("arch", list(MODULES))
def test_direct_logit_attribution_equals_hooks_and_sums_to_the_logit_difference(tmp_path, arch):
    model, tok = lime_probe.load(save_tiny_checkpoint(tmp_path / arch, arch))
    dla = direct_logit_attribution(model, tok, PAIRS)
    assert dla.components[0] == "embed" and dla.components[1:3] == ["attn_out/0", "mlp_out/0"]
    for i, pair in enumerate(PAIRS):
        values, ld = by_hand(model._module, tok, pair)
        torch.testing.assert_close(
            dla.values[i], torch.tensor(values, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
        assert float(dla.logit_diff[i]) == pytest.approx(ld, abs=1e-5)
    # the closed form: what every component and the biases add is the model's own logit difference
    torch.testing.assert_close(dla.values.sum(1) + dla.bias, dla.logit_diff, rtol=1e-4, atol=1e-5)


class DoubledNorm(torch.nn.Module):
    """An RMSNorm's parameters with twice its output: neither a LayerNorm nor w * x / rms(x)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_a_norm_it_cannot_freeze_is_refused():
    from helpers import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    hf = tiny_model("llama", tok)
    hf.model.norm = DoubledNorm(hf.model.norm)
    with pytest.raises(ValueError, match="neither a LayerNorm nor an RMSNorm"):
        direct_logit_attribution(hf, tok, PAIRS)
