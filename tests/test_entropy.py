"""Matrix entropy against a plain per-sequence loop written from the formula (numpy, t x t Gram)."""

import numpy as np
import pytest
import scipy.stats
import torch

from lime_probe.probes.entropy import (
    EntropyAccumulator,
    EntropyConfig,
    FeatureMoments,
    entropy_config,
    layer_entropies,
    layer_entropy,
    matrix_entropy,
    stream_entropy,
)
from lime_probe.probes.stats import bootstrap_ci, summarize

ALPHAS = [0.5, 1.0, 2.0, 3.0]
CENTER_L2 = EntropyConfig(alpha=1.0, normalize="center-l2")  # "layer-by-layer" without its Gram clamp


def tol(alpha: float) -> float:
    """Round-off of zero eigenvalues is amplified by p^alpha for alpha < 1 (clamping keeps it >= 0)."""
    return 1e-7 if alpha < 1 else 1e-10


def reference_entropy(Z: np.ndarray, alpha: float) -> float:
    """S_alpha from the definition: eigenvalues of the t x t Gram, p = lambda / trace.

    Eigenvalues under numpy's rank tolerance are structurally zero (t > rank) and set to 0 exactly:
    at alpha < 1 their round-off (~1e-16 * lambda_max) would otherwise add ~1e-8 each through p^alpha.
    """
    K = Z.astype(np.float64) @ Z.astype(np.float64).T
    lam = np.linalg.eigvalsh(K)
    lam[lam < lam.max() * K.shape[0] * np.finfo(np.float64).eps] = 0.0
    p = lam / np.trace(K)
    if alpha == 1:
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())
    return float(np.log((p**alpha).sum()) / (1 - alpha))


def reference_lime(seqs: list[np.ndarray], alpha: float = 0.5, eps: float = 1e-5) -> np.ndarray:
    rows = np.concatenate(seqs).astype(np.float64)
    mu, sd = rows.mean(0), rows.std(0, ddof=1)
    return np.array([reference_entropy((z - mu) / (sd + eps), alpha) for z in seqs])


def reference_layer_by_layer(seqs: list[np.ndarray], alpha: float = 1.0) -> np.ndarray:
    out = []
    for z in seqs:
        c = z.astype(np.float64) - z.mean(0)
        c = c / np.linalg.norm(c, axis=1, keepdims=True)
        out.append(reference_entropy(c, alpha))
    return np.array(out)


def random_seqs(lengths, d, seed=0, offset=0.0):
    g = np.random.default_rng(seed)
    # Anisotropic features with a non-zero mean, like real activations.
    scale = g.uniform(0.2, 3.0, size=d)
    return [(g.standard_normal((t, d)) * scale + offset).astype(np.float32) for t in lengths]


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("t,d", [(5, 12), (20, 6), (8, 8)])
def test_matrix_entropy_matches_loop(alpha, t, d):
    Z = np.random.default_rng(1).standard_normal((3, t, d))
    got = matrix_entropy(torch.from_numpy(Z), alpha=alpha)
    assert got.shape == (3,) and got.dtype == torch.float64
    want = [reference_entropy(z, alpha) for z in Z]
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=tol(alpha))


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("t,d", [(6, 16), (30, 10)])
def test_low_rank_input(alpha, t, d):
    g = np.random.default_rng(2)
    Z = g.standard_normal((t, 3)) @ g.standard_normal((3, d))  # rank 3
    got = float(matrix_entropy(Z, alpha=alpha))
    assert got == pytest.approx(reference_entropy(Z, alpha), abs=tol(alpha))
    assert got < np.log(3) + tol(alpha)  # at most log(rank)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("t,d,k", [(10, 20, 4), (40, 7, 5)])
def test_rank_k_isotropic_is_log_k(alpha, t, d, k):
    g = np.random.default_rng(3)
    U = np.linalg.qr(g.standard_normal((t, k)))[0]
    V = np.linalg.qr(g.standard_normal((d, k)))[0]
    Z = 2.5 * U @ V.T  # k equal singular values
    assert float(matrix_entropy(Z, alpha=alpha)) == pytest.approx(np.log(k), abs=tol(alpha))


def test_matrix_entropy_keeps_leading_dims_and_float32_input():
    Z = torch.randn(2, 3, 4, 9)
    got = matrix_entropy(Z, alpha=0.5)
    assert got.shape == (2, 3)
    want = [[reference_entropy(z.numpy(), 0.5) for z in row] for row in Z]
    np.testing.assert_allclose(got.numpy(), want, atol=1e-9)


@pytest.mark.parametrize("lengths,d", [([40, 40, 40, 40], 12), ([5, 7, 5, 6], 16), ([30, 4, 18, 12, 12], 10)])
def test_lime_preset_matches_loop(lengths, d):
    seqs = random_seqs(lengths, d, offset=4.0)
    res = layer_entropy([torch.from_numpy(z) for z in seqs], "lime")
    np.testing.assert_allclose(res.values, reference_lime(seqs), atol=1e-8)
    assert res.config == EntropyConfig(alpha=0.5, normalize="zscore", eps=1e-5)


def test_lime_preset_with_mean_far_larger_than_std():
    seqs = random_seqs([40] * 5, 12, seed=12, offset=1e4)  # like the massive activations of some LLM dims
    res = layer_entropy([torch.from_numpy(z) for z in seqs], "lime")
    np.testing.assert_allclose(res.values, reference_lime(seqs), atol=1e-9)


def test_lime_preset_streamed_in_batches_agrees_with_loop():
    seqs = random_seqs([25, 25, 9, 25, 14, 25], 11, seed=4, offset=-2.0)
    tensors = [torch.from_numpy(z) for z in seqs]
    batches = (tensors[:2], tensors[2:3], torch.stack(tensors[3:4]), tensors[4:])
    passes = []

    def chunks():
        passes.append(1)
        return iter(batches)

    res = stream_entropy(chunks, "lime")
    np.testing.assert_allclose(res.values, reference_lime(seqs), atol=1e-8)
    assert len(passes) == 2  # the global moments first, then the entropies
    stream_entropy(chunks, "layer-by-layer")
    assert len(passes) == 3  # per-sequence normalisation: one pass
    moments = FeatureMoments()
    for z in tensors:
        moments.update(z)
    by_hand = EntropyAccumulator("lime", feature_stats=moments)
    for batch in batches:
        by_hand.update(batch)
    np.testing.assert_allclose(by_hand.result().values, res.values, atol=1e-12)
    with pytest.raises(ValueError, match="feature moments"):
        EntropyAccumulator("lime")


@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("lengths,d", [([12, 12, 12], 5), ([4, 9, 6], 20)])
def test_center_l2_matches_loop(alpha, lengths, d):
    seqs = random_seqs(lengths, d, seed=5, offset=1.0)
    res = layer_entropy([torch.from_numpy(z) for z in seqs], CENTER_L2, alpha=alpha)
    np.testing.assert_allclose(res.values, reference_layer_by_layer(seqs, alpha), atol=1e-9)


def test_knob_overrides_and_tensor_input():
    seqs = random_seqs([10, 10, 10], 6, seed=6)
    arr = np.stack(seqs)
    res = layer_entropy(torch.from_numpy(arr), "lime", alpha=3.0, eps=0.1)
    np.testing.assert_allclose(res.values, reference_lime(seqs, alpha=3.0, eps=0.1), atol=1e-9)
    raw = layer_entropy(arr, "lime", normalize="none", alpha=2.0)
    np.testing.assert_allclose(raw.values, [reference_entropy(z, 2.0) for z in seqs], atol=1e-9)
    assert entropy_config("layer-by-layer", eps=0.5) == EntropyConfig(1.0, "center-l2", 0.5, clamp_gram=True)


def test_summary_statistics_of_layer():
    seqs = random_seqs([8] * 30, 5, seed=7)
    res = layer_entropy(seqs, CENTER_L2, n_boot=2000)
    want = reference_layer_by_layer(seqs)
    assert res.mean == pytest.approx(want.mean(), abs=1e-9)
    assert res.std == pytest.approx(want.std(), abs=1e-9)
    ci = scipy.stats.bootstrap((want,), np.mean, n_resamples=2000, method="percentile", random_state=0)
    # Two independent bootstraps of the same data: agree up to Monte Carlo error.
    tol = 0.25 * want.std() / np.sqrt(want.size)
    assert res.ci_low == pytest.approx(ci.confidence_interval.low, abs=tol)
    assert res.ci_high == pytest.approx(ci.confidence_interval.high, abs=tol)
    assert res.ci_low < res.mean < res.ci_high


def test_layer_entropies_over_layers():
    per_layer = {0: random_seqs([6, 6], 4, seed=8), 3: random_seqs([6, 6], 4, seed=9)}
    out = layer_entropies(per_layer, "lime", progress=False)
    assert list(out) == [0, 3]
    np.testing.assert_allclose(out[3].values, reference_lime(per_layer[3]), atol=1e-9)


def test_bad_update_leaves_accumulator_unchanged():
    seqs = random_seqs([6, 6, 9], 4, seed=13)
    moments = FeatureMoments()
    for z in seqs:
        moments.update(torch.from_numpy(z))
    acc = EntropyAccumulator("lime", feature_stats=moments).update(seqs[:2])
    with pytest.raises(ValueError, match="sequence 1: contains NaN"):
        acc.update([seqs[2], np.full((6, 4), np.nan, dtype=np.float32)])
    acc.update(seqs[2:])
    np.testing.assert_allclose(acc.result().values, reference_lime(seqs), atol=1e-9)


def test_feature_moments_match_numpy():
    g = np.random.default_rng(10)
    rows = g.standard_normal((57, 4)) * 3 + 100
    m = FeatureMoments()
    for part in np.split(rows, [1, 20, 21]):
        m.update(torch.from_numpy(part))
    np.testing.assert_allclose(m.mean.numpy(), rows.mean(0), rtol=1e-12)
    np.testing.assert_allclose(m.std.numpy(), rows.std(0, ddof=1), rtol=1e-10)


def test_bootstrap_ci_close_to_normal_theory():
    v = np.random.default_rng(11).normal(5.0, 2.0, size=400)
    lo, hi = bootstrap_ci(v, n_boot=4000, seed=1)
    half = 1.96 * v.std(ddof=1) / np.sqrt(v.size)
    assert lo == pytest.approx(v.mean() - half, abs=0.2 * half)
    assert hi == pytest.approx(v.mean() + half, abs=0.2 * half)
    s = summarize([3.0])
    assert (s.mean, s.std, s.ci_low, s.ci_high, s.n) == (3.0, 0.0, 3.0, 3.0, 1)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: matrix_entropy(torch.tensor([[1.0, float("nan")]])), "NaN"),
        (lambda: matrix_entropy(torch.zeros(3, 4)), "all-zero"),
        (lambda: matrix_entropy(torch.ones(4)), "shape"),
        (lambda: matrix_entropy(torch.ones(2, 2), alpha=0), "alpha"),
        (lambda: matrix_entropy(torch.ones(2, 2, dtype=torch.long)), "floating"),
        (lambda: layer_entropy([torch.ones(3, 4)], "nope"), "unknown entropy preset"),
        (lambda: layer_entropy([torch.ones(3, 4), torch.ones(3, 5)], "lime"), "sequence 1: dim"),
        (
            lambda: layer_entropy([torch.ones(3, 4), torch.tensor([[float("inf")] * 4])], "lime"),
            "sequence 1: contains",
        ),
        (lambda: layer_entropy([], "lime"), "no sequences"),
        (lambda: EntropyConfig(normalize="pca"), "normalize"),
        (lambda: layer_entropies({}, "lime"), "no layers"),
        (lambda: layer_entropy([torch.ones(1, 4)], "lime"), "at least 2 token rows"),
        (lambda: layer_entropy([torch.randn(1, 4)], "layer-by-layer"), "one-token sequence"),
        (lambda: bootstrap_ci([1.0, 2.0], level=1.0), "level"),
        (lambda: bootstrap_ci([1.0, float("nan")]), "NaN"),
        (lambda: summarize([]), "non-empty"),
    ],
)
def test_bad_input_raises_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
