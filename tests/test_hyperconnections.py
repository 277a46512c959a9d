"""HyperConnections against a plain per-stream loop over the HC paper's equations, and at init against
LLaMA (a Pre-Norm transformer with the same weights); HF round trips, cached generation, FLOPs, params."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_tokenizer
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from lime_model import (
    HyperConnectionsConfig,
    HyperConnectionsForCausalLM,
    LimeConfig,
    LimeForCausalLM,
    forward_flops,
    param_groups,
)
from lime_probe.extraction.tracing import extract

DIMS = dict(
    vocab_size=61,
    hidden_size=16,
    intermediate_size=40,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny(seed: int = 0, perturb: bool = True, **fields) -> HyperConnectionsForCausalLM:
    """A tiny HC model (3 streams, 4 blocks: block 3 starts on stream 0 again); `perturb` moves every
    HC parameter off its init so the static and dynamic parts all matter."""
    torch.manual_seed(seed)
    cfg = HyperConnectionsConfig(**(DIMS | {"expansion_rate": 3} | fields))
    cfg._attn_implementation = "sdpa"
    model = HyperConnectionsForCausalLM(cfg).eval()
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".hc_" in name:
                    p.add_(torch.randn_like(p) * (0.5 if "fn" in name or "scale" in name else 0.3))
    return model


def sublayer(layer, kind: str, h: torch.Tensor, rope) -> torch.Tensor:
    """T(h): the block's attention or MLP after a parameter-free LayerNorm (causal: SDPA, no mask)."""
    h = F.layer_norm(h, h.shape[-1:])
    if kind == "attn":
        return layer.self_attn(h, position_embeddings=rope, attention_mask=None)[0]
    return layer.mlp(h)


def reference(model: HyperConnectionsForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Logits and the per-block sums of streams from the HC equations, one stream and one weight at a time:
    A = A_static + s_a tanh(LN(H_j) W_a) (row j), B_j = B_static_j + s_b tanh(LN(H_j) W_b),
    h = sum_j A[j, 0] H_j, H'_k = B_k T(h) + sum_j A[j, 1 + k] H_j."""
    base, cfg = model.model, model.config
    n, d = cfg.expansion_rate, cfg.hidden_size
    x = base.embed_tokens(ids)
    rope = base.rotary_emb(x, torch.arange(ids.shape[1])[None])
    streams, sums = [x] * n, [x]
    for layer in base.layers:
        for hc, kind in ((layer.hc_attn, "attn"), (layer.hc_mlp, "mlp")):
            A = [[hc.static_alpha[j, c] for c in range(n + 1)] for j in range(n)]
            B = [hc.static_beta[j] for j in range(n)]
            if cfg.dynamic:
                for j in range(n):
                    normed = F.layer_norm(streams[j], (d,))
                    dyn = torch.tanh(normed @ hc.dynamic_alpha_fn) * hc.dynamic_alpha_scale
                    A[j] = [A[j][c] + dyn[..., c, None] for c in range(n + 1)]
                    B[j] = B[j] + torch.tanh(normed @ hc.dynamic_beta_fn)[..., None] * hc.dynamic_beta_scale
            out = sublayer(layer, kind, sum(A[j][0] * streams[j] for j in range(n)), rope)
            streams = [B[k] * out + sum(A[j][1 + k] * streams[j] for j in range(n)) for k in range(n)]
        sums.append(sum(streams))
    return model.lm_head(base.norm(sums[-1])), sums


@pytest.mark.parametrize("dynamic", [True, False])
def test_matches_hc_equations_outputs_and_gradients(dynamic):
    model = tiny(dynamic=dynamic)
    ids = torch.randint(0, DIMS["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    want, _ = reference(model, ids)
    torch.testing.assert_close(logits, want)
    params = [p for _, p in model.named_parameters()]
    got = torch.autograd.grad(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), params)
    ref = torch.autograd.grad(F.cross_entropy(want[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), params)
    for (name, _), g, r in zip(model.named_parameters(), got, ref, strict=True):
        torch.testing.assert_close(g, r, msg=name)
    assert any(
        ".hc_" in name and g.abs().sum() > 0
        for (name, _), g in zip(model.named_parameters(), got, strict=True)
    )


def test_at_init_equals_prenorm_llama_with_the_same_weights():
    """HC's init makes every stream the Pre-Norm residual stream; the final norm sees n times it, which
    only its eps tells apart (set tiny here). Sub-layer norms: HC's parameter-free LayerNorm, put in LLaMA."""
    hc = tiny(perturb=False, rms_norm_eps=1e-12)
    llama = LimeForCausalLM(LimeConfig(routing="none", rms_norm_eps=1e-12, **DIMS)).eval()
    missing, unexpected = llama.load_state_dict(hc.state_dict(), strict=False)
    assert all(".hc_" in k for k in unexpected) and unexpected
    assert all(k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) for k in missing)
    for layer in llama.model.layers:
        layer.input_layernorm = nn.LayerNorm(16, elementwise_affine=False, bias=False)
        layer.post_attention_layernorm = nn.LayerNorm(16, elementwise_affine=False, bias=False)
    ids = torch.randint(0, DIMS["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    got, want = hc(ids, output_hidden_states=True), llama(ids, output_hidden_states=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    n = hc.config.expansion_rate
    torch.testing.assert_close(got.hidden_states[0], want.hidden_states[0])  # the embeddings
    for i in range(1, DIMS["num_hidden_layers"]):  # block outputs: the sum of n equal streams
        torch.testing.assert_close(got.hidden_states[i], n * want.hidden_states[i])


def test_mixing_weights_at_init_are_the_prenorm_matrices():
    weights = tiny(perturb=False).model.mixing_weights()
    a_m, a_r, b = weights.values()
    n, L = 3, DIMS["num_hidden_layers"]
    want_am = torch.zeros(2 * L, n)
    for s in range(2 * L):  # both sub-layers of block i read stream i mod n
        want_am[s, (s // 2) % n] = 1
    torch.testing.assert_close(a_m, want_am)
    torch.testing.assert_close(a_r, torch.eye(n).repeat(2 * L, 1))
    torch.testing.assert_close(b, torch.ones(2 * L, n))


def test_save_load_round_trip(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "hyperconnections"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HyperConnectionsForCausalLM
    assert loaded.config.expansion_rate == 3 and loaded.config.dynamic
    for (name, p), (name2, q) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == name2 and torch.equal(p, q), name
    ids = torch.randint(0, DIMS["vocab_size"], (1, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_generate_with_cache_matches_uncached_greedy_loop():
    model = tiny()
    ids = torch.randint(0, DIMS["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        seq = ids
        for _ in range(8):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        assert torch.equal(out, seq)
        full = model(seq).logits
        prefix = model(seq[:, :6], use_cache=True)
        rest = model(seq[:, 6:], past_key_values=prefix.cache, use_cache=True)
        torch.testing.assert_close(rest.logits, full[:, 6:])


def test_config_rejects_routing_and_bad_rate():
    with pytest.raises(ValueError, match="routing must be 'none'"):
        HyperConnectionsConfig(routing="full")
    with pytest.raises(ValueError, match="expansion_rate"):
        HyperConnectionsConfig(expansion_rate=0)


def test_flops_and_parameters_against_hand_counts():
    """Per token and hyper-connection (n = 4, d = 16): LN 4*64, W_a 64*5 + W_b 64 MACs, tanh/scale/add
    on 20 + 4 weights (3 each), width 5*64 MACs, depth 2*64; per block LLaMA's 2 RMSNorms (5d + 8) and
    2 residual adds leave, 2 parameter-free LayerNorms (4d) come; the final stream sum adds n*d."""
    L, d, T = 4, 16, 11
    cfg = HyperConnectionsConfig(**DIMS)
    per_hc = 4 * 64 + (320 + 64) + 3 * (20 + 4) + 320 + 2 * 64
    want = T * (2 * L * per_hc + 4 * d - L * (2 * (5 * d + 8) + 2 * d - 2 * 4 * d))
    assert cfg.cross_layer_flops(T) == want
    llama = LimeConfig(routing="none", **DIMS)
    assert forward_flops(cfg, T) - forward_flops(llama, T) == want
    static = HyperConnectionsConfig(dynamic=False, **DIMS)
    assert static.cross_layer_flops(T) == T * (2 * L * (320 + 128) + 4 * d - L * (4 * d + 16))

    # the matmul part against torch's counter (2 FLOPs per MAC): W_a and the width connection (torch
    # counts no matrix-vector products, so not W_b (d,); the official fvcore handler does, as here)
    models = [HyperConnectionsForCausalLM(cfg), LimeForCausalLM(llama)]
    counts = []
    for model in models:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, T, dtype=torch.long))
        counts.append(counter.get_total_flops())
    assert counts[0] - counts[1] == 2 * T * 2 * L * (320 + 320)

    hc_params = sum(p.numel() for p in models[0].parameters())
    llama_params = sum(p.numel() for p in models[1].parameters())
    per_hc_params = 4 * 5 + 4 + d * 5 + 1 + d + 1
    assert hc_params - llama_params == 2 * L * per_hc_params - 2 * L * d  # minus LLaMA's norm weights


def test_weight_decay_follows_the_official_split():
    """Official configure_optimizers: static_alpha/static_beta undecayed, dynamic fns and scales decayed."""
    model = tiny(perturb=False)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {
        g["name"]: {names[id(p)].rsplit(".", 1)[-1] for p in g["params"]} for g in param_groups(model, 0.1)
    }
    assert groups["decay"] == {
        "weight",
        "dynamic_alpha_fn",
        "dynamic_alpha_scale",
        "dynamic_beta_fn",
        "dynamic_beta_scale",
    }
    assert groups["no_decay"] == {
        "weight",
        "static_alpha",
        "static_beta",
    }  # embeddings (tied head), final norm


def test_probe_sites_hidden_is_the_sum_of_streams():
    """hidden X_0 = the embeddings, X_l = the sum of the streams after block l; keys = W_K's output."""
    tok = tiny_tokenizer()
    model = tiny(vocab_size=len(tok))
    texts = ["The cat is on the mat.", "It was"]
    acts = extract(model, tok, texts, sites=["hidden", "final", "keys"], progress=False)
    keys, sums, final = [], [], []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, args, out, i=i: keys.append((i, out[0])))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for text in texts:
            logits, text_sums = reference(model, tok(text, return_tensors="pt").input_ids)
            sums.append([s[0] for s in text_sums])
            final.append(model.model.norm(text_sums[-1])[0])
    for h in hooks:
        h.remove()
    for i in range(DIMS["num_hidden_layers"] + 1):
        torch.testing.assert_close(acts["hidden"][i], torch.cat([s[i] for s in sums]))
    torch.testing.assert_close(acts["final"][0], torch.cat(final))
    for i in range(DIMS["num_hidden_layers"]):
        torch.testing.assert_close(acts["keys"][i], torch.cat([k for j, k in keys if j == i]))
