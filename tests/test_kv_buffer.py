"""The buffered routed read (``lime_model.kv_buffer``) against the mixing formula written with
``torch.stack`` and ``einsum``, values and gradients, for every read mode and source pattern."""

import pytest
import torch

from lime_model import kv_buffer, kv_kernels, kv_read
from lime_model.kv_buffer import KVBuffer
from lime_model.kv_read import routed_read

B, T, KV, HD, L = 2, 3, 2, 4, 4


def reference_mix(coef: torch.Tensor, raws: list[torch.Tensor]) -> torch.Tensor:
    """``out[b, h, t, e] = sum_{p, h'} C[m, h, p, h', e] raw_p[b, t, h', e]`` with ``m = b * T + t``;
    ``coef [n, kv, S, kv, F]`` (n in {1, B*T}, F in {1, HD}), ``raws`` each ``(B, T, kv * HD)``."""
    src = torch.stack([r.view(B, T, KV, HD) for r in raws], 2)  # (B, T, S, kv, HD)
    c = coef.expand(B * T, -1, -1, -1, HD).reshape(B, T, KV, len(raws), KV, HD)
    return torch.einsum("btkpje,btpje->bkte", c, src)


def chain(
    sources,
    modes,
    coefs,
    base_k,
    base_v,
    buffered: bool,
    buffer: KVBuffer | None = None,
    defer=False,
    cut=None,
):
    """L layers; layer l's raw K/V = base + tanh(layer l-1's routed K/V), so that backward visits the
    layers in reverse as in the model, except after layer ``cut``, whose routed K/V feed nothing.
    ``coefs[l]`` None = own heads only; ``buffered``: through ``routed_read``, else the formula;
    ``defer``: the matrix weights' gradients computed by their sources' backward
    (``KVBuffer.defer_weight_grads``, as the model asks). Returns every routed K/V."""
    buffer = buffer or KVBuffer(L, KV, HD)
    weights = [None if c is None else weight_in(c, modes[layer]) for layer, c in enumerate(coefs)]
    if defer:
        buffer.defer_weight_grads({layer: w for layer, w in enumerate(weights) if w is not None})
    outs, raw_k, raw_v = [], [], []
    for layer in range(L):
        k, v = base_k[layer], base_v[layer]
        if outs and layer - 1 != cut:
            k = k + torch.tanh(outs[-1][0]).transpose(1, 2).reshape(B, T, KV * HD)
            v = v + torch.tanh(outs[-1][1]).transpose(1, 2).reshape(B, T, KV * HD)
        raw_k.append(k)
        raw_v.append(v)
        c = coefs[layer]
        if buffered:
            outs.append(routed_read(buffer, layer, k, v, weights[layer], sources[layer], modes[layer]))
        else:
            if c is None:
                c = torch.eye(KV, dtype=k.dtype).view(1, KV, 1, KV, 1)
            ks = [raw_k[j] for j in sources[layer]]
            vs = [raw_v[j] for j in sources[layer]]
            outs.append((reference_mix(c, ks), reference_mix(c, vs)))
    return outs


def weight_in(coef: torch.Tensor, mode: str) -> torch.Tensor:
    """Coefficients ``[n, kv, S, kv, F]`` as ``routed_read``'s ``mode`` weight."""
    n, kv, S, _, F = coef.shape
    return coef.reshape(
        {"matrix": (kv, S * kv), "per-dim": (kv, S * kv, F), "per-position": (n, kv, S * kv)}[mode]
    )


SOURCES = {
    "full": [list(range(i + 1)) for i in range(L)],
    "first-1": [[0]] + [[0, i] for i in range(1, L)],
    "last-2": [list(range(max(0, i - 1), i + 1)) for i in range(L)],
    "dilated-back-2": [list(range(i, -1, -2))[::-1] for i in range(L)],  # gaps among readers
}


def make_coefs(sources, kind: str, dtype=torch.float64):
    coefs = [None]  # layer 0 reads only itself
    for i in range(1, L):
        S = len(sources[i])
        n = B * T if kind == "per-position" else 1
        F = HD if kind == "per-dim" else 1
        coefs.append(torch.randn(n, KV, S, KV, F, dtype=dtype))
    return coefs


CASES = [
    ("full", "matrix"),
    ("first-1", "matrix"),
    ("dilated-back-2", "matrix"),
    ("full", "per-dim"),
    ("last-2", "per-dim"),
    ("full", "per-position"),
    ("last-2", "per-position"),
]  # per-dim and per-position read contiguous source ranges (the only ones their routers use)


def layer_modes(kind: str) -> list[str]:
    """Every layer reads in its router's mode, layer 0 (own heads only) included: it fixes the layout."""
    return [kind] * L


@pytest.fixture(params=["CPU pieces", "a GEMM per layer", "two layers per GEMM", "one GEMM per range"])
def heads_per_gemm(request, monkeypatch):
    """CPU reads sum GEMMs over pieces of the sources, from a buffer stored in chunks of a piece's
    layers; at these sizes the default piece holds every source, so also check pieces of one layer
    each, pieces of two (runs such as layers 1..2 then cross a chunk boundary), and the one-GEMM path
    of other devices."""
    if request.param == "a GEMM per layer":
        monkeypatch.setattr(kv_buffer, "CPU_HEADS_PER_GEMM", KV)
    elif request.param == "two layers per GEMM":
        monkeypatch.setattr(kv_buffer, "CPU_HEADS_PER_GEMM", 2 * KV)
    elif request.param == "one GEMM per range":
        monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    return request.param


@pytest.mark.parametrize(("pattern", "kind"), CASES)
@pytest.mark.parametrize("loss_layer", [L - 1, 1])
def test_values_and_gradients_match_the_formula(pattern, kind, loss_layer, heads_per_gemm):
    """loss_layer < L - 1: the later layers' backward never runs, yet they were registered as readers."""
    check_against_formula(pattern, kind, loss_layer)


@pytest.mark.parametrize(("pattern", "kind"), CASES)
@pytest.mark.parametrize("loss_layer", [L - 1, 1])
@pytest.mark.parametrize("gpu_path", [False, True], ids=["CPU", "one GEMM per range"])
def test_compiled_read_matches_the_formula(pattern, kind, loss_layer, gpu_path, monkeypatch):
    """What ``torch.compile`` runs (``routed_read``'s compiled path: the graph's buffer, one chunk, and
    the operators, here through AOT autograd's traced graphs run as ATen ops), and its backward state
    is released; "one GEMM per range" is what a GPU runs (the kept gradients in one buffer)."""
    if gpu_path:
        monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    check_against_formula(pattern, kind, loss_layer, backend="aot_eager")
    assert not kv_read._BACKWARD


MATRIX_PATTERNS = ["full", "first-1", "dilated-back-2"]


@pytest.fixture(params=["two GEMMs per run of readers", "Triton's kernel, interpreted"])
def source_backward(request, monkeypatch):
    """Deferred weight gradients off the CPU (its one-buffer path, here on the CPU), computed by the
    torch GEMMs or by the Triton kernel in Triton's interpreter (``lime_model.kv_kernels``)."""
    monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    monkeypatch.setattr(kv_kernels, "_FAILED", set())  # no earlier test's failure carries over
    if request.param.startswith("Triton"):
        request.getfixturevalue("triton_interpreter")
    calls = []
    original = kv_kernels.source_backward
    monkeypatch.setattr(kv_buffer, "source_backward", lambda *a: calls.append(a) or original(*a))
    yield calls
    assert not kv_kernels._FAILED, "the kernel fell back to the GEMMs: the test did not run it"


@pytest.mark.parametrize("pattern", MATRIX_PATTERNS)
@pytest.mark.parametrize("loss_layer", [L - 1, 1])
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_deferred_weight_gradients_match_the_formula(pattern, loss_layer, backend, source_backward):
    """Each reader's weight gradient summed by its sources' backward and returned by layer 0's read:
    every leaf's gradient equals the formula's, through the fused pass (one call per source layer
    and keys or values), and no backward state is left."""
    check_against_formula(pattern, "matrix", loss_layer, backend=backend, defer=True)
    # a compiled backward runs every layer's, on zero gradients past the loss's
    assert len(source_backward) == 2 * (L if backend else loss_layer + 1)
    # readers ascending, so consecutive ones are one launch (the compiled backward, which records them
    # from the last layer down, launched once per reader)
    assert all(call[1] == sorted(call[1]) for call in source_backward)
    assert not kv_read._BACKWARD


@pytest.mark.parametrize("skip", [0, 1])
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize("defer", [False, True], ids=["readers", "deferred"])
def test_a_read_whose_output_reaches_no_loss_still_passes_on_its_readers_gradients(
    skip, backend, defer, monkeypatch
):
    """Layer ``skip``'s routed K/V reach no loss (as when an intervention replaces them), yet later
    layers read its raw K/V: their gradients, and the deferred weight gradients its backward sums or
    returns, still reach its raw K/V and the weights (its read's link makes autograd run its backward)."""
    if defer:
        monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    check_against_formula("full", "matrix", L - 1, backend=backend, defer=defer, skip=skip)


def test_deferred_weight_gradients_are_not_computed_twice(monkeypatch):
    """A deferred reader's own backward reads no source for its weight gradient."""
    monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    monkeypatch.setattr(kv_buffer, "_weight_grad", lambda *a: pytest.fail("a reader's weight gradient"))
    check_against_formula("full", "matrix", L - 1, defer=True)


def test_weight_gradients_are_deferred_only_off_the_cpu_and_with_gradients_on():
    weight = {1: torch.randn(KV, 2 * KV, requires_grad=True)}
    buffer = KVBuffer(L, KV, HD)
    buffer.defer_weight_grads(weight)  # the CPU's pieces keep each gradient on its own
    assert not buffer.deferred
    with torch.no_grad():
        buffer.defer_weight_grads(weight)
    assert not buffer.deferred


@pytest.mark.parametrize("kind", ["matrix", "per-dim", "per-position"])
def test_the_operators_run_eagerly_under_autograd(kind):
    """Dynamo's ``eager`` backend runs the operators themselves under autograd, which checks that no
    tensor saved for backward was written since: the buffer is, by later layers, in blocks that the
    earlier layers' backward does not read."""
    check_against_formula("full", kind, L - 1, backend="eager")
    assert not kv_read._BACKWARD


def check_against_formula(
    pattern: str, kind: str, loss_layer: int, backend: str | None = None, defer: bool = False, skip=None
) -> None:
    """Routed K/V and the gradients of every leaf through the buffered read (eager, or compiled with
    ``backend``; ``defer``: ``chain``'s) equal the formula's (float64); the loss reads every layer's
    routed K/V up to ``loss_layer`` but layer ``skip``'s, which feed nothing (``chain``'s ``cut``)."""
    torch.manual_seed(0)
    sources, modes = SOURCES[pattern], layer_modes(kind)
    coefs = [c if c is None else c.requires_grad_() for c in make_coefs(sources, kind)]
    base_k = [torch.randn(B, T, KV * HD, dtype=torch.float64, requires_grad=True) for _ in range(L)]
    base_v = [torch.randn(B, T, KV * HD, dtype=torch.float64, requires_grad=True) for _ in range(L)]
    leaves = [c for c in coefs if c is not None] + base_k + base_v
    # every layer runs forward; the loss reads only up to loss_layer
    torch._dynamo.reset()
    buffered = torch.compile(chain, backend=backend, fullgraph=True) if backend else chain
    got = buffered(sources, modes, coefs, base_k, base_v, buffered=True, defer=defer, cut=skip)
    want = chain(sources, modes, coefs, base_k, base_v, buffered=False, cut=skip)
    probes = [
        (torch.randn(B, KV, T, HD, dtype=torch.float64), torch.randn(B, KV, T, HD, dtype=torch.float64))
        for _ in range(loss_layer + 1)
    ]
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        torch.testing.assert_close(gk, wk)
        torch.testing.assert_close(gv, wv)

    def loss(outs):
        return sum(
            (k * pk).sum() + (v * pv).sum()
            for layer, ((k, v), (pk, pv)) in enumerate(zip(outs[: loss_layer + 1], probes, strict=True))
            if layer != skip
        )

    grads = torch.autograd.grad(loss(got), leaves, allow_unused=True)
    ref = torch.autograd.grad(loss(want), leaves, allow_unused=True)
    for i, (g, r) in enumerate(zip(grads, ref, strict=True)):
        if r is None:
            assert g is None or not g.any(), i
        else:
            torch.testing.assert_close(g, r, msg=f"leaf {i}")


@pytest.mark.parametrize(
    ("pattern", "kind"), [("dilated-back-2", "matrix"), ("last-2", "per-dim"), ("full", "per-position")]
)
def test_gradcheck(pattern, kind, heads_per_gemm):
    """Finite differences in double precision through the custom backward."""
    torch.manual_seed(1)
    sources, modes = SOURCES[pattern], layer_modes(kind)
    coefs = make_coefs(sources, kind)
    base = [torch.randn(B, T, KV * HD, dtype=torch.float64) for _ in range(2 * L)]
    inputs = [c.requires_grad_() for c in coefs if c is not None] + [b.requires_grad_() for b in base]

    def fn(*args):
        cs = [None, *args[: L - 1]]
        outs = chain(
            sources, modes, cs, list(args[L - 1 : 2 * L - 1]), list(args[2 * L - 1 :]), buffered=True
        )
        return torch.cat([torch.cat([k.flatten(), v.flatten()]) for k, v in outs])

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize(("pattern", "kind"), CASES)
def test_backward_releases_every_kept_gradient(pattern, kind, heads_per_gemm):
    """Each reader's routed-K/V gradient is kept only until its lowest source has read it, so none
    outlives the backward pass (and a retained graph's next backward starts from none), nor the buffer
    that holds them off the CPU."""
    torch.manual_seed(0)
    sources = SOURCES[pattern]
    coefs = make_coefs(sources, kind)
    base = [torch.randn(B, T, KV * HD, dtype=torch.float64, requires_grad=True) for _ in range(2 * L)]
    buffer = KVBuffer(L, KV, HD)
    outs = chain(sources, layer_modes(kind), coefs, base[:L], base[L:], buffered=True, buffer=buffer)
    sum(k.sum() + v.sum() for k, v in outs).backward()
    assert all(g is None for store in buffer.grad_out for g in store)
    assert buffer.grad_data is None


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_pieces_cut_runs_at_the_buffer_chunk_boundaries(step):
    """Each piece lies in one chunk (layers j with the same j // step), and together they tile the run."""
    for first in range(7):
        for stop in range(first + 1, 9):
            cut = kv_buffer.pieces(first, stop, step)
            assert [layer for a, b in cut for layer in range(a, b)] == list(range(first, stop))
            assert all((b - 1) // step == a // step for a, b in cut)
            assert len(cut) == len({layer // step for layer in range(first, stop)})


@pytest.mark.parametrize("mode", ["matrix", "per-dim"])
def test_cpu_buffer_chunks_hold_one_piece_of_layers_each(mode, monkeypatch):
    monkeypatch.setattr(kv_buffer, "CPU_HEADS_PER_GEMM", 2 * KV)
    buffer = KVBuffer(5, KV, HD)
    x = torch.randn(B, T, KV * HD)
    routed_read(buffer, 0, x, x, None, [0], mode)
    assert [[c.shape[0] for c in chunks] for chunks in buffer.data] == [[2 * KV, 2 * KV, KV]] * 2


def test_per_dim_weight_gradient_copies_no_feature_slices_of_a_strided_incoming_gradient():
    """CPU SDPA hands routed K/V gradients back in its own ``(B, T, kv, hd)`` memory; per-dim's weight
    gradient (a GEMM per feature) reads the kept contiguous copies, so it copies no feature's
    ``[kv, B*T]`` slice (before, a stack step copied 2272). Large enough that ``bmm`` leaves its naive path."""
    from torch.profiler import ProfilerActivity, profile

    b, t, layers = 4, 16, 2
    torch.manual_seed(0)
    raw = [torch.randn(b, t, KV * HD, requires_grad=True) for _ in range(2 * layers)]
    weight = torch.randn(KV, layers * KV, HD, requires_grad=True)
    buffer = KVBuffer(layers, KV, HD)
    routed_read(buffer, 0, raw[0], raw[2], None, [0], "per-dim")
    k, v = routed_read(buffer, 1, raw[1], raw[3], weight, [0, 1], "per-dim")
    sdpa_layout = [torch.randn(b, t, KV, HD).transpose(1, 2) for _ in range(2)]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.autograd.backward([k, v], sdpa_layout)
    copies = [e for e in prof.events() if e.name == "aten::copy_" and e.input_shapes[0] == [KV, b * t]]
    assert weight.grad is not None and raw[1].grad is not None
    assert not copies, f"{len(copies)} feature slices copied"


def test_a_copy_of_the_module_registers_operators_of_its_own(tmp_path, monkeypatch):
    """A checkpoint's copy of the read's modules (remote code, maybe of another version, in a package)
    is imported beside these: under its own module name, or with other source, it registers its own
    operators; the same sources under the same name again (transformers re-importing them) reuse them,
    where a second registration would raise."""
    import importlib
    import sys
    from pathlib import Path

    folder = Path(kv_read.__file__).parent
    sources = {name: (folder / name).read_text() for name in ("kv_buffer.py", "kv_kernels.py", "kv_read.py")}

    def imported(changed: str = ""):
        root = tmp_path / f"{len(list(tmp_path.iterdir()))}"
        (root / "remote").mkdir(parents=True)
        (root / "remote" / "__init__.py").write_text("")
        for name, text in sources.items():
            (root / "remote" / name).write_text(text + ("\n# another version\n" if name == changed else ""))
        for name in [m for m in sys.modules if m.split(".")[0] == "remote"]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(root))
        return importlib.import_module("remote.kv_read")

    copy, again = imported(), imported()
    others = [imported(name) for name in sources]  # any of the three changed: the operators are others
    assert len({kv_read._LIB, copy._LIB, *(other._LIB for other in others)}) == 5
    assert again is not copy and again._LIB == copy._LIB and again.READ is copy.READ
