"""``torch.compile`` of LIMe on the CPU: one graph per routing variant, and the compiled logits and
gradients equal eager ones (the compiled model reads through `traced_read`, eager through the custom
autograd function of `lime_model.kv_buffer`, so each checks the other). The traced read also runs
eagerly against the custom one for every routing kind, GQA and MHA, and in generation with a cache."""

import pytest
import torch
from helpers import routed_specs

import lime_model.router
from lime_model import LimeConfig, LimeForCausalLM
from lime_model.kv_buffer import traced_read

VARIANTS = ["none", *routed_specs()]  # every routing kind with a router, and LLaMA


def one_per_router() -> list[str]:
    """The first routed spec of each router class (the reads differ by router; the source sets only change
    which layers are read, which the graph test covers for every kind)."""
    from lime_model.routing import ROUTINGS

    first: dict[type, str] = {}
    for spec in routed_specs():
        first.setdefault(ROUTINGS[spec if spec in ROUTINGS else spec.rsplit("-", 1)[0]].router, spec)
    return list(first.values())


SIZES = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# fp32: the two reads sum the sources in different orders (an einsum against GEMMs over buffer pieces),
# so gradients differ by rounding: measured up to 2.1e-5 absolute on entries up to ~10 (aot_eager and
# inductor alike, full / per-dim / dynamic); logits up to 1.2e-7.
ATOL, RTOL = 5e-5, 1e-4


def make(routing: str, layers: int = 4, kv_heads: int = 2) -> LimeForCausalLM:
    torch.manual_seed(0)
    sizes = {**SIZES, "num_hidden_layers": layers, "num_key_value_heads": kv_heads}
    model = LimeForCausalLM(LimeConfig(routing=routing, **sizes)).train()
    with torch.no_grad():  # non-trivial norms and routers, so nothing hides behind the identity init
        for name, p in model.named_parameters():
            if "norm" in name or ".router." in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def logits_and_grads(model, forward, ids, target):
    logits = forward(ids, use_cache=False).logits
    return logits, torch.autograd.grad((logits * target).sum(), list(model.parameters()))


def check_equal(routing: str, backend: str, layers: int = 4) -> None:
    model = make(routing, layers)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    compiled = logits_and_grads(model, torch.compile(model, backend=backend, fullgraph=True), ids, target)
    eager_logits, eager_grads = logits_and_grads(model, model, ids, target)
    torch.testing.assert_close(compiled[0], eager_logits, atol=ATOL, rtol=RTOL)
    for g, e in zip(compiled[1], eager_grads, strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("routing", VARIANTS)
def test_one_graph_and_no_graph_break(routing):
    """Dynamo's own account: before the traced read, each routed layer broke the graph (the custom
    function's backward mutates the buffer, which Dynamo refuses), 19-21 breaks at 4 layers."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(make(routing))(torch.randint(0, 50, (2, 6)), use_cache=False)
    assert [b.reason for b in explained.break_reasons] == []
    assert explained.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("routing", one_per_router())
def test_compiled_logits_and_gradients_equal_eager(routing):
    """``aot_eager``: Dynamo and AOT autograd's traced forward and backward graphs, run as ATen ops, one
    routing kind per router class (each takes 25-40 s on 2 cores)."""
    check_equal(routing, "aot_eager")


@pytest.mark.slow
def test_inductor_on_the_cpu_equals_eager():
    """Inductor's generated C++ (needs a C++ compiler; minutes on 2 cores, so one variant, 3 layers)."""
    check_equal("full", "inductor", layers=3)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["GQA", "MHA"])
@pytest.mark.parametrize("routing", routed_specs())
def test_traced_read_equals_the_custom_read_in_training_and_generation(routing, kv_heads, monkeypatch):
    """Eagerly, the model reading through `traced_read` (what the compiler traces: keys and values mixed
    in one contraction) gives the custom read's logits and parameter gradients, and in ``generate`` with
    a cache (one new position per step, the buffer covering only it) the same tokens and scores."""
    model = make(routing, kv_heads=kv_heads)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(2))

    def run():
        logits, grads = logits_and_grads(model, model, ids, target)
        model.eval()
        out = model.generate(
            ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        model.train()
        return logits, grads, out.sequences, torch.stack(out.logits)

    custom = run()
    monkeypatch.setattr(lime_model.router, "routed_read", traced_read)
    traced = run()
    torch.testing.assert_close(traced[0], custom[0], atol=ATOL, rtol=RTOL)
    for g, e in zip(traced[1], custom[1], strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
    assert torch.equal(traced[2], custom[2])
    torch.testing.assert_close(traced[3], custom[3], atol=ATOL, rtol=RTOL)
