"""Analytic forward FLOPs of one sequence, counted with the paper's convention.

The paper (Appendix I) counts with fvcore plus custom handlers (the official
``src/utils/flops_counter.py``): a matmul counts its multiply-accumulates (``M*N*K``), scaled dot-product
attention counts ``4*H*T^2*D + 3*H*T^2`` (both products and the softmax, no causal halving), and
element-wise ops count their output size (``rsqrt`` 6x, ``pow`` 2x, ``sin``/``cos`` 15x). The
embedding lookup is free. With this convention the paper's 1B configurations give Table 16's LIMe
and DenseFormer overheads over LLaMA (LIMe +0.08 % with GQA, +1.22 % with full attention; DenseFormer
+0.02 % with both, its depth-weighted averages counted as matmuls: a baseline's own mixing is its
config's ``cross_layer_flops``). HyperConnections comes out 0.01 points above the table (+0.32 % and
+0.30 % vs +0.31 % and +0.29 %), and the LLaMA totals 0.0003 T above it (2.7618 vs 2.7615 T with GQA).
"""

from __future__ import annotations

from .config import LimeConfig


def flops_breakdown(config: LimeConfig, seq_len: int) -> dict[str, int]:
    """Forward cost of one sequence of ``seq_len`` tokens, by component (see module docstring).

    Returns a dict with ``linear`` (projection and lm-head MACs), ``router`` (router MACs, as each
    router class counts them: ``lime_model.router.LimeRouter.flops``), ``attention`` (SDPA as
    above), ``elementwise`` (norms, RoPE, SiLU gate, residual adds, router element-wise ops) and
    ``cross_layer`` (a baseline's own cross-layer mixing: ``LimeConfig.cross_layer_flops``).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    T, d, inter = seq_len, config.hidden_size, config.intermediate_size
    H, kv, D, L = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.num_hidden_layers,
    )
    spec = config.routing_spec

    per_layer_linear = T * d * (2 * H * D + 2 * kv * D) + 3 * T * d * inter
    linear = L * per_layer_linear + T * d * config.vocab_size

    routing = {"router": 0, "elementwise": 0}  # each router class counts its own arithmetic
    if spec.enabled:
        for i in range(L):
            for part, n in spec.router.flops(config, len(spec.sources(i)), T).items():
                routing[part] += n

    attention = L * (4 * H * T * T * D + 3 * H * T * T)

    rmsnorm = T * d * (2 + 1 + 2) + 8 * T  # pow, mean, two muls; add eps and rsqrt per row
    rope = 2 * 15 * T * D + 6 * T * (H + kv) * D  # cos/sin tables; mul, mul, add, neg on q and k
    mlp_act = 2 * T * inter  # silu and the gate product
    elementwise = L * (2 * rmsnorm + rope + mlp_act + 2 * T * d) + rmsnorm + routing["elementwise"]
    return {
        "linear": linear,
        "router": routing["router"],
        "attention": attention,
        "elementwise": elementwise,
        "cross_layer": config.cross_layer_flops(T),
    }


def forward_flops(config: LimeConfig, seq_len: int) -> int:
    """Forward FLOPs of one sequence (attention and router included); training costs ~3x this."""
    return sum(flops_breakdown(config, seq_len).values())


def training_flops_per_token(config: LimeConfig, seq_len: int) -> float:
    """Training FLOPs per token as a GPU's peak FLOP/s counts them (a multiply-accumulate is two), for
    step times and utilisation: the paper's convention counts a matmul's MACs once but attention's two
    products as ``4*H*T^2*D``, already two per MAC, so only the matmuls are doubled; x 3 for the forward
    and the two backward products."""
    parts = flops_breakdown(config, seq_len)
    macs = parts["linear"] + parts["router"] + parts["cross_layer"]
    return 3 * (2 * macs + parts["attention"] + parts["elementwise"]) / seq_len
