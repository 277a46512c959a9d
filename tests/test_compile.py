"""``torch.compile`` of LIMe on the CPU: one graph per routing variant, the compiled logits, gradients
and cached generation equal eager ones (compiled, `lime_model.kv_read.routed_read` runs custom
operators, whose values and gradients `tests/test_kv_buffer.py` checks against the mixing formula),
and the compiled step keeps no per-layer copy of a layer's sources."""

import pytest
import torch
from helpers import bench_script, routed_specs

import lime_model.kv_buffer
from lime_model import LimeConfig, LimeForCausalLM

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
    """Dynamo's own account: before the custom operators, each routed layer broke the graph (the custom
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
@pytest.mark.parametrize("gpu_path", [False, True], ids=["CPU pieces", "one GEMM per range"])
@pytest.mark.parametrize("routing", one_per_router())
def test_inductor_on_the_cpu_equals_eager(routing, gpu_path, monkeypatch):
    """Inductor's generated C++ (needs a C++ compiler), 3 layers; the custom operators' outputs must
    have the strides their fake kernels promise, which Inductor (unlike ``aot_eager``) relies on.
    "one GEMM per range" takes the reads a GPU takes (the kept gradients in one buffer)."""
    if gpu_path:
        monkeypatch.setattr(lime_model.kv_buffer, "gemm_pieces", lambda device: False)
    check_equal(routing, "inductor", layers=3)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["GQA", "MHA"])
@pytest.mark.parametrize("routing", one_per_router())
def test_compiled_generation_with_a_cache_equals_eager(routing, kv_heads):
    """``generate`` with a cache through the compiled forward (one new position per step, the graph's
    buffer covering only it) gives eager's tokens and scores."""
    model = make(routing, kv_heads=kv_heads).eval()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))

    def run():
        out = model.generate(
            ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        return out.sequences, torch.stack(out.logits)

    eager = run()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    compiled = run()
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], atol=ATOL, rtol=RTOL)


def test_the_compiled_step_keeps_no_concatenated_sources():
    """What the compiled forward saves for backward: the routed reads add the buffer (every layer's raw
    keys and values once) and nothing else to LLaMA's saved tensors, not a concatenation of a layer's
    sources per layer (O(L^2)). Counted from AOT autograd's partitioned graphs (no C++ compiler)."""
    saved_for_backward = bench_script("compiled_memory").saved_for_backward
    saved = {}
    for routing in ("none", "full"):
        model = make(routing, layers=6)
        saved[routing] = saved_for_backward(model, torch.randint(0, 50, (2, 6)))
    kv_heads, head_dim = SIZES["num_key_value_heads"], SIZES["hidden_size"] // SIZES["num_attention_heads"]
    buffer = 2 * 6 * kv_heads * 2 * 6 * head_dim * 4  # keys and values, 6 layers, 2 x 6 positions, fp32
    # (the routing weights are parameters: inputs of the graph, saved as they are)
    assert saved["full"] - saved["none"] == buffer
