"""A source layer's fused routed-read backward (``lime_model.kv_kernels``) against the sums written as
loops, for the torch GEMMs and the Triton kernel (run on the CPU by Triton's interpreter), and a model
whose sources compute its routers' weight gradients against the same model on the CPU's path."""

import pytest
import torch
from helpers import tiny_model

from lime_model import kv_buffer, kv_kernels


@pytest.fixture(params=["torch", "triton"])
def implementation(request, monkeypatch):
    """``torch``: two GEMMs per run of readers; ``triton``: the kernel, interpreted on the CPU."""
    monkeypatch.setattr(kv_kernels, "_FAILED", set())  # no earlier test's failure carries over
    if request.param == "triton":
        request.getfixturevalue("triton_interpreter")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kv_kernels.kernel_available(torch.device("cpu")) == (request.param == "triton")
    yield request.param
    assert not kv_kernels._FAILED, "the kernel fell back to the GEMMs: the test did not run it"


def loop_reference(kept, readers, columns, source, head_dim):
    """The two sums of the module docstring, one product at a time, in float64."""
    kv, N = source.shape
    grad = torch.zeros(kv, N, dtype=torch.float64)
    weight_grads = torch.zeros(len(readers), kv, kv, dtype=torch.float64)
    for i, r in enumerate(readers):
        for h in range(kv):
            g = kept[r * kv + h].double()
            for h2 in range(kv):
                grad[h2] += columns[i, h, h2].double() * g
                weight_grads[i, h, h2] = (g * source[h2].double()).sum()
    positions = N // head_dim
    return grad.view(kv, positions, head_dim).transpose(0, 1).reshape(positions, kv * head_dim), weight_grads


@pytest.mark.parametrize(
    ("kv", "head_dim", "positions", "layers", "readers"),
    [
        (2, 4, 6, 4, [0, 1, 3]),  # a gap among the readers; kv padded to tl.dot's 16
        (8, 16, 40, 5, [1, 2, 3, 4]),  # GQA's kv at the 1B shape; N = 640, five column tiles
        (3, 8, 17, 3, [2]),  # one reader (itself); kv not a power of two; a partial last tile
        (32, 8, 5, 3, [0, 2]),  # MHA's kv at the 1B shape
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("programs", [kv_kernels.MAX_PROGRAMS, 2])
def test_source_backward_equals_the_loops(
    kv, head_dim, positions, layers, readers, dtype, programs, implementation, monkeypatch
):
    """``programs=2``: each program loops over several column tiles and sums its weight gradients."""
    monkeypatch.setattr(kv_kernels, "MAX_PROGRAMS", programs)
    monkeypatch.setattr(kv_kernels, "TILE_ELEMENTS", 1024)
    torch.manual_seed(0)
    N = positions * head_dim
    kept = torch.randn(layers * kv, N, dtype=dtype)
    columns = torch.randn(len(readers), kv, kv, dtype=dtype)
    source = torch.randn(kv, N, dtype=dtype)
    grad, weight_grads = kv_kernels.source_backward(kept, readers, columns, source, head_dim)
    want_grad, want_weight_grads = loop_reference(kept, readers, columns, source, head_dim)
    assert grad.dtype == dtype and weight_grads.dtype == torch.promote_types(dtype, torch.float32)
    # float32: sums of up to 640 products of unit size, rounded in another order than the loops'
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(grad.double(), want_grad, **tolerance)
    torch.testing.assert_close(weight_grads.double(), want_weight_grads, **tolerance)


@pytest.mark.parametrize("routing", ["full", "first-2", "no-head-mix"])
def test_a_model_whose_sources_compute_its_weight_gradients(routing, implementation, monkeypatch):
    """Off the CPU (its one-buffer path, forced here) a LIMe model's static routers have their weight
    gradients computed by their sources' backward, in one pass per source (the Triton kernel on a GPU,
    here interpreted): the loss's gradients equal the CPU path's, where each reader's backward
    computes its own. ``no-head-mix``'s weight is computed from its parameter, not a view of it."""
    torch.manual_seed(0)
    model = tiny_model("lime", routing=routing, num_hidden_layers=4).double().train()
    ids = torch.randint(5, model.config.vocab_size, (2, 12))

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    want = gradients()  # the CPU's path: each reader's backward computes its weight's gradient
    monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    calls = []
    monkeypatch.setattr(
        kv_buffer, "source_backward", lambda *a: calls.append(a) or kv_kernels.source_backward(*a)
    )
    got = gradients()
    assert len(calls) == 2 * model.config.num_hidden_layers  # keys and values, per source layer
    assert got.keys() == want.keys() and any("router" in name for name in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_a_kernel_that_fails_falls_back_to_the_gemms_once_with_a_warning(monkeypatch, triton_interpreter):
    """A kernel that does not build or launch on some GPU (resources, an old Triton) costs the GEMMs'
    speed, not the training: one warning naming the device and the error, and no further attempts."""
    monkeypatch.setattr(kv_kernels, "_FAILED", set())
    attempts = []

    def broken(*args):
        attempts.append(args)
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(kv_kernels, "_triton_backward", broken)
    torch.manual_seed(0)
    kept, columns, source = torch.randn(6, 32), torch.randn(2, 2, 2), torch.randn(2, 32)
    with pytest.warns(RuntimeWarning, match="failed on cpu .*out of resources: shared memory"):
        grad, weight_grads = kv_kernels.source_backward(kept, [0, 2], columns, source, 4)
    want = loop_reference(kept, [0, 2], columns, source, 4)
    torch.testing.assert_close(grad.double(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight_grads.double(), want[1], rtol=1e-5, atol=1e-5)
    kv_kernels.source_backward(kept, [0, 2], columns, source, 4)
    assert len(attempts) == 1 and not kv_kernels.kernel_available(torch.device("cpu"))


def test_a_model_defers_only_weights_already_on_its_device():
    """The weights are gathered before layer 0 runs: an offloaded layer's (on another device until its
    own forward) cannot be, so then none is deferred."""
    model = tiny_model("lime", routing="full", num_hidden_layers=4)
    assert sorted(model.model.deferred_weights(torch.device("cpu"))) == [1, 2, 3]
    assert model.model.deferred_weights(torch.device("meta")) == {}


def test_a_cpu_training_step_looks_at_no_weight_for_deferral(monkeypatch):
    """On the CPU nothing is deferred, so the forward does not gather the routers' weights at all."""
    model = tiny_model("lime", routing="full", num_hidden_layers=3).train()
    monkeypatch.setattr(type(model.model), "deferred_weights", lambda *a: pytest.fail("gathered"))
    ids = torch.randint(5, model.config.vocab_size, (1, 6))
    model(input_ids=ids, labels=ids).loss.backward()
