"""DenseFormer and ResFormer against their papers' equations written as plain loops, LLaMA at init, HF round
trips, FLOPs/parameter counts from hand formulas, and training through ``lime-model train --arch``."""

import json
import math

import pytest
import safetensors.torch
import torch
from helpers import CORPUS, PAPER_1B, save_tiny_checkpoint, train_args
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import lime_model
from lime_model import config_for, forward_flops
from lime_model.cli import main
from lime_model.denseformer import DenseFormerForCausalLM
from lime_model.flops import flops_breakdown
from lime_model.hyperconnections import HyperConnectionsForCausalLM
from lime_model.resformer import ResFormerForCausalLM

SIZES = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4)
BASELINES = ["denseformer", "resformer", "hyperconnections"]  # HC's own maths: test_hyperconnections.py


def make(arch: str, kv: int = 2, seed: int = 0, perturb: bool = True, **kw):
    """A tiny model; ``perturb`` moves norms and mixing weights off their init so nothing hides behind it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config_for(arch, num_key_value_heads=kv, **{**SIZES, **kw})
    ).eval()
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or ".dwa." in name or "value_mix" in name or ".hc_" in name:
                    p.add_(0.3 * torch.randn_like(p))
    return model


# ------------------------------------------------------------------ the papers' equations as loops
def rope(x, cos, sin):  # x (B, T, n, D); cos/sin (1, T, D)
    half = x.shape[-1] // 2
    return x * cos[:, :, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, :, None]


def attention(layer, x, cos, sin, values=None):
    """LLaMA attention of one block on its normalised input x (B, T, hidden), with ``values`` (B, T, kv*D)
    in place of its own v_proj(x) when given."""
    attn, cfg = layer.self_attn, layer.self_attn.config
    H, kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    B, T, _ = x.shape
    q = rope(attn.q_proj(x).view(B, T, H, D), cos, sin)
    k = rope(attn.k_proj(x).view(B, T, kv, D), cos, sin).repeat_interleave(H // kv, 2)
    v = (attn.v_proj(x) if values is None else values).view(B, T, kv, D).repeat_interleave(H // kv, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return attn.o_proj(torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, T, H * D))


def block(layer, h, cos, sin, values=None):
    """B_i(h) = h' + mlp(norm(h')) with h' = h + attn(norm(h)): a LLaMA block, residuals included."""
    h = h + attention(layer, layer.input_layernorm(h), cos, sin, values)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def denseformer_reference(model, ids):
    """X_i = B_i(Y_{i-1}), Y_i = sum_{j in S_i} alpha_{i,j} X_j (S_i: j <= i with (i - j) % dilation == 0,
    DWA after every period-th block, else Y_i = X_i), Y_0 = X_0 = embeddings; logits = head(norm(Y_L))."""
    cfg, m = model.config, model.model
    X = [m.embed_tokens(ids)]
    cos, sin = m.rotary_emb(X[0], torch.arange(ids.shape[1])[None])
    Y = X[0]
    for i, layer in enumerate(m.layers, start=1):
        X.append(block(layer, Y, cos, sin))
        if i % cfg.dwa_period:
            Y = X[i]
            continue
        S = [j for j in range(i + 1) if (i - j) % cfg.dwa_dilation == 0]
        alpha = layer.dwa.weight  # one weight per j in S, ascending
        Y = sum(alpha[n] * X[j] for n, j in enumerate(S))
    return model.lm_head(m.norm(Y))


def resformer_reference(model, ids):
    """Layer 1 as LLaMA, V_1 = its values; layer n >= 2 attends over V'_n = lambda_{n,1} V_1 + lambda_{n,2} V_n."""
    m = model.model
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, torch.arange(ids.shape[1])[None])
    for n, layer in enumerate(m.layers):
        v = layer.self_attn.v_proj(layer.input_layernorm(h))
        if n == 0:
            v1 = v
        else:
            lam = layer.self_attn.value_mix.weight
            v = lam[0] * v1 + lam[1] * v
        h = block(layer, h, cos, sin, values=v)
    return model.lm_head(m.norm(h))


def assert_forward_and_gradients_match(model, reference):
    ids = torch.randint(0, 50, (2, 7))
    logits, ref = model(ids).logits, reference(model, ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    target = torch.randn_like(logits)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad], strict=True)
    grads = torch.autograd.grad((logits * target).sum(), params)
    ref_grads = torch.autograd.grad((ref * target).sum(), params)
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=name)
        if ".dwa." in name or "value_mix" in name:
            assert g.abs().sum() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize(("dilation", "period"), [(1, 1), (2, 1), (1, 2), (3, 2)])
@pytest.mark.parametrize("kv", [2, 4])
def test_denseformer_matches_dwa_loop(kv, dilation, period):
    model = make("denseformer", kv, dwa_dilation=dilation, dwa_period=period, num_hidden_layers=5)
    assert_forward_and_gradients_match(model, denseformer_reference)


@pytest.mark.parametrize("value_mix", ["learnable", "fixed"])
@pytest.mark.parametrize("kv", [2, 4])
def test_resformer_matches_value_residual_loop(kv, value_mix):
    model = make("resformer", kv, value_mix=value_mix)
    assert_forward_and_gradients_match(model, resformer_reference)
    fixed = value_mix == "fixed"
    lambdas = [p for n, p in model.named_parameters() if "value_mix" in n]
    assert len(lambdas) == SIZES["num_hidden_layers"] - 1 and all(p.requires_grad != fixed for p in lambdas)


# ------------------------------------------------------------------ init, LLaMA names, HF round trips
def llama_twin(model) -> LlamaForCausalLM:
    """transformers' own LLaMA holding the model's shared weights (every name must exist there)."""
    cfg = model.config
    llama = LlamaForCausalLM(
        LlamaConfig(**{k: getattr(cfg, k) for k in (*SIZES, "num_key_value_heads", "tie_word_embeddings")})
    )
    shared = {k: v for k, v in model.state_dict().items() if ".dwa." not in k and "value_mix" not in k}
    missing, unexpected = llama.load_state_dict(shared, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return llama.eval()


@pytest.mark.parametrize("arch", ["denseformer", "resformer"])  # HC swaps the sub-layer norms (own test)
def test_shared_parameters_keep_llamas_names(arch):
    llama_twin(make(arch, perturb=False))


def test_fresh_denseformer_is_exactly_llama():
    """alpha_{i,i} = 1, the rest 0: the DWA passes the block output through (DenseFormer's init)."""
    model = make("denseformer", perturb=False)
    alpha = model.model.mixing_weights()["DWA weights"]
    L = SIZES["num_hidden_layers"]
    expected = torch.full((L, L + 1), float("nan"))
    for i in range(L):
        expected[i, : i + 2] = 0.0
        expected[i, i + 1] = 1.0
    torch.testing.assert_close(alpha, expected, equal_nan=True)
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(model(ids).logits, llama_twin(model)(ids).logits, atol=1e-5, rtol=1e-5)


def test_fresh_resformer_mixes_half_and_half():
    model = make("resformer", perturb=False)
    lam = model.model.mixing_weights()["value residual lambdas"]
    assert lam.shape == (SIZES["num_hidden_layers"], 2)
    assert torch.isnan(lam[0]).all() and torch.equal(
        lam[1:], torch.full((SIZES["num_hidden_layers"] - 1, 2), 0.5)
    )


@pytest.mark.parametrize("arch", BASELINES)
def test_save_load_round_trip_through_auto_classes(tmp_path, arch):
    model = make(arch)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(tmp_path).model_type == arch
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    original = model.state_dict()
    assert set(loaded.state_dict()) == set(original)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    ids = torch.randint(0, 50, (2, 6))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("arch", BASELINES)
def test_greedy_generation_with_cache_equals_a_loop_without(arch):
    model = make(arch)
    prompt = torch.randint(3, 50, (2, 5))
    with_cache = model.generate(
        prompt, use_cache=True, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    seq = prompt
    for _ in range(8):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(with_cache, seq)


@pytest.mark.parametrize("arch", BASELINES)
def test_baselines_take_no_routing(arch):
    with pytest.raises(ValueError, match="takes no LIMe routing"):
        config_for(arch, routing="full", **SIZES)
    with pytest.raises(
        ValueError, match="unknown arch 'nope'; valid: lime, denseformer, resformer, hyperconnections"
    ):
        config_for("nope")


@pytest.mark.parametrize("arch", ["denseformer", "resformer"])  # HC decays part of its weights (own test)
def test_mixing_weights_get_no_weight_decay(arch):
    model = make(arch)
    groups = {g["name"]: {id(p) for p in g["params"]} for g in lime_model.param_groups(model, 0.1, lr=1e-3)}
    mixing = {
        id(p) for n, p in model.named_parameters() if (".dwa." in n or "value_mix" in n) and p.requires_grad
    }
    assert mixing and mixing <= groups["no_decay"]


# ------------------------------------------------------------------ FLOPs and parameter counts
def n_params(cfg) -> int:
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def test_counts_against_hand_formulas():
    """The baselines' extra cost against hand formulas: DenseFormer (dilation 1, period 1) adds L(L+3)/2
    weights and, per DWA over k = i + 1 tensors of T x d, k multiply-accumulates per element (a weighted
    sum as a matmul; Table 16's rows: test_flops.py); ResFormer adds 2 lambdas per layer after the first
    and 2 multiplies + 1 add per value element (T x kv*D) there. Counts are built at a small width (the
    parameter formulas do not depend on it); FLOPs at the 1B configuration with T = 2048."""
    small = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=16, num_attention_heads=4
    )
    L = 16
    llama = n_params(config_for("lime", routing="none", **small))
    assert n_params(config_for("denseformer", **small)) - llama == L * (L + 3) // 2 == 152
    assert n_params(config_for("resformer", **small)) - llama == 2 * (L - 1)

    T, d, kv, D = 2048, 2048, 8, 64
    base = flops_breakdown(config_for("lime", routing="none", num_key_value_heads=kv, **PAPER_1B), T)
    dense = flops_breakdown(config_for("denseformer", num_key_value_heads=kv, **PAPER_1B), T)
    res = flops_breakdown(config_for("resformer", num_key_value_heads=kv, **PAPER_1B), T)
    assert base["cross_layer"] == 0
    assert dense["cross_layer"] == sum((i + 1) * T * d for i in range(1, L + 1)) == 152 * T * d
    assert res["cross_layer"] == 3 * T * kv * D * (L - 1)
    for parts in (dense, res):  # everything else is LLaMA's
        assert {k: v for k, v in parts.items() if k != "cross_layer"} == {
            k: v for k, v in base.items() if k != "cross_layer"
        }
    llama_flops = forward_flops(config_for("lime", routing="none", num_key_value_heads=kv, **PAPER_1B), T)
    dense_flops = forward_flops(config_for("denseformer", num_key_value_heads=kv, **PAPER_1B), T)
    assert 0 < dense_flops / llama_flops - 1 < 0.001  # a DWA is element-wise: far below LIMe's +0.08 %


# ------------------------------------------------------------------ lime-model train --arch


@pytest.mark.parametrize("arch", BASELINES)
def test_train_arch_through_the_cli(tmp_path, text, arch):
    out = tmp_path / "run"
    assert main(train_args(out, text, "--arch", arch)) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["routing"] == "none"
    assert json.loads((out / "recipe.json").read_text())["model"]["arch"] == arch
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(
        model,
        {
            "denseformer": DenseFormerForCausalLM,
            "resformer": ResFormerForCausalLM,
            "hyperconnections": HyperConnectionsForCausalLM,
        }[arch],
    )
    L = config["num_hidden_layers"]
    rows_per_layer = 2 if arch == "hyperconnections" else 1  # HC: one row per sub-layer
    weights = next(iter(model.model.mixing_weights().values()))
    assert weights.shape[0] == rows_per_layer * L


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["--arch", "nope"],
            "'model.arch' must be one of lime, denseformer, resformer, hyperconnections, got 'nope'",
        ),
        (["--arch", "resformer", "--routing", "full"], "takes no LIMe routing"),
        (
            ["--arch", "denseformer", "--set", "model.value_mix=fixed"],
            "unknown recipe key(s): model.value_mix",
        ),
    ],
)
def test_bad_arch_is_one_line_error(tmp_path, text, capsys, extra, needle):
    out = tmp_path / "run"
    assert main(train_args(out, text, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lime-model: error: ") and needle in err, err
    assert not out.exists()


# ------------------------------------------------------------------ probes: adapters, router heatmaps, CLI
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints of LLaMA, LIMe and each baseline, the baselines' mixing weights moved off init."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for arch in ("llama", "lime", *BASELINES):
        path = save_tiny_checkpoint(root / arch, arch)
        if arch in BASELINES:
            model = AutoModelForCausalLM.from_pretrained(path)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".dwa." in name or "value_mix" in name:
                        p.add_(0.3 * torch.randn_like(p))
            model.save_pretrained(path)
        out[arch] = path
    return out


def test_resformer_mixed_values_site(ckpts):
    """``mixed_values`` = lambda_1 * values[0] + lambda_2 * values[n] (values[0] itself in layer 0)."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract

    model, tok = load(ckpts["resformer"])
    acts = extract(model, tok, CORPUS[:3], sites=["values", "mixed_values"], progress=False)
    torch.testing.assert_close(acts["mixed_values"][0], acts["values"][0])
    weights = safetensors.torch.load_file(ckpts["resformer"] / "model.safetensors")
    lam = weights["model.layers.1.self_attn.value_mix.weight"]
    want = lam[0] * acts["values"][0] + lam[1] * acts["values"][1]
    torch.testing.assert_close(acts["mixed_values"][1], want, atol=1e-5, rtol=1e-5)


def run_probe(capsys, *argv):
    from lime_probe import cli

    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.slow
def test_router_draws_every_mixing_weight_next_to_lime(capsys, tmp_path, ckpts):
    labels = ["LIMe", "LLaMA", "DenseFormer", "ResFormer", "HyperConnections"]
    argv = [
        a
        for arch, lb in zip(("lime", "llama", *BASELINES), labels, strict=True)
        for a in ("--ckpt", ckpts[arch], "--label", lb)
    ]
    stdout = run_probe(capsys, "router", *argv, "--out", tmp_path / "o")
    assert (
        all(w in stdout for w in ("LIMe", "DenseFormer", "ResFormer", "DWA weights"))
        and "LLaMA" not in stdout
    )
    doc = json.loads((tmp_path / "o" / "router.json").read_text())
    assert set(doc["routers"]) == {"LIMe"} and set(doc["mixing_weights"]) == {
        "DenseFormer",
        "ResFormer",
        "HyperConnections",
    }

    dense = safetensors.torch.load_file(ckpts["denseformer"] / "model.safetensors")
    alpha = doc["mixing_weights"]["DenseFormer"]["DWA weights"]  # [L, L+1], None (NaN) where unused
    for i, row in enumerate(alpha):
        w = dense[f"model.layers.{i}.dwa.weight"]
        assert row[: i + 2] == pytest.approx(w.tolist()) and all(x is None for x in row[i + 2 :])
    res = safetensors.torch.load_file(ckpts["resformer"] / "model.safetensors")
    lam = doc["mixing_weights"]["ResFormer"]["value residual lambdas"]
    assert lam[0] == [None, None] and lam[1] == pytest.approx(
        res["model.layers.1.self_attn.value_mix.weight"].tolist()
    )

    figures = {f.stem for f in (tmp_path / "o").glob("*.png")}
    assert {
        "mixing_DenseFormer_DWA_weights",
        "mixing_ResFormer_value_residual_lambdas",
        "router_LIMe",
    } <= figures
    rows = json.loads((tmp_path / "o" / "router_mixing_weights.json").read_text())["rows"]
    L = len(alpha)
    per_model = {
        m: sum(r["model"] == m for r in rows) for m in ("DenseFormer", "ResFormer", "HyperConnections")
    }
    n = 4  # HC expansion rate; A_m, A_r^T and B per sub-layer, 2 sub-layers per block
    # one row per learned weight, NaN cells left out
    assert per_model == {
        "DenseFormer": L * (L + 3) // 2,
        "ResFormer": 2 * (L - 1),
        "HyperConnections": 2 * L * (n + n * n + n),
    }


@pytest.mark.slow  # 8-14 s each under load: five models
@pytest.mark.parametrize(
    ("command", "extra"), [("entropy", ["--unit", "documents"]), ("separability", ["--allow-small-samples"])]
)
def test_probes_compare_lime_llama_and_baselines(capsys, tmp_path, ckpts, command, extra):
    data = tmp_path / "t.txt"
    data.write_text("\n\n".join(CORPUS * 3) + "\n")
    argv = [a for arch in ("lime", "llama", *BASELINES) for a in ("--ckpt", ckpts[arch])]
    run_probe(
        capsys,
        command,
        *argv,
        "--data",
        data,
        "--site",
        "values",
        "--max-length",
        32,
        "--out",
        tmp_path / "o",
        "--no-cache",
        *extra,
    )
    doc = json.loads((tmp_path / "o" / f"{command}_values.json").read_text())
    assert {r["model"] for r in doc["rows"]} == {"lime", "llama", *BASELINES}
