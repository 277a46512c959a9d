"""Router analysis against a plain loop over the routers' documented coefficients, on real tiny LIMe models.

Each variant's coefficients against its own definition are checked in test_modeling.py.
"""

import numpy as np
import pytest
import torch
from helpers import routed_specs

import lime_model
from lime_probe.probes.router_weights import router_weights

KV = 2
VARIANTS = routed_specs()


def tiny_lime(routing: str, layers: int = 4, seed: int = 0) -> lime_model.LimeForCausalLM:
    torch.manual_seed(seed)
    config = lime_model.LimeConfig(
        routing=routing,
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=KV,
        max_position_embeddings=64,
    )
    model = lime_model.LimeForCausalLM(config).eval()
    with torch.no_grad():  # trained-looking weights: no exact identity blocks, non-zero dynamic keys
        for name, p in model.named_parameters():
            if ".router." in name:
                p.normal_(std=0.3 if name.endswith(("query", "keys")) else 1.0)
    return model


def coefficient(model, i: int, h: int, p: int, h2: int, token_x=None) -> float:
    """Mean over positions and features of |coefficient of head h2 of source p in routed head h|, read
    element by element from the router's documented [n, kv, S, kv, F] coefficients."""
    router = model.model.layers[i].self_attn.router
    c = router.coefficients(token_x)
    vals = [abs(float(v)) for m in range(c.shape[0]) for v in c[m, h, p, h2]]
    return sum(vals) / len(vals)


@torch.no_grad()
def reference(model, router_inputs=None):
    L = model.config.num_hidden_layers
    per_layer = np.full((L, L), np.nan)
    per_head = np.full((L, KV, L), np.nan)
    for i in range(L):
        src = model.model.layers[i].self_attn.router.sources
        x = None if router_inputs is None else router_inputs[i]
        c = [
            [[coefficient(model, i, h, p, h2, x) for h2 in range(KV)] for p in range(len(src))]
            for h in range(KV)
        ]
        total = sum(c[h][p][h2] for h in range(KV) for p in range(len(src)) for h2 in range(KV))
        for p, j in enumerate(src):
            per_layer[i, j] = sum(c[h][p][h2] for h in range(KV) for h2 in range(KV)) / total
            for h in range(KV):
                per_head[i, h, j] = sum(c[h][p]) / sum(sum(c[h][q]) for q in range(len(src)))
    return per_layer, per_head


def capture_router_inputs(model, ids):
    """Hand-written forward hooks: the hidden_states argument each router really receives."""
    seen = {}
    hooks = [
        layer.self_attn.router.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, args[1].reshape(-1, args[1].shape[-1]).detach())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    return seen, out.hidden_states


@pytest.mark.parametrize("routing", VARIANTS)
def test_matches_documented_layout(routing):
    model = tiny_lime(routing)
    hidden = None
    router_inputs = None
    if lime_model.parse_routing(routing).input_dependent:
        ids = torch.randint(0, 40, (2, 5))
        router_inputs, hs = capture_router_inputs(model, ids)
        hidden = {i: hs[i].reshape(-1, hs[i].shape[-1]) for i in range(model.config.num_hidden_layers)}
    res = router_weights(model, hidden_states=hidden)
    want_layer, want_head = reference(model, router_inputs)
    np.testing.assert_allclose(res.per_layer, want_layer, rtol=1e-5, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(res.per_head, want_head, rtol=1e-5, atol=1e-6, equal_nan=True)
    L = model.config.num_hidden_layers
    assert res.per_layer.shape == (L, L) and res.per_head.shape == (L, KV, L)
    np.testing.assert_allclose(np.nansum(res.per_layer, axis=1), 1.0, atol=1e-9)
    np.testing.assert_allclose(np.nansum(res.per_head, axis=2), 1.0, atol=1e-9)
    assert np.isnan(res.per_layer[np.triu_indices(L, 1)]).all()
    assert res.sources == [model.model.layers[i].self_attn.router.sources for i in range(L)]
    assert res.routing == routing


def test_known_answers():
    # layer 0 reads only itself; "average" is uniform over its sources.
    res = router_weights(tiny_lime("average", layers=3))
    np.testing.assert_allclose(res.per_layer[0], [1.0, np.nan, np.nan], equal_nan=True)
    np.testing.assert_allclose(res.per_layer[2], [1 / 3] * 3)
    # dilated-2 at layer 3 reads layers 0, 2 and 3 only (dilated-back-2: 1 and 3).
    res = router_weights(tiny_lime("dilated-2"))
    assert res.sources[3] == [0, 2, 3]
    assert np.isnan(res.per_layer[3, 1])
    res = router_weights(tiny_lime("dilated-back-2"))
    assert res.sources[3] == [1, 3]
    assert np.isnan(res.per_layer[3, [0, 2]]).all()
    # A router that is the identity on its own heads puts all mass on its own layer.
    model = tiny_lime("full", layers=2)
    with torch.no_grad():
        model.model.layers[1].self_attn.router.weight.copy_(
            torch.cat([torch.zeros(KV, KV), torch.eye(KV)], 1)
        )
    np.testing.assert_allclose(router_weights(model).per_layer[1], [0.0, 1.0])


def test_a_new_variant_is_one_router_class(monkeypatch):
    """A toy variant (first and own layer, negated static weights), declared by its router class alone,
    works end to end: model, FLOPs, analysis."""
    from lime_model import routing
    from lime_model.flops import flops_breakdown
    from lime_model.router import LimeRouter

    monkeypatch.setattr(routing, "ROUTINGS", dict(routing.ROUTINGS))  # the toy kind joins a copy

    class NegatedRouter(LimeRouter):
        routes = {"toy": lambda i, n: sorted({0, i})}

        def coefficients(self, hidden_states=None):
            return super().coefficients(hidden_states) * (-1 if self.weight is not None else 1)

    assert routing.ROUTINGS["toy"].router is NegatedRouter
    model = tiny_lime("toy")
    assert [r.self_attn.router.sources for r in model.model.layers] == [[0], [0, 1], [0, 2], [0, 3]]
    res = router_weights(model)
    np.testing.assert_allclose(res.per_layer, reference(model)[0], rtol=1e-5, atol=1e-6, equal_nan=True)
    flops = flops_breakdown(model.config, 5)["router"]
    assert flops == 3 * 2 * 5 * KV * 2 * KV * model.config.head_dim  # 3 routed layers, 2 sources each
    # the forward pass mixes with the negated weights, written out per routed head
    from lime_model.kv_buffer import KVBuffer

    router, D = model.model.layers[1].self_attn.router, model.config.head_dim
    k0, v0, k1, v1 = (torch.randn(1, 5, KV * D) for _ in range(4))
    buffer = KVBuffer(4, KV, D)
    buffer.write(0, k0, v0, None, [0], "matrix")
    with torch.no_grad():
        routed_k, _ = router(buffer, torch.zeros(1, 5, 32), k1, v1)
    w = router.weight.detach().view(KV, 2, KV)
    heads = [k0.view(1, 5, KV, D), k1.view(1, 5, KV, D)]
    for h in range(KV):
        want = -sum(w[h, p, g] * heads[p][0, :, g] for p in range(2) for g in range(KV))
        torch.testing.assert_close(routed_k[0, h], want)


def test_bad_input():
    with pytest.raises(ValueError, match="routing='none'"):
        router_weights(tiny_lime("none"))
    with pytest.raises(ValueError, match="dynamic.*hidden_states"):
        router_weights(tiny_lime("dynamic"))
    with pytest.raises(ValueError, match="no entry for layer"):
        router_weights(tiny_lime("dynamic", layers=3), hidden_states={0: torch.randn(3, 32)})
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=20,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match="not a LIMe model"):
        router_weights(llama)


def test_nnsight_wrapped_model():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from lime_probe.extraction.loading import wrap

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
        unk_token="[UNK]",
        pad_token="[UNK]",
    )
    model = tiny_lime("last-2", layers=3)
    wrapped = router_weights(wrap(model, tok))
    np.testing.assert_array_equal(wrapped.per_layer, router_weights(model).per_layer)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from lime_model import train as T

    arith = {"operators": [1], "train_per_tier": 16, "test_per_tier": 4}
    out = tmp_path_factory.mktemp("router") / "run"
    return T.train("arithmetic", out, progress=False, steps=2, batch_size=8, micro_batch_size=8, seq_len=24,
                   warmup_steps=1, seed=3, arithmetic=arith)  # fmt: skip


def test_the_rebuilt_step_0_equals_a_freshly_built_model_with_the_runs_seed(trained_run):
    from transformers import AutoModelForCausalLM

    from lime_model.recipes import load_recipe
    from lime_model.tokenization import load_tokenizer
    from lime_model.train import model_config
    from lime_probe.probes.router_weights import initial_weights, router_weights, run_seed, step0_model

    trained = lime_model.LimeForCausalLM.from_pretrained(trained_run).eval()
    assert run_seed(trained_run) == 3
    rebuilt = step0_model(trained, 3).state_dict()
    config = model_config(load_recipe(str(trained_run / "recipe.json")), load_tokenizer(str(trained_run)))

    def fresh(seed):
        torch.manual_seed(seed)  # as lime-model train does right before building its model
        return AutoModelForCausalLM.from_config(config).eval()

    same, other = fresh(3).state_dict(), fresh(4).state_dict()
    assert rebuilt.keys() == same.keys()
    for name, w in rebuilt.items():
        assert torch.equal(w, same[name]), name
    routers = [n for n in rebuilt if ".router." in n]
    assert routers and any(not torch.equal(rebuilt[n], other[n]) for n in routers)  # the seed matters
    assert any(not torch.equal(rebuilt[n], trained.state_dict()[n]) for n in routers)  # training moved them
    init, what = initial_weights(trained, trained_run)
    assert what == "step 0, rebuilt from the run's seed 3"
    np.testing.assert_array_equal(init.per_layer, router_weights(fresh(3)).per_layer)


def test_without_a_run_folder_the_initial_map_is_the_inits_expected_map():
    from lime_probe.probes.router_weights import initial_weights

    L = 4
    init, what = initial_weights(tiny_lime("full", layers=L), source=None)
    assert what.startswith("expected step 0 of the init")
    for i in range(1, L):
        # identity on the own heads (sum kv per layer), |U(-b, b)| of mean b / 2 on each of kv*kv others
        S = i + 1
        b = (3.0 / (S * KV)) ** 0.5
        others = KV * KV * b / 2
        total = KV + (S - 1) * others
        np.testing.assert_allclose(init.per_layer[i, :i], others / total, rtol=0.08)
        assert init.per_layer[i, i] == pytest.approx(KV / total, rel=0.08)
        assert np.isnan(init.per_layer[i, S:]).all()


# --------------------------------------------------------------------------- mixing another model's values

STATIC = [v for v in VARIANTS if not v.startswith("dynamic")]


@pytest.mark.parametrize("routing", STATIC)
def test_mixing_a_models_own_values_by_its_router_gives_its_routed_values(routing):
    """The mixing null's formula against the model itself: its raw W_V outputs mixed by its routers are
    exactly what its heads read (the routed values the K/V buffer computes in the forward pass)."""
    from helpers import tiny_tokenizer

    import lime_probe
    from lime_probe.probes.router_weights import mix_by_router

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_lime(routing)
    model.resize_token_embeddings(len(tok))
    acts = lime_probe.extract(
        model, tok, ["the cat sat on the mat", "a dog ran"], sites=["values", "routed_values"]
    )
    mixed = mix_by_router(model, {i: acts["values"][i] for i in acts.layers("values")})
    for i in acts.layers("routed_values"):
        torch.testing.assert_close(mixed[i], acts["routed_values"][i].float(), rtol=1e-5, atol=1e-6)


def test_mixing_another_models_values_is_the_plain_sum_over_sources_and_heads():
    """A loop over tokens, heads, sources and features, written from the formula."""
    from lime_probe.probes.router_weights import mix_by_router

    model = tiny_lime("full", layers=3)
    kv, hd = KV, model.config.head_dim
    g = torch.Generator().manual_seed(1)
    values = {i: torch.randn(5, kv * hd, generator=g) for i in range(3)}
    mixed = mix_by_router(model, values)
    for i in range(3):
        router = model.model.layers[i].self_attn.router
        C = router.coefficients(None).detach()[0]
        for n in range(5):
            for h in range(kv):
                for e in range(hd):
                    want = sum(
                        float(C[h, p, q, 0 if C.shape[-1] == 1 else e]) * float(values[j][n, q * hd + e])
                        for p, j in enumerate(router.sources)
                        for q in range(kv)
                    )
                    assert float(mixed[i][n, h * hd + e]) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_mixing_refuses_input_dependent_routers_and_wrong_widths():
    from lime_probe.probes.router_weights import mix_by_router

    dynamic = [v for v in VARIANTS if v.startswith("dynamic")][0]
    with pytest.raises(ValueError, match="input-dependent"):
        mix_by_router(tiny_lime(dynamic), {i: torch.zeros(2, 16) for i in range(4)})
    with pytest.raises(ValueError, match="features per token"):
        mix_by_router(tiny_lime("full"), {i: torch.zeros(2, 7) for i in range(4)})
    with pytest.raises(ValueError, match="missing"):
        mix_by_router(tiny_lime("full"), {0: torch.zeros(2, 16)})
    with pytest.raises(
        ValueError, match=r"values of layers \[4\] given; the routers mix a model of 4 layers"
    ):
        mix_by_router(tiny_lime("full"), {i: torch.zeros(2, 16) for i in range(5)})
