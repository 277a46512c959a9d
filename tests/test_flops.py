"""forward_flops against the paper's Table 16 and against torch's own FLOP counter."""

import pytest
import torch
from helpers import PAPER_1B, routed_specs
from torch.utils.flop_counter import FlopCounterMode

from lime_model import LimeConfig, LimeForCausalLM, config_for, forward_flops
from lime_model.flops import flops_breakdown

# Table 16 (App. I): forward FLOPs in units of 10^12 (T) and the overheads over LLaMA in %, 1B, 2048
# tokens; keys are the K/V heads (8: GQA, 32: full attention).
TABLE16 = {
    8: {"llama": (2.7615, 0.0), "denseformer": (2.7622, 0.02), "lime": (2.7638, 0.08), "hyperconnections": (2.7701, 0.31)},
    32: {"llama": (2.9679, 0.0), "denseformer": (2.9685, 0.02), "lime": (3.0041, 1.22), "hyperconnections": (2.9764, 0.29)},
}  # fmt: skip


def _flops(arch: str, kv: int) -> int:
    routing = {"lime": {"routing": "full"}, "llama": {"routing": "none"}}.get(arch, {})
    return forward_flops(
        config_for("lime" if arch == "llama" else arch, num_key_value_heads=kv, **routing, **PAPER_1B), 2048
    )


@pytest.mark.parametrize("kv", [8, 32])
def test_table16_lime_row(kv):
    lime, llama = _flops("lime", kv), _flops("llama", kv)
    assert round(100 * (lime / llama - 1), 2) == TABLE16[kv]["lime"][1]


@pytest.mark.parametrize("kv", [8, 32])
def test_table16_denseformer_row(kv):
    """The DWAs' cost alone (what DenseFormer adds to LLaMA) lies in the interval Table 16's rounded
    totals allow (difference of two 4-decimal T values, +-0.0001 T), and the overhead rounds to its +0.02 %.
    By hand: the DWA after block i averages i + 1 tensors of 2048 x 2048, one multiply-accumulate each."""
    T, d = 2048, 2048
    extra = _flops("denseformer", kv) - _flops("llama", kv)
    assert extra == sum((i + 1) * T * d for i in range(1, 17))
    paper = (TABLE16[kv]["denseformer"][0] - TABLE16[kv]["llama"][0]) * 1e12
    assert paper - 1e8 <= extra <= paper + 1e8
    assert (
        round(100 * (_flops("denseformer", kv) / _flops("llama", kv) - 1), 2) == TABLE16[kv]["denseformer"][1]
    )


@pytest.mark.parametrize("kv", [8, 32])
def test_table16_hyperconnections_row_is_0_01_points_over(kv):
    """HyperConnections' overhead is 0.01 percentage points above Table 16's (+0.32 % vs +0.31 % with GQA,
    +0.30 % vs +0.29 % with full attention): a known, unexplained gap, pinned here so a change shows."""
    overhead = 100 * (_flops("hyperconnections", kv) / _flops("llama", kv) - 1)
    assert round(overhead, 2) - TABLE16[kv]["hyperconnections"][1] == pytest.approx(0.01, abs=1e-9)


@pytest.mark.parametrize("routing", ["none", *routed_specs()])
def test_matmul_terms_match_torch_flop_counter(routing):
    """torch counts 2 FLOPs per multiply-accumulate and 4*H*T^2*D for SDPA; we count MACs (paper)."""
    cfg = LimeConfig(
        routing=routing,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg._attn_implementation = "eager"  # attention as two matmuls, which the counter sees
    model = LimeForCausalLM(cfg).eval()
    T = 12
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 64, (1, T)))
    parts = flops_breakdown(cfg, T)
    H, D, L = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    expected = 2 * (parts["linear"] + parts["router"]) + L * 4 * H * T * T * D
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("d", [2, 8])
def test_dilated_router_cost_counts_its_source_sets(d):
    """Router MACs: keys and values each mix |S_i| * kv heads into kv heads, per token and feature, with
    S_i = {0, d, 2d, ... < i} plus i (our reading of App. G), written here from the definition."""
    cfg = LimeConfig(routing=f"dilated-{d}", num_key_value_heads=8, **{**PAPER_1B, "num_hidden_layers": 32})
    T, kv, D = 2048, 8, cfg.head_dim
    sizes = [len({j for j in range(i) if j % d == 0} | {i}) for i in range(32)]
    want = sum(2 * T * kv * S * kv * D for S in sizes if S > 1)
    assert flops_breakdown(cfg, T)["router"] == want


def test_dynamic_router_cost():
    """Offset-free part as full routing, plus the queries (hidden -> kv * head_dim) and their dot products
    with S * kv keys per token, plus one add per coefficient."""
    cfg = LimeConfig(routing="dynamic", num_key_value_heads=8, **PAPER_1B)
    full = flops_breakdown(LimeConfig(routing="full", num_key_value_heads=8, **PAPER_1B), 100)
    dyn = flops_breakdown(cfg, 100)
    kv, D, d = 8, cfg.head_dim, cfg.hidden_size
    extra = sum(100 * kv * D * (d + (i + 1) * kv) for i in range(1, 16))
    assert dyn["router"] - full["router"] == extra
    assert dyn["elementwise"] - full["elementwise"] == sum(100 * kv * (i + 1) * kv for i in range(1, 16))


def test_bad_sequence_length():
    with pytest.raises(ValueError, match="seq_len"):
        forward_flops(LimeConfig(), 0)
