"""LIMe model tests against independent computations (transformers' LLaMA, a loop over Eq. 4)."""

import gc
import json
import math
import weakref

import pytest
import torch
from helpers import routed_specs
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import lime_model
from lime_model import LimeConfig, LimeForCausalLM, RoutingSpec, forward_flops, kv_buffer, parse_routing
from lime_model.routing import ROUTINGS

VARIANTS = routed_specs()  # one spec per routing kind with routers
SIZES = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4)


def make(routing: str, kv: int = 2, seed: int = 0, **kw) -> LimeForCausalLM:
    torch.manual_seed(seed)
    cfg = LimeConfig(routing=routing, num_key_value_heads=kv, **{**SIZES, **kw})
    model = LimeForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and dynamic routers, so nothing hides behind init
        for name, p in model.named_parameters():
            if "norm" in name or ".router." in name and routing == "dynamic":
                p.add_(0.1 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------- reference: Eq. 4 as a loop
def documented_coef(router, x, h, p, h2):
    """Coefficient of head h2 of source p in routed head h from ``router.coefficients`` (any variant),
    broadcastable to (B, T, head_dim)."""
    c = router.coefficients(x)  # [n, kv, S, kv, F]
    return c[0, h, p, h2] if c.shape[0] == 1 else c[:, h, p, h2].view(*x.shape[:2], -1)


def appendix_e_coef(router, x, h, p, h2):
    """Appendix E written out per position: offset + (query of head h from x_t) . (key of source p, head h2)."""
    kv, D = router.num_kv_heads, router.head_dim
    B, T, _ = x.shape
    key = router.keys[p * kv + h2]
    per_token = []
    for b in range(B):
        for t in range(T):
            query = router.query[h * D : (h + 1) * D] @ x[b, t]
            per_token.append(router.weight[h, p * kv + h2] + sum(query[r] * key[r] for r in range(D)))
    return torch.stack(per_token).view(B, T, 1)


def rope(x, cos, sin):  # x (B, T, n, D); cos/sin (1, T, D)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def reference_logits(
    model: LimeForCausalLM, ids: torch.Tensor, coef=documented_coef, replaced: int | None = None
) -> torch.Tensor:
    """Eq. 4 as a loop; ``replaced``: that layer's routed K/V are 0.5 everywhere (an intervention)."""
    cfg = model.config
    H, kv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    B, T = ids.shape
    h = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(h, torch.arange(T)[None])
    raw_k, raw_v = [], []
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(B, T, H, D)
        raw_k.append(attn.k_proj(x).view(B, T, kv, D))
        raw_v.append(attn.v_proj(x).view(B, T, kv, D))
        if attn.router is None:
            k, v = raw_k[i], raw_v[i]
        else:
            ks, vs = [], []
            for head in range(kv):
                kh = vh = 0
                for p, j in enumerate(attn.router.sources):
                    for h2 in range(kv):
                        c = coef(attn.router, x, head, p, h2) if len(attn.router.sources) > 1 else h2 == head
                        kh = kh + c * raw_k[j][:, :, h2]
                        vh = vh + c * raw_v[j][:, :, h2]
                ks.append(kh)
                vs.append(vh)
            k, v = torch.stack(ks, 2), torch.stack(vs, 2)
        if i == replaced:
            k, v = torch.full_like(k, 0.5), torch.full_like(v, 0.5)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = k.repeat_interleave(H // kv, 2), v.repeat_interleave(H // kv, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, T, H * D)
        h = h + attn.o_proj(out)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


def assert_forward_and_gradients_match(model, ref_fn):
    ids = torch.randint(0, 50, (2, 7))
    logits = model(ids).logits
    ref = ref_fn(model, ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)

    target = torch.randn_like(logits)
    grads = torch.autograd.grad((logits * target).sum(), list(model.parameters()))
    ref_grads = torch.autograd.grad((ref * target).sum(), list(model.parameters()), allow_unused=True)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(
            g, r if r is not None else torch.zeros_like(g), atol=1e-5, rtol=1e-4, msg=name
        )


@pytest.mark.parametrize("routing", ["none", *VARIANTS])
@pytest.mark.parametrize("kv", [2, 4])
def test_forward_and_gradients_match_eq4_loop(routing, kv):
    """The buffered routed read computes exactly the mix that the router's coefficients describe."""
    assert_forward_and_gradients_match(make(routing, kv=kv), reference_logits)


@pytest.mark.parametrize("kv", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: ~8 s under load
def test_dynamic_routing_matches_appendix_e_loop(kv):
    model = make("dynamic", kv=kv)
    assert_forward_and_gradients_match(model, lambda m, ids: reference_logits(m, ids, appendix_e_coef))


def definition(router, kind: str, x, h: int, p: int, h2: int) -> torch.Tensor:
    """Each variant's coefficient written from its definition (routing.py's table), per (h, p, h2)."""
    S, kv = len(router.sources), router.num_kv_heads
    if kind == "average":
        return torch.tensor([(h == h2) / S]).view(1, 1)
    if kind == "no-head-mix":
        return (router.weight[h, p] * (h == h2)).view(1, 1)
    if kind == "per-dim":
        return router.weight[h, p * kv + h2].view(1, -1)
    if kind == "dynamic":
        return appendix_e_coef(router, x, h, p, h2).view(-1, 1)
    return router.weight[h, p * kv + h2].view(1, 1)


@pytest.mark.parametrize("routing", VARIANTS)
def test_coefficients_follow_each_variants_definition(routing):
    model = make(routing, kv=2)
    kind = parse_routing(routing).kind
    x = torch.randn(2, 3, SIZES["hidden_size"])
    for i, layer in enumerate(model.model.layers):
        router = layer.self_attn.router
        S = len(router.sources)
        c = router.coefficients(x).detach()
        n = 6 if router.input_dependent and S > 1 else 1
        F = router.head_dim if kind == "per-dim" and S > 1 else 1
        assert c.shape == (n, 2, S, 2, F), (i, c.shape)
        for h in range(2):
            for p in range(S):
                for h2 in range(2):
                    want = (
                        definition(router, kind, x, h, p, h2).detach()
                        if S > 1
                        else torch.tensor([[float(h == h2)]])
                    )
                    torch.testing.assert_close(c[:, h, p, h2], want.expand(n, F), msg=f"{i} {h} {p} {h2}")


@pytest.mark.parametrize("kv", [2, 4])
def test_routing_none_equals_transformers_llama(kv):
    torch.manual_seed(1)
    llama = LlamaForCausalLM(LlamaConfig(num_key_value_heads=kv, **SIZES)).eval()
    lime = LimeForCausalLM(LimeConfig(routing="none", num_key_value_heads=kv, **SIZES)).eval()
    lime.load_state_dict(llama.state_dict(), strict=True)
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding goes through the same masking code
    torch.testing.assert_close(lime(ids, attention_mask=mask).logits, llama(ids, attention_mask=mask).logits)
    assert lime(ids, labels=ids).loss.item() == pytest.approx(llama(ids, labels=ids).loss.item(), abs=1e-6)


@pytest.mark.parametrize("routing", VARIANTS)
def test_identity_routers_equal_llama(routing):
    """Routers set to read only their own heads (every other weight zero) give LLaMA."""
    lime = make(routing)
    if not any(".router." in name for name, _ in lime.named_parameters()):
        pytest.skip(f"{routing} has fixed weights")
    llama = LimeForCausalLM(LimeConfig(routing="none", num_key_value_heads=2, **SIZES)).eval()
    llama.load_state_dict({k: v for k, v in lime.state_dict().items() if ".router." not in k})
    with torch.no_grad():
        for layer in lime.model.layers:
            router = layer.self_attn.router
            if router.weight is None:
                continue
            for p in router.parameters():
                p.zero_()
            if routing == "no-head-mix":  # [kv, S]: weight 1 on the own layer
                router.weight[:, -1] = 1.0
            else:
                router.weight[:, -2:][torch.arange(2), torch.arange(2)] = 1.0
    ids = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(lime(ids).logits, llama(ids).logits)


@pytest.mark.parametrize("kv", [1, 2])
def test_initial_dynamic_model_equals_llama(kv):
    """Freshly built (no edits), the dynamic router reads exactly the own heads: the model is LLaMA."""
    torch.manual_seed(3)
    lime = LimeForCausalLM(LimeConfig(routing="dynamic", num_key_value_heads=kv, **SIZES)).eval()
    llama = LimeForCausalLM(LimeConfig(routing="none", num_key_value_heads=kv, **SIZES)).eval()
    llama.load_state_dict({k: v for k, v in lime.state_dict().items() if ".router." not in k})
    ids = torch.randint(0, 50, (2, 8))
    assert torch.equal(lime(ids).logits, llama(ids).logits)
    # and learning starts: the keys get a gradient at the first step
    lime(ids).logits.square().mean().backward()
    assert all(layer.self_attn.router.keys.grad.abs().sum() > 0 for layer in lime.model.layers[1:])


def test_gradients_reach_routers_and_earlier_kv_projections():
    model = make("full")
    model.train()
    ids = torch.randint(0, 50, (2, 8))
    # a loss that depends on the first layer's K/V only through later layers' routers
    last = model.model.layers[-1].self_attn
    seen = {}
    last.router.register_forward_hook(lambda m, i, o: seen.setdefault("kv", o))
    model(ids)
    (seen["kv"][0].sum() + seen["kv"][1].sum()).backward()
    assert last.router.weight.grad.abs().sum() > 0
    for layer in model.model.layers:
        assert layer.self_attn.k_proj.weight.grad.abs().sum() > 0
        assert layer.self_attn.v_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("routing", VARIANTS)
def test_second_backward_over_retained_graph_doubles_gradients(routing):
    model = make(routing)
    loss = model(torch.randint(0, 50, (2, 6))).logits.square().mean()
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], msg=n)


@pytest.mark.parametrize("routing", VARIANTS)
@pytest.mark.parametrize("gpu_path", [False, True], ids=["CPU", "one buffer"])
def test_a_training_step_frees_its_kv_buffer_without_the_cycle_collector(routing, gpu_path, monkeypatch):
    """Nothing of a step may outlive it through reference cycles (dynamic routing's per-position
    weights once kept every step's graph alive until Python's cycle collector ran); "one buffer" is the
    path a GPU takes (kept gradients in one buffer, the sources computing static weights' gradients)."""
    if gpu_path:
        monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    model = make(routing)
    buffers = []
    model.model.layers[1].self_attn.router.register_forward_pre_hook(
        lambda module, args: buffers.append(weakref.ref(args[0]))
    )
    gc.disable()
    try:
        model(torch.randint(0, 50, (2, 6))).logits.square().mean().backward()
        assert buffers and buffers[0]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("routing", VARIANTS)
def test_routed_heads_reach_attention_with_unit_stride_features(routing):
    """Given feature-strided K/V, SDPA on the CPU takes its math path, which is slower and keeps every
    layer's attention matrix for backward (per-dim's feature-major buffer once did this)."""
    model, strides = make(routing), []
    for layer in model.model.layers:
        layer.self_attn.router.register_forward_hook(
            lambda module, args, out: strides.extend(t.stride(-1) for t in out)
        )
    model(torch.randint(0, 50, (2, 6)), use_cache=False)
    assert strides == [1] * 2 * SIZES["num_hidden_layers"]


def test_router_layout_and_init():
    model = make("full", kv=4)
    layers = model.model.layers
    assert list(layers[0].self_attn.router.parameters()) == []
    for i in range(1, 4):
        w = layers[i].self_attn.router.weight
        assert w.shape == (4, (i + 1) * 4)
        torch.testing.assert_close(w[:, -4:].detach(), torch.eye(4))
        bound = math.sqrt(3 / ((i + 1) * 4))
        assert w[:, :-4].abs().max() <= bound
    names = [n for n, _ in model.named_parameters() if "router" in n]
    assert names == [f"model.layers.{i}.self_attn.router.weight" for i in range(1, 4)]


def paper_dilated(d: int, i: int) -> list[int]:
    """App. F/G: layer i reads the layers at multiples of d counted from layer 0 (below i), and itself."""
    return sorted({j for j in range(i) if j % d == 0} | {i})


def counted_back(d: int, i: int) -> list[int]:
    """Project variant dilated-back-d: own layer and every d-th below it."""
    return sorted(j for j in range(i + 1) if (i - j) % d == 0)


@pytest.mark.parametrize("d", [1, 2, 3, 8, 16])
def test_dilated_is_the_papers_set(d):
    for i in range(130):
        assert parse_routing(f"dilated-{d}").sources(i) == paper_dilated(d, i)
        assert parse_routing(f"dilated-back-{d}").sources(i) == counted_back(d, i)
    # at 128 layers with d = 8 every layer reads layer 0, which counting back would miss for 7 in 8 layers
    assert all(parse_routing("dilated-8").sources(i)[0] == 0 for i in range(128))


SOURCE_SETS = [  # (spec, layer, its sources), from each kind's definition in routing.py's table
    ("full", 3, [0, 1, 2, 3]),
    ("average", 2, [0, 1, 2]),
    ("first-2", 5, [0, 1, 5]),
    ("first-2", 1, [0, 1]),
    ("first-4", 0, [0]),
    ("last-3", 5, [3, 4, 5]),
    ("last-3", 1, [0, 1]),
    ("dilated-2", 5, [0, 2, 4, 5]),
    ("dilated-3", 7, [0, 3, 6, 7]),
    ("dilated-8", 7, [0, 7]),
    ("dilated-8", 16, [0, 8, 16]),
    ("dilated-8", 0, [0]),
    ("dilated-back-2", 5, [1, 3, 5]),
    ("dilated-back-8", 7, [7]),
    ("no-head-mix", 2, [0, 1, 2]),
    ("per-dim", 1, [0, 1]),
    ("dynamic", 3, [0, 1, 2, 3]),
    ("none", 3, [3]),
]


@pytest.mark.parametrize(("spec", "layer", "expected"), SOURCE_SETS)
def test_source_sets(spec, layer, expected):
    assert parse_routing(spec).sources(layer) == expected


def test_every_routing_kind_has_source_sets_above():
    assert {parse_routing(spec).kind for spec, _, _ in SOURCE_SETS} == set(ROUTINGS)


def test_router_shapes_follow_source_sets():
    model = make("dilated-2", num_hidden_layers=6)
    for i, layer in enumerate(model.model.layers):
        router = layer.self_attn.router
        assert router.sources == parse_routing("dilated-2").sources(i)
        if len(router.sources) > 1:
            assert router.weight.shape == (2, 2 * len(router.sources))
    assert make("no-head-mix").model.layers[3].self_attn.router.weight.shape == (2, 4)
    assert make("per-dim").model.layers[2].self_attn.router.weight.shape == (2, 6, 8)
    assert list(make("average").model.layers[3].self_attn.router.parameters()) == []
    dynamic = make("dynamic").model.layers[2].self_attn.router  # S = 3 sources, kv = 2, head_dim = 8
    shapes = {n: tuple(p.shape) for n, p in dynamic.named_parameters()}
    assert shapes == {"weight": (2, 6), "query": (2 * 8, 32), "keys": (6, 8)}


@pytest.mark.parametrize(
    "bad", ["fulll", "first-0", "last-", "dilated-x", "first2", "", "per dim", "dilated-back", "full-2"]
)
def test_bad_routing_specs_are_rejected(bad):
    with pytest.raises(ValueError, match="routing spec"):
        LimeConfig(routing=bad)


def test_routing_is_parsed_once_where_it_is_set(tmp_path, monkeypatch):
    """The config parses ``routing`` when it is set; the model, its routers, the K/V buffer and the FLOP
    count read that parse (no RoutingSpec is made after it); it is saved as its string only."""
    made, init = [], RoutingSpec.__init__
    monkeypatch.setattr(RoutingSpec, "__init__", lambda self, *a: made.append(a) or init(self, *a))
    config = LimeConfig(routing=" Last-2 ", num_key_value_heads=2, **SIZES)
    model = LimeForCausalLM(config)
    model(torch.randint(0, 50, (2, 5))).logits.sum().backward()
    forward_flops(config, 5)
    assert made == [("last", 2)]
    assert (config.routing, config.routing_spec) == ("last-2", RoutingSpec("last", 2))
    assert [layer.self_attn.router.sources for layer in model.model.layers] == [[0], [0, 1], [1, 2], [2, 3]]
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["routing"] == "last-2" and "routing_spec" not in saved
    loaded = LimeConfig.from_pretrained(tmp_path, routing="dynamic")  # an override is set after __init__
    assert (loaded.routing, loaded.routing_spec) == ("dynamic", RoutingSpec("dynamic"))
    loaded.routing = "none"
    assert not loaded.routing_spec.enabled
    with pytest.raises(ValueError, match="routing spec"):
        loaded.routing = "sideways"
    with pytest.raises(AttributeError, match="set routing"):
        loaded.routing_spec = RoutingSpec("full")
    assert loaded.routing == "none"


def test_head_counts_must_divide():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        LimeConfig(num_attention_heads=4, num_key_value_heads=3)


@pytest.mark.parametrize("routing", ["none", *VARIANTS])
def test_greedy_generation_with_cache_equals_without(routing):
    model = make(routing)
    prompt = torch.randint(3, 50, (2, 5))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without)
    # and both equal a manual greedy loop with full recomputation
    seq = prompt
    for _ in range(8):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(with_cache, seq)


def test_left_padded_batch_matches_unpadded_rows():
    model = make("full")
    a, b = torch.randint(3, 50, (1, 6)), torch.randint(3, 50, (1, 4))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 2, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0], model(a).logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 2:], model(b).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("routing", ["none", *VARIANTS])
def test_save_load_round_trip_through_auto_classes(tmp_path, routing):
    model = make(routing)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "lime"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, LimeForCausalLM)
    assert loaded.config.routing == routing
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    ids = torch.randint(0, 50, (2, 6))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_tied_embeddings_are_shared():
    model = make("full", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_param_groups_keep_routers_norms_out_of_decay():
    model = make("full")
    groups = {
        g["name"]: g for g in lime_model.param_groups(model, weight_decay=0.1, router_lr_mult=10.0, lr=1e-3)
    }
    ids = lambda g: {id(p) for p in g["params"]}  # noqa: E731
    routers = {id(p) for n, p in model.named_parameters() if ".router." in n}
    norms = {id(p) for n, p in model.named_parameters() if "norm" in n or "embed_tokens" in n}
    assert ids(groups["router"]) == routers
    assert ids(groups["no_decay"]) == norms
    assert groups["router"]["weight_decay"] == 0 and groups["router"]["lr"] == pytest.approx(1e-2)
    assert groups["decay"]["weight_decay"] == 0.1
    total = sum(len(g["params"]) for g in groups.values())
    assert total == len(list(model.parameters()))


@pytest.mark.parametrize("gpu_path", [False, True], ids=["CPU", "one buffer"])
def test_gradients_reach_a_layer_whose_routed_kv_a_hook_replaced(gpu_path, monkeypatch):
    """A forward hook replaces layer 0's routed K/V (an intervention): later layers still read its raw
    K/V, so every gradient, its ``k_proj``'s and the routers' weights' included, is the Eq. 4 loop's
    with the same replacement."""
    if gpu_path:
        monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    model = make("full")
    model.model.layers[0].self_attn.router.register_forward_hook(
        lambda module, args, out: tuple(torch.full_like(t, 0.5) for t in out)
    )
    assert_forward_and_gradients_match(model, lambda m, ids: reference_logits(m, ids, replaced=0))
