"""``recompute_routed_kv``: attention's saved routed K/V are recomputed in backward from the K/V buffer.

Checked against the same model without the option (an independent path: attention keeps its
inputs): identical loss and gradient bits, the recomputation really runs, and what the forward leaves
allocated for backward (the profiler's record of the CPU allocator) drops by the routed keys' and
values' bytes, computed from their shapes.
"""

from functools import partial

import pytest
import torch
from helpers import routed_specs
from torch.profiler import ProfilerActivity, profile

from lime_model import LimeConfig, LimeForCausalLM, parse_routing
from lime_model.router import LimeRouter

SIZES = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4)
STATIC = [spec for spec in routed_specs() if not parse_routing(spec).input_dependent]


def pair(routing: str, attn: str = "sdpa", kv: int = 2) -> tuple[LimeForCausalLM, LimeForCausalLM]:
    """The same random weights without and with the option, in training mode."""
    models = []
    for recompute in (False, True):
        torch.manual_seed(0)
        cfg = LimeConfig(routing=routing, num_key_value_heads=kv, recompute_routed_kv=recompute, **SIZES)
        cfg._attn_implementation = attn
        models.append(LimeForCausalLM(cfg).train())
    return models[0], models[1]


def step(model: LimeForCausalLM, ids: torch.Tensor, dtype=None) -> tuple[torch.Tensor, dict]:
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(ids, labels=ids, use_cache=False).loss  # as lime_model.train calls it
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def rereads(monkeypatch) -> list[int]:
    """The layers whose routed K/V were recomputed, one entry per recomputed tensor."""
    calls, reread = [], LimeRouter.reread

    def spy(self, buffer, hidden_states, which):
        calls.append(self.layer_idx)
        return reread(self, buffer, hidden_states, which)

    monkeypatch.setattr(LimeRouter, "reread", spy)
    return calls


@pytest.mark.parametrize("routing", STATIC)
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_gradients_keep_their_bits(routing, kv, rereads):
    plain, recomputing = pair(routing, kv=kv)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    loss_a, grads_a = step(plain, ids)
    assert not rereads  # the option is off by default
    loss_b, grads_b = step(recomputing, ids)
    # keys and values of every layer, recomputed once each (SDPA saves both)
    assert sorted(rereads) == sorted(2 * list(range(SIZES["num_hidden_layers"])))
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name


def test_bits_under_bf16_autocast(rereads):
    """Also a regression test: backward's reads mixed fp32 weights into bf16 gradients (a dtype error)."""
    plain, recomputing = pair("full")
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    loss_a, grads_a = step(plain, ids, torch.bfloat16)
    loss_b, grads_b = step(recomputing, ids, torch.bfloat16)
    assert rereads and torch.equal(loss_a, loss_b)
    assert all(torch.equal(g, grads_b[n]) for n, g in grads_a.items())


def recipes(loss: torch.Tensor) -> int:
    """The number of saved tensors the graph of ``loss`` holds as recipes (``_raw_saved_*`` whose
    packed form is not a tensor)."""
    count, seen, stack = 0, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_raw_saved_"):
                saved = getattr(node, name)
                for item in saved if isinstance(saved, list) else [saved]:
                    data = getattr(item, "data", None)  # the packed form, not unpacked
                    count += data is not None and not isinstance(data, torch.Tensor)
        stack += [fn for fn, _ in node.next_functions]
    return count


def held(forward) -> tuple[torch.Tensor, int]:
    """``forward()``'s result and the bytes the CPU allocator still holds for it when it returns
    (everything backward may read), from the profiler's record of allocations and frees."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward()
    events = prof.profiler.kineto_results.events()
    return out, sum(e.nbytes() for e in events if e.name() == "[memory]")


@pytest.mark.parametrize(
    "attn, dtype, kv",
    [("eager", None, 4), ("sdpa", None, 4), ("sdpa", torch.bfloat16, 4), ("sdpa", torch.bfloat16, 2)],
    ids=["eager", "sdpa", "sdpa-bf16", "sdpa-bf16-gqa"],
)
def test_routed_kv_are_not_kept_for_backward(attn, dtype, kv):
    """With SDPA, what the forward leaves allocated for backward is two routed K/V-sized tensors per
    layer less (recipes instead), computed from the shapes, under bf16 autocast too. Regressions: RoPE's
    fp32 cos/sin once made attention save a bf16 copy of the keys, which no recipe matched; and the
    recipes once kept each layer's fp32 attention input alive, which under autocast nothing else keeps
    (the projections keep a bf16 copy), so the option cost memory. Eager attention saves views of the
    routed K/V, which are kept as usual."""
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))

    def forward(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            return model(ids, labels=ids).loss

    (loss_a, bytes_a), (loss_b, bytes_b) = (held(partial(forward, m)) for m in pair("full", attn, kv=kv))
    layers, head_dim = SIZES["num_hidden_layers"], SIZES["hidden_size"] // SIZES["num_attention_heads"]
    routed = 2 * kv * 12 * head_dim * (2 if dtype else 4)  # one (B, kv, T, head_dim) tensor, bf16 or fp32
    assert recipes(loss_a) == 0
    if attn == "sdpa":
        assert recipes(loss_b) == 2 * layers
        assert bytes_a - bytes_b == 2 * layers * routed
    else:
        assert (recipes(loss_b), bytes_b) == (0, bytes_a)


def test_dynamic_routing_and_cached_forwards_are_left_alone(rereads):
    plain, recomputing = pair("dynamic")
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    loss_a, grads_a = step(plain, ids)
    loss_b, grads_b = step(recomputing, ids)
    assert not rereads and torch.equal(loss_a, loss_b)
    assert all(torch.equal(g, grads_b[n]) for n, g in grads_a.items())
    # with a cache the saved K/V include earlier positions: no recipe may stand in for them (a
    # model in training mode turns the cache off; in eval mode gradients still flow)
    plain, recomputing = pair("full")
    for model in (plain.eval(), recomputing.eval()):
        out = model(ids[:, :6], use_cache=True)
        model(ids[:, 6:], cache=out.cache, labels=ids[:, 6:]).loss.backward()
    assert not rereads
    assert all(
        torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), recomputing.parameters(), strict=True)
    )


def test_the_option_is_saved_with_the_config(tmp_path):
    _, model = pair("full")
    model.save_pretrained(tmp_path)
    assert LimeForCausalLM.from_pretrained(tmp_path).config.recompute_routed_kv is True


@pytest.mark.parametrize("bad", ["false", "yes", 1])
def test_the_option_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="recompute_routed_kv must be true or false"):
        LimeConfig(recompute_routed_kv=bad)
