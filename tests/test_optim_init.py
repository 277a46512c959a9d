"""Weight-decay groups and initialisation where the paper is silent, as the official code does them.

Expected parameter groups are listed by hand from the architecture; init distributions are checked
with a Kolmogorov-Smirnov test against the closed-form distribution (uniform +-1/sqrt(fan_in) for
PyTorch's default Linear init, normal(0, initializer_range) for HF's).
"""

import math

import pytest
import torch
from scipy import stats

from lime_model import LimeConfig, LimeForCausalLM, param_groups

LAYERS = 3
SIZES = dict(
    vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=LAYERS, num_attention_heads=4
)


def expected_groups(tied: bool) -> dict[str, set[str]]:
    """The official code's buckets for this model, written out name by name."""
    decay, no_decay, router = set(), {"model.embed_tokens.weight", "model.norm.weight"}, set()
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        decay |= {f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"}
        decay |= {f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        no_decay |= {f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"}
        if i > 0:  # layer 0 reads only itself: no router weights
            router.add(f"{layer}.self_attn.router.weight")
    if not tied:
        decay.add("lm_head.weight")
    return {"decay": decay, "no_decay": no_decay, "router": router}


@pytest.mark.parametrize("tied", [False, True])
def test_param_groups_match_a_listing_by_name(tied):
    model = LimeForCausalLM(
        LimeConfig(routing="full", num_key_value_heads=2, tie_word_embeddings=tied, **SIZES)
    )
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, weight_decay=0.1, router_lr_mult=10.0, lr=1e-3)
    got = {g["name"]: {names[id(p)] for p in g["params"]} for g in groups}
    assert got == expected_groups(tied)
    decay = {g["name"]: g["weight_decay"] for g in groups}
    assert decay == {"decay": 0.1, "no_decay": 0.0, "router": 0.0}
    if tied:  # the shared embedding / lm_head matrix is never decayed
        assert model.lm_head.weight is model.model.embed_tokens.weight


def _kv_weights(model) -> torch.Tensor:
    attn = [layer.self_attn for layer in model.model.layers]
    return torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]).flatten() for a in attn]).detach()


BIG = dict(SIZES, hidden_size=256, num_attention_heads=8, num_hidden_layers=2)


def test_lime_kv_projections_get_pytorch_default_linear_init():
    torch.manual_seed(0)
    model = LimeForCausalLM(LimeConfig(routing="full", num_key_value_heads=8, **BIG))
    w = _kv_weights(model).double().numpy()  # 2 layers x 2 x 256 x 256 samples, layer 0 included
    bound = 1 / math.sqrt(
        BIG["hidden_size"]
    )  # kaiming_uniform(a=sqrt(5)): gain sqrt(1/3), bound sqrt(3)*gain/sqrt(fan_in)
    assert abs(w).max() <= bound
    assert abs(w).max() > 0.999 * bound
    assert stats.kstest(w, stats.uniform(loc=-bound, scale=2 * bound).cdf).pvalue > 1e-3
    assert stats.kstest(w, stats.norm(scale=0.02).cdf).pvalue < 1e-12
    # the other projections keep LLaMA's normal(0, initializer_range)
    q = model.model.layers[1].self_attn.q_proj.weight.detach().double().flatten().numpy()
    assert stats.kstest(q, stats.norm(scale=model.config.initializer_range).cdf).pvalue > 1e-3


def test_llama_baseline_keeps_hf_normal_init():
    torch.manual_seed(0)
    model = LimeForCausalLM(LimeConfig(routing="none", num_key_value_heads=8, **BIG))
    w = _kv_weights(model).double().numpy()
    std = model.config.initializer_range
    assert stats.kstest(w, stats.norm(scale=std).cdf).pvalue > 1e-3
    assert abs(w).max() > 1 / math.sqrt(BIG["hidden_size"])  # normal tails pass the uniform bound


@pytest.mark.parametrize("routing, kv_proj_init", [("full", "normal"), ("none", "torch")])
def test_kv_proj_init_overrides_either_model(tmp_path, routing, kv_proj_init):
    """The ablation switch: LIMe with LLaMA's k/v init, LLaMA with LIMe's; kept through save/load."""
    torch.manual_seed(0)
    model = LimeForCausalLM(
        LimeConfig(routing=routing, num_key_value_heads=8, kv_proj_init=kv_proj_init, **BIG)
    )
    w = _kv_weights(model).double().numpy()
    bound, std = 1 / math.sqrt(BIG["hidden_size"]), model.config.initializer_range
    uniform, normal = stats.uniform(loc=-bound, scale=2 * bound).cdf, stats.norm(scale=std).cdf
    want, other = (normal, uniform) if kv_proj_init == "normal" else (uniform, normal)
    assert stats.kstest(w, want).pvalue > 1e-3 and stats.kstest(w, other).pvalue < 1e-12
    model.save_pretrained(tmp_path)
    assert LimeConfig.from_pretrained(tmp_path).kv_proj_init == kv_proj_init


def test_kv_proj_init_rejects_unknown_values():
    with pytest.raises(ValueError, match="kv_proj_init must be one of auto, torch, normal, got 'xavier'"):
        LimeConfig(kv_proj_init="xavier")
