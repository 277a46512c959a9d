"""Extraction in the model's own dtype and the entropy on a chosen device, checked on the CPU.

A bfloat16 model is extracted in bfloat16 (rows selected and pooled where the model runs, moved to the
host and held there in its dtype, read as float32) and compared with the float32 extraction of the same
weights; the
entropy's device path (batches moved to ``device`` in their own dtype, float64 there) against the host
path and an independent NumPy computation. The pinned, non-blocking copies of a CUDA model on its copy
stream need a GPU: here `to_host` and `wait_for` run their host branch.
"""

import copy
import math

import numpy as np
import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from lime_probe.extraction.forward import kept_positions, select_rows
from lime_probe.extraction.tracing import extract
from lime_probe.extraction.transfer import all_finite, copies_landed, to_host, wait_for
from lime_probe.probes.entropy import layer_entropy, stream_entropy

TEXTS = [
    "The cat is on the mat and the dogs are in the garden.",
    "It was",
    "She was happy because the results were good.",
    "Layers are functions.",
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("arch", ["llama", "lime"])
def test_bf16_extraction_equals_fp32_extraction_of_the_bf16_weights(tok, arch):
    """Same weights (the bf16 model's, widened to float32 for the reference): every site's rows and
    pooled means agree within bfloat16's precision (8 bits: a relative error of 2^-8 per operation,
    ~1e-2 after a few layers), and both come back as float32."""
    bf16 = tiny_model(arch, tok).to(torch.bfloat16)
    fp32 = copy.deepcopy(bf16).float()
    sites = ["hidden", "values"] + (["routed_values"] if arch == "lime" else [])
    for pool in ("none", "mean"):
        low = extract(bf16, tok, TEXTS, sites=sites, pool=pool, batch_size=2, progress=False)
        ref = extract(fp32, tok, TEXTS, sites=sites, pool=pool, batch_size=2, progress=False)
        assert torch.equal(low.offsets, ref.offsets)
        for site in sites:
            # token rows held in bf16 (half the memory), pooled means in the float32 they were summed in
            assert low.held_dtype(site) == (torch.bfloat16 if pool == "none" else torch.float32)
            assert ref.held_dtype(site) == torch.float32
            for layer in ref.layers(site):
                assert low[site][layer].dtype == torch.float32  # read as float32
                assert relative_error(low[site][layer], ref[site][layer]) < 2e-2, (pool, site, layer)


def test_rows_stay_in_the_models_dtype_and_means_are_summed_in_float32():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4).to(torch.bfloat16)
    keep = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    rows = select_rows(x, keep, "none", None)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, x[keep])
    assert torch.equal(select_rows(x, keep, "none", None, kept_positions(keep)), x[keep])  # by index
    wide = x.double()
    expected = torch.stack([wide[i][keep[i]].mean(0) for i in range(3)])
    mean = select_rows(x, keep, "mean", None)
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean.double(), expected, atol=1e-6, rtol=1e-6)  # float32 sums, not bf16
    assert select_rows(x, keep, "none").dtype == torch.float32  # the default: float32 rows


def test_host_copies_of_host_tensors_are_the_tensors_themselves():
    rows = {"hidden/0": torch.ones(2, 3, dtype=torch.bfloat16), "logprobs": torch.zeros(2).double()}
    landed = to_host(rows)
    wait_for(copies_landed())
    assert list(landed) == list(rows) and all(landed[k] is rows[k] for k in rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_agrees_with_an_elementwise_check(dtype):
    """One reduction's verdict against ``isfinite`` element by element, for NaN, each infinity, a value
    near the dtype's largest, and no value at all."""
    torch.manual_seed(0)
    big = torch.finfo(dtype).max
    for bad in (None, float("nan"), float("inf"), float("-inf"), big, -big):
        x = torch.randn(7, 5).to(dtype)
        if bad is not None:
            x[3, 2] = bad
        found = all_finite(x)
        assert found.shape == () and found.dtype == torch.bool
        assert bool(found) == all(math.isfinite(v) for v in x.double().flatten().tolist()), bad
    assert bool(all_finite(torch.empty(0, 5, dtype=dtype)))
    assert bool(all_finite(torch.tensor([[True, False]]))) and bool(all_finite(torch.arange(6).view(2, 3)))


def test_a_batch_is_collected_after_the_next_one_has_started(tok, monkeypatch):
    """The host converts a batch's rows while the device runs the next: each batch's `result` comes after
    the next batch's trace, every batch is collected once, and the rows equal one batch at a time."""
    from lime_probe.extraction import forward, tracing

    model = tiny_model("llama", tok)
    events: list[str] = []
    trace, result = tracing.trace_batch, forward.TracedBatch.result

    def traced(*args, **kwargs):
        events.append(f"start {args[7]}")
        return trace(*args, **kwargs)

    def collected(self):
        events.append(f"result {self.index}")
        return result(self)

    monkeypatch.setattr(tracing, "trace_batch", traced)
    monkeypatch.setattr(forward.TracedBatch, "result", collected)
    texts = TEXTS * 2
    acts = extract(model, tok, texts, sites=["hidden"], batch_size=2, progress=False)
    starts = [e for e in events if e.startswith("start")]
    assert (
        len(starts) == len(texts) // 2 and events[:2] == starts[:2]
    )  # the first collected after the second began
    for k, started in enumerate(starts[:-1]):
        batch = started.removeprefix("start ")
        assert events.index(f"result {batch}") > events.index(starts[k + 1]), events
    assert sorted(e.removeprefix("result ") for e in events if e.startswith("result")) == sorted(
        s.removeprefix("start ") for s in starts
    )
    monkeypatch.undo()
    alone = extract(model, tok, texts, sites=["hidden"], batch_size=1, progress=False)
    for layer in acts.layers("hidden"):
        torch.testing.assert_close(acts["hidden"][layer], alone["hidden"][layer], atol=1e-5, rtol=1e-5)


def numpy_entropy(seqs: list[np.ndarray], alpha: float, zscore: bool, eps: float = 1e-5) -> np.ndarray:
    """An independent float64 computation: (global z-score,) the smaller Gram matrix (t x t, or d x d when
    t > d: the larger one's zero eigenvalues come out as round-off, which p^alpha magnifies to ~1e-9),
    eigenvalues / trace, Renyi."""
    if zscore:
        rows = np.concatenate(seqs)
        mean, std = rows.mean(0), rows.std(0, ddof=1)
        seqs = [(z - mean) / (std + eps) for z in seqs]
    out = []
    for z in seqs:
        gram = z @ z.T if z.shape[0] <= z.shape[1] else z.T @ z
        p = np.clip(np.linalg.eigvalsh(gram), 0, None) / np.trace(gram)
        out.append(np.log((p**alpha).sum()) / (1 - alpha))
    return np.array(out)


@pytest.mark.parametrize("preset", ["lime", "layer-by-layer"])
def test_entropy_on_a_given_device_equals_the_host_path(preset):
    """fp64 input: the device path (here device="cpu", the same code a GPU runs) equals the host path to
    1e-10, and for the "lime" preset an independent NumPy computation; bf16 input moved to the device and
    converted there equals its exact float64 values."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randn(t, 6, generator=gen, dtype=torch.float64) for t in (4, 4, 7, 3, 9)]
    host = layer_entropy(seqs, preset, n_boot=10)
    device = layer_entropy(seqs, preset, n_boot=10, device="cpu")
    np.testing.assert_allclose(device.values, host.values, rtol=0, atol=1e-10)
    if preset == "lime":
        expected = numpy_entropy([z.numpy() for z in seqs], alpha=0.5, zscore=True)
        np.testing.assert_allclose(device.values, expected, rtol=0, atol=1e-10)
    low = [z.to(torch.bfloat16) for z in seqs]
    on_device = stream_entropy(lambda: [low[:2], low[2:]], preset, n_boot=10, device="cpu")
    widened = layer_entropy([z.double() for z in low], preset, n_boot=10)
    np.testing.assert_allclose(on_device.values, widened.values, rtol=0, atol=1e-10)


def test_a_batch_counts_its_kept_tokens_once_for_every_site():
    """Rows are taken by the batch's kept positions, found once per batch: a boolean mask per site and
    layer would make the host wait for the device to count its rows each time (on a GPU, a stall per
    site and layer). Counted on the CPU as the profiler's ``aten::nonzero`` calls, which do not grow with
    the sites read (they did: 6 for one site, 16 for three, at 2 layers x 2 batches)."""
    from torch.profiler import ProfilerActivity, profile

    tok = tiny_tokenizer()
    model = tiny_model("lime", tok)

    def nonzero_calls(sites: list[str]) -> int:
        extract(model, tok, TEXTS, sites=sites, batch_size=2, progress=False)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            acts = extract(model, tok, TEXTS, sites=sites, batch_size=2, progress=False)
        assert len(acts.layers("values")) == 2 and all(acts.layers(site) for site in sites)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::nonzero")

    assert nonzero_calls(["values"]) == nonzero_calls(["values", "routed_values", "hidden"])


def test_non_finite_rows_name_their_site_layer_and_sequences(tok):
    """A NaN weight in layer 1's v_proj: the first batch's values there are refused in one line naming the
    site, the layer and the input's sequence numbers."""
    import re

    model = tiny_model("llama", tok)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError) as error:
        extract(model, tok, TEXTS, sites=["values"], batch_size=2, progress=False)
    found = re.fullmatch(
        r"non-finite activations \(NaN/Inf\) at site 'values' layer 1 in a batch of sequences (\d), (\d)",
        str(error.value),
    )
    assert found and {int(n) for n in found.groups()} < set(range(len(TEXTS))), str(error.value)


def test_a_batch_stages_in_one_buffer_of_views_that_do_not_overlap():
    """`to_host`'s staging for a CUDA batch, on the host: one buffer, a view per tensor with its shape and
    dtype (rows, a 0-d flag, float64 scores, no rows at all), each at a 16-byte boundary; what is copied
    into every view reads back unchanged after all are written."""
    from lime_probe.extraction.transfer import staging

    torch.manual_seed(0)
    tensors = [
        torch.randn(5, 3).to(torch.bfloat16),
        torch.tensor(True),
        torch.randn(7, dtype=torch.float64),
        torch.empty(0, 4, dtype=torch.bfloat16),
        torch.randn(2, 2, 3),
    ]
    views = staging(tensors)
    base = views[0].untyped_storage().data_ptr()
    for x, view in zip(tensors, views, strict=True):
        assert view.shape == x.shape and view.dtype == x.dtype and view.untyped_storage().data_ptr() == base
        assert (view.data_ptr() - base) % 16 == 0
    for x, view in zip(tensors, views, strict=True):
        view.copy_(x)
    for x, view in zip(tensors, views, strict=True):
        assert torch.equal(view, x)


@pytest.fixture
def threaded(monkeypatch):
    """Rows placed by the worker thread a GPU model gets (`tracing.places_in_a_thread`), here on the CPU."""
    from lime_probe.extraction import tracing

    monkeypatch.setattr(tracing, "places_in_a_thread", lambda device: True)


def test_rows_placed_by_a_worker_thread_equal_those_placed_inline(tok, tmp_path, monkeypatch):
    """A list, a stream and a cache, pooled and not, with log-probabilities: bit for bit the same rows
    placed inline and by the worker thread, with several blocks in flight (a block per batch)."""
    from lime_probe.extraction import tracing

    model = tiny_model("lime", tok)
    texts = TEXTS * 3
    settings = [
        dict(pool="none", logprobs=True),
        dict(pool="mean"),
        dict(pool="none", token_ids=tok("the is", add_special_tokens=False)["input_ids"]),
    ]

    def run(source, **kw):
        return extract(
            model, tok, source, sites=["hidden", "routed_values"], batch_size=2, progress=False, **kw
        )

    monkeypatch.setattr(tracing, "SHARD_BYTES", 1)  # one block per batch (the same batches both ways)
    inline = [run(texts, **kw) for kw in settings]
    monkeypatch.setattr(tracing, "places_in_a_thread", lambda device: True)
    for kw, want in zip(settings, inline, strict=True):
        for got in (run(texts, **kw), run(iter(texts), **kw), run(texts, cache_dir=tmp_path / "c", **kw)):
            assert torch.equal(got.offsets, want.offsets) and torch.equal(got.token_ids, want.token_ids)
            assert (got.logprobs is None) == (want.logprobs is None)
            assert got.logprobs is None or torch.equal(got.logprobs, want.logprobs)
            for site in want:
                for layer in want.layers(site):
                    assert torch.equal(got[site][layer], want[site][layer]), (kw, site, layer)


def test_a_worker_threads_non_finite_rows_are_refused_in_one_line(tok, threaded):
    model = tiny_model("llama", tok)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"^non-finite activations \(NaN/Inf\) at site 'values' layer 1 in a"
    ):
        extract(model, tok, TEXTS, sites=["values"], batch_size=1, progress=False)


def test_rows_held_in_bf16_read_as_the_float32_that_widening_them_at_extraction_gave(tok, tmp_path):
    """bfloat16 -> float32 is exact, so holding a bf16 model's rows in bf16 and widening them as they are
    read gives every accessor the float32 numbers of rows widened at extraction (`host_dtype` patched to
    float32, as extraction held them before), in memory and from the cache, whose shards hold bf16."""
    from unittest import mock

    from safetensors import safe_open

    from lime_probe.extraction import assembly

    model = tiny_model("lime", tok).to(torch.bfloat16)
    sites = ["hidden", "values", "routed_values"]
    with mock.patch.object(assembly, "host_dtype", lambda dtype: torch.float32):
        widened = extract(model, tok, TEXTS, sites=sites, batch_size=2, progress=False)
    held = extract(model, tok, TEXTS, sites=sites, batch_size=2, progress=False)
    cached = extract(model, tok, TEXTS, sites=sites, batch_size=2, progress=False, cache_dir=tmp_path)
    for shard in cached.shards:
        with safe_open(str(shard), framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys() if "/" in k} == {"BF16"}  # noqa: SIM118
    for acts in (held, cached):
        for site in sites:
            assert widened.held_dtype(site) == torch.float32 and acts.held_dtype(site) == torch.bfloat16
            assert torch.equal(acts.stack(site), widened.stack(site))
            for layer in acts.layers(site):
                chunks = [t for chunk in acts.iter_sequences(site, layer, chunk=3) for t in chunk]
                assert all(t.dtype == torch.float32 for t in chunks)
                assert torch.equal(torch.cat(chunks), widened[site][layer])
        assert torch.equal(acts.per_head("values", 0), widened.per_head("values", 0))
