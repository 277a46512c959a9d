"""forward_flops against the paper's Table 16 and against torch's own FLOP counter."""

import pytest
import torch
from helpers import PAPER_1B
from torch.utils.flop_counter import FlopCounterMode

from lime_model import LimeConfig, LimeForCausalLM, forward_flops
from lime_model.flops import flops_breakdown


@pytest.mark.parametrize(("kv", "overhead_percent"), [(8, 0.08), (32, 1.22)])
def test_paper_table16_overheads(kv, overhead_percent):
    lime = forward_flops(LimeConfig(routing="full", num_key_value_heads=kv, **PAPER_1B), 2048)
    llama = forward_flops(LimeConfig(routing="none", num_key_value_heads=kv, **PAPER_1B), 2048)
    assert round(100 * (lime / llama - 1), 2) == overhead_percent


@pytest.mark.parametrize(
    "routing",
    [
        "none",
        "full",
        "first-1",
        "dilated-2",
        "dilated-back-2",
        "average",
        "no-head-mix",
        "per-dim",
        "dynamic",
    ],
)
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
def test_dilated_router_cost_counts_the_papers_source_sets(d):
    """Router MACs: keys and values each mix |S_i| * kv heads into kv heads, per token and feature, with
    S_i = {0, d, 2d, ... < i} plus i (App. F/G), written here from the definition."""
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
