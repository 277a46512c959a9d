"""The collapse metrics (`lime_probe.probes.collapse`, the ``metrics`` command) against inputs with known
answers and against plain-loop rewrites of each paper's formula and of Skean et al.'s code
(OFSkean/information_flow, metric_functions.py): Facco et al.'s TwoNN fit, Wei et al.'s Diff-eRank,
Hosseini & Fedorenko's curvature (and Skean et al.'s |cos| form), Skean et al.'s dataset entropy and LiDAR,
Gromov et al.'s angular distance."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from helpers import CORPUS, save_tiny_checkpoint, tiny_model, tiny_tokenizer

from lime_probe import cli
from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.tracing import extract
from lime_probe.probes import collapse as C
from lime_probe.probes.similarity import effective_rank
from lime_probe.specs import ANALYSES
from lime_probe.specs.base import Checkpoint
from lime_probe.specs.metrics import METRICS, augment_text

RNG = np.random.default_rng(0)


def gaussian(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d))


# ---- plain loops of the defining formulas -------------------------------------------------------------


def twonn_loop(X: np.ndarray, discard: float = 0.1) -> tuple[float, float]:
    """Facco et al. 2017: mu_i = r2 / r1 by brute force; (the fit through the origin of -log(1 - i/N) on
    log mu_(i) with the largest `discard` left out, the MLE N / sum log mu)."""
    n = len(X)
    mu = []
    for i in range(n):
        dists = sorted(math.dist(X[i], X[j]) for j in range(n) if j != i)
        mu.append(dists[1] / dists[0])
    mle = n / sum(math.log(m) for m in mu)
    mu.sort()
    keep = int(n * (1 - discard))
    sxy = sxx = 0.0
    for i in range(keep):
        x, y = math.log(mu[i]), -math.log(1 - (i + 1) / n)
        sxy, sxx = sxy + x * y, sxx + x * x
    return sxy / sxx, mle


def wei_entropy(R: np.ndarray) -> float:
    """Wei et al.'s per-sentence entropy: centre, L2-normalise rows, cov = Z^T Z / N, eigenvalues of
    cov / trace, Shannon entropy."""
    Z = R - R.mean(0)
    Z = Z / np.linalg.norm(Z, axis=1, keepdims=True)
    A = Z.T @ Z / len(Z)
    s = np.linalg.svd(A / np.trace(A), compute_uv=False)
    return float(-sum(x * math.log(x) for x in s if x > 0))


def curvature_loop(Z: np.ndarray, absolute: bool) -> float:
    """Mean over k of the angle between z_{k+1} - z_k and z_{k+2} - z_{k+1}; |dot| as Skean et al.'s code;
    pairs with a zero difference (no angle) left out."""
    total, count = 0.0, 0
    for k in range(1, len(Z) - 1):
        a, b = Z[k] - Z[k - 1], Z[k + 1] - Z[k]
        if not (np.linalg.norm(a) and np.linalg.norm(b)):
            continue
        dot = abs(a @ b) if absolute else a @ b
        total += math.acos(max(-1.0, min(1.0, dot / (np.linalg.norm(a) * np.linalg.norm(b)))))
        count += 1
    return total / count


def normalize_loop(R: np.ndarray) -> np.ndarray:
    """The `normalize` of Skean et al.'s (and Wei et al.'s) code: centre the tokens, L2-normalise rows."""
    Z = R - R.mean(0)
    return Z / np.linalg.norm(Z, axis=1, keepdims=True)


def entropy_of(K: np.ndarray, alpha: float) -> float:
    """repitl's matrixAlphaEntropy: the positive eigenvalues of K normalised to sum to 1."""
    ev = np.linalg.eigvalsh(K)
    p = ev[ev > 0] / ev[ev > 0].sum()
    return float(-(p * np.log(p)).sum()) if alpha == 1 else float(np.log((p**alpha).sum()) / (1 - alpha))


def skean_dataset_entropy(seqs: list[np.ndarray], alpha: float) -> float:
    """compute_on_concatenated_passes + compute_entropy: per-prompt normalize, token mean, the N x D matrix's
    smaller Gram, negative entries to 0, / trace, matrix entropy."""
    P = np.stack([normalize_loop(z).mean(0) for z in seqs])
    n, d = P.shape
    K = np.maximum(P.T @ P if n > d else P @ P.T, 0.0)
    return entropy_of(K / np.trace(K), alpha)


def skean_lidar(V: np.ndarray, alpha: float, delta: float = 1e-4) -> float:
    """compute_LDA_matrix (Eqs. 1-3 of the LiDAR paper, summed outer products) + matrixAlphaEntropy."""
    n, a, d = V.shape
    grand = V.mean((0, 1))
    means = V.mean(1)
    between = np.zeros((d, d))
    within = np.zeros((d, d))
    for i in range(n):
        between += np.outer(means[i] - grand, means[i] - grand)
        for j in range(a):
            within += np.outer(V[i, j] - means[i], V[i, j] - means[i])
    between /= n
    within = within / (n * a) + delta * np.eye(d)
    ev, U = np.linalg.eigh(within)
    root = U @ np.diag(ev**-0.5) @ U.T
    return entropy_of(root @ between @ root, alpha)


# ---- TwoNN -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fit", "mle"])
def test_twonn_is_two_on_a_plane_in_50_dimensions(method):
    g = np.random.default_rng(1)
    basis, _ = np.linalg.qr(g.normal(size=(50, 2)))
    X = g.uniform(-1, 1, size=(2000, 2)) @ basis.T + 5.0
    assert C.intrinsic_dimension(X, method) == pytest.approx(2.0, abs=0.15)


@pytest.mark.parametrize("d", [3, 5])
@pytest.mark.parametrize("method", ["fit", "mle"])
def test_twonn_is_d_on_a_d_dimensional_gaussian(d, method):
    assert C.intrinsic_dimension(gaussian(2000, d, seed=d), method) == pytest.approx(d, rel=0.1)


def test_twonn_equals_facco_et_al_formula_by_loops():
    X = gaussian(80, 4, seed=3)
    fit, mle = twonn_loop(X)
    assert C.intrinsic_dimension(X, "fit") == pytest.approx(fit, rel=1e-12)
    assert C.intrinsic_dimension(X, "mle") == pytest.approx(mle, rel=1e-12)
    assert C.intrinsic_dimension(X, "fit", discard=0.3) == pytest.approx(twonn_loop(X, 0.3)[0], rel=1e-12)
    # repeated points count once (r1 would be 0)
    assert C.intrinsic_dimension(np.concatenate([X, X[:10]])) == pytest.approx(fit, rel=1e-12)


def test_twonn_refusals():
    with pytest.raises(ValueError, match="at least 3 distinct points"):
        C.intrinsic_dimension(np.ones((5, 3)))
    with pytest.raises(ValueError, match="'fit' or 'mle'"):
        C.intrinsic_dimension(gaussian(10, 2, 0), "knn")
    with pytest.raises(ValueError, match=r"discard must be in \[0, 1\)"):
        C.intrinsic_dimension(gaussian(10, 2, 0), discard=1.0)


# ---- effective rank and Diff-eRank -------------------------------------------------------------------


def plus_minus(k: int, d: int) -> np.ndarray:
    """Rows +e_1, -e_1, ..., +e_k, -e_k in d dimensions: mean 0, unit rows, covariance I_k / k (padded)."""
    eye = np.eye(d)[:k]
    return np.concatenate([eye, -eye])


def test_effective_rank_of_an_isotropic_covariance_is_the_dimension():
    for d in (2, 4, 9):
        assert effective_rank(np.eye(d)) == pytest.approx(d, rel=1e-12)
        assert C.covariance_erank(plus_minus(d, d)) == pytest.approx(d, rel=1e-12)
    assert C.covariance_erank(plus_minus(3, 8)) == pytest.approx(3, rel=1e-12)  # 3 of 8 directions used


def test_diff_erank_known_answer_and_wei_et_al_formula():
    untrained, trained = [plus_minus(6, 6)] * 3, [plus_minus(2, 6)] * 3
    assert C.diff_erank(untrained, trained) == pytest.approx(6 - 2, rel=1e-12)
    a = [gaussian(t, 16, seed=t) for t in (5, 9, 30)]
    b = [gaussian(t, 16, seed=t + 100) @ np.diag(np.linspace(1, 0.01, 16)) for t in (5, 9, 30)]
    want = math.exp(np.mean([wei_entropy(z) for z in a])) - math.exp(np.mean([wei_entropy(z) for z in b]))
    assert C.diff_erank(a, b) == pytest.approx(want, rel=1e-10)
    assert C.diff_erank(b, b) == 0
    with pytest.raises(ValueError, match="3 untrained sequences but 2 trained"):
        C.diff_erank(a, b[:2])


# ---- curvature ---------------------------------------------------------------------------------------


def zigzag(h: float, t: int = 12, d: int = 2) -> np.ndarray:
    """z_k = (k, h (k mod 2)) in d dimensions: difference vectors (1, h), (1, -h) alternating."""
    Z = np.zeros((t, d))
    Z[:, 0], Z[:, 1] = np.arange(t), h * (np.arange(t) % 2)
    return Z


def test_curvature_closed_forms():
    line = np.outer(np.arange(10.0) ** 2, RNG.normal(size=7)) + RNG.normal(size=7)  # one direction, any speed
    assert C.curvature(line) == pytest.approx(0.0, abs=1e-14)  # arccos of the rounded cosine: ~1e-8
    assert C.curvature(zigzag(1.0)) == pytest.approx(math.pi / 2, abs=1e-15)
    for h in (0.5, 2.0, 3.0):  # the angle between (1, h) and (1, -h)
        assert C.curvature(zigzag(h, d=5)) == pytest.approx(math.acos((1 - h * h) / (1 + h * h)), abs=1e-14)
    assert C.curvature(zigzag(2.0), absolute=True) == pytest.approx(math.acos(3 / 5), abs=1e-14)
    back = np.array([[0.0, 0], [1, 0], [0, 0], [1, 0]])  # straight back and forth: pi, and 0 with |cos|
    assert C.curvature(back) == pytest.approx(math.pi) and C.curvature(back, absolute=True) == 0.0


def test_curvature_equals_the_loops_and_averages_sequences():
    seqs = [gaussian(t, 8, seed=t) for t in (3, 7, 20)]
    for absolute in (False, True):
        want = [curvature_loop(z, absolute) for z in seqs]
        assert [C.curvature(z, absolute) for z in seqs] == pytest.approx(want, rel=1e-12)
        assert C.mean_curvature(seqs + [seqs[0][:2]], absolute) == pytest.approx(np.mean(want), rel=1e-12)
    # a repeated token has no direction: its two pairs are left out
    repeated = np.concatenate([seqs[1][:4], seqs[1][3:4], seqs[1][4:]])
    before, after = curvature_loop(seqs[1][:4], False), curvature_loop(seqs[1][3:], False)  # 2 angles each
    assert C.curvature(repeated) == pytest.approx((before + after) / 2, rel=1e-12)
    assert math.isnan(C.curvature(seqs[0][:2]))
    with pytest.raises(ValueError, match="no sequence has two successive"):
        C.mean_curvature([seqs[0][:2]])


# ---- dataset entropy and LiDAR -----------------------------------------------------------------------


def test_dataset_entropy_known_answer_and_skean_et_al():
    eye = np.eye(6)
    one_token = [eye[i : i + 1] for i in range(4)]  # pooled rows orthonormal: K = I_4
    assert C.dataset_entropy(one_token, normalize=False) == pytest.approx(math.log(4), rel=1e-12)
    assert C.dataset_entropy(one_token, normalize=False, max_normalize=True) == pytest.approx(1.0)
    assert C.dataset_entropy(one_token, alpha=2, normalize=False) == pytest.approx(math.log(4), rel=1e-12)
    for n, d in ((5, 16), (30, 6)):  # the N x N and the d x d Gram
        seqs = [gaussian(t, d, seed=t) @ np.diag(np.linspace(2, 0.1, d)) + 1.0 for t in range(3, 3 + n)]
        for alpha in (1.0, 2.0, 0.5):
            want = skean_dataset_entropy(seqs, alpha)
            assert C.dataset_entropy(seqs, alpha=alpha) == pytest.approx(want, rel=1e-9), (n, d, alpha)


def test_lidar_known_answer_and_skean_et_al():
    k = 3
    d = n = 2 * k
    means = np.concatenate([np.eye(d)[:k], -np.eye(d)[:k]]) * 4.0  # Sigma_b = 16 / k on k directions
    noise = np.eye(d) * 0.5  # class i's two views mean_i +- noise_i: Sigma_w = I / (4 n) + delta I
    V = np.stack([means + noise, means - noise], 1)
    assert C.lidar(V) == pytest.approx(math.log(k), rel=1e-12)  # Sigma_lidar proportional to a projection
    assert C.lidar(V, alpha=2.0) == pytest.approx(math.log(k), rel=1e-12)
    g = np.random.default_rng(5)
    for n, a, d in ((12, 4, 5), (6, 16, 9)):
        V = g.normal(size=(n, 1, d)) * 3 + g.normal(size=(n, a, d)) @ np.diag(np.linspace(1, 0.2, d))
        for alpha in (1.0, 2.0):
            assert C.lidar(V, alpha) == pytest.approx(skean_lidar(V, alpha), rel=1e-9), (n, a, d, alpha)
    with pytest.raises(ValueError, match=r"shape \(N, A, d\) with N, A >= 2"):
        C.lidar(V[:, :1])


# ---- angular distance --------------------------------------------------------------------------------


def test_angular_distance_closed_forms_and_formula():
    X = RNG.normal(size=(20, 8))
    assert C.angular_distance(X, X) == 0.0
    assert C.angular_distance(X, 3 * X) == pytest.approx(0.0, abs=1e-15)  # scale does not matter
    assert C.angular_distance(X, -X) == pytest.approx(1.0, abs=1e-15)
    assert C.angular_distance(np.eye(4), np.roll(np.eye(4), 1, 1)) == pytest.approx(0.5, abs=1e-15)
    sixty = np.array([[1.0, 0.0]]), np.array([[0.5, math.sqrt(3) / 2]])
    assert C.angular_distance(*sixty) == pytest.approx(1 / 3, abs=1e-15)
    Y = RNG.normal(size=(20, 8))
    want = np.mean(
        [
            math.acos(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))) / math.pi
            for x, y in zip(X, Y, strict=True)
        ]
    )
    assert C.angular_distance(X, Y) == pytest.approx(want, rel=1e-12)
    layers = {0: X, 1: Y, 2: X, 4: Y}
    assert C.layer_angular_distances(layers, 2) == pytest.approx({0: 0.0, 2: want})
    assert C.layer_angular_distances([X, X, -X]) == {0: 0.0, 1: 1.0}
    with pytest.raises(ValueError, match=r"shapes \(20, 8\) and \(19, 8\) differ"):
        C.angular_distance(X, Y[1:])


# ---- the metrics analysis and command ----------------------------------------------------------------


def test_augmentations_are_seeded_and_spare_short_words():
    text = "The quick brown fox jumps over a lazy dog at the riverside."
    views = [augment_text(text, random.Random(s)) for s in range(8)]
    assert views == [augment_text(text, random.Random(s)) for s in range(8)]
    assert len(set(views)) == 8 and text not in views
    assert all(augment_text("a be cat", random.Random(s)) == "a be cat" for s in range(20))


@pytest.fixture(scope="module")
def lime_ck():
    tok = tiny_tokenizer()
    return Checkpoint("m", "m", tiny_model("lime", tok, seed=0), tok)


def test_analysis_rows_match_the_probes_on_extracted_activations(lime_ck):
    texts = CORPUS * 2
    kw = Extraction(max_length=24, progress=False)
    res = ANALYSES["metrics"].run([lime_ck], texts, kw, seed=1)
    acts = extract(lime_ck.model, lime_ck.tokenizer, texts, sites=["hidden"], max_length=24, progress=False)
    layers = acts.layers("hidden")
    by = {(r["metric"], r["layer"]): r for r in res.rows}
    assert {m for m, _ in by} == set(METRICS)
    for la in layers:
        seqs = [z.double().numpy() for z in acts.sequences("hidden", la)]
        X = np.concatenate(seqs)
        assert by["effective-rank", la]["value"] == pytest.approx(effective_rank(X, center=True), rel=1e-9)
        assert by["curvature", la]["value"] == pytest.approx(
            np.mean([curvature_loop(z, False) for z in seqs if len(z) > 2]), rel=1e-9
        )
        assert by["dataset-entropy", la]["value"] == pytest.approx(skean_dataset_entropy(seqs, 1.0), rel=1e-9)
        assert by["twonn", la]["n"] == len(X)  # under the default cap: every token row
        assert by["twonn", la]["value"] == pytest.approx(twonn_loop(np.unique(X, axis=0))[0], rel=1e-9)
    for la in layers[:-1]:
        X, Y = acts["hidden"][la].double().numpy(), acts["hidden"][la + 1].double().numpy()
        cos = (X * Y).sum(1) / np.linalg.norm(X, axis=1) / np.linalg.norm(Y, axis=1)
        want = np.mean(np.arccos(np.clip(cos, -1, 1))) / math.pi
        assert by["angular-distance", la]["value"] == pytest.approx(want, rel=1e-6)
        assert by["angular-distance", la]["layer_to"] == la + 1
    assert ("angular-distance", layers[-1]) not in by
    assert by["lidar", 0]["n"] == len(texts)
    # tiny_model builds from its config after seeding torch with its seed: seed 0 rebuilds it untrained
    assert all(by["diff-erank", la]["value"] != 0 for la in layers)
    same = ANALYSES["metrics"].run([lime_ck], texts, kw, metric="diff-erank", seed=0)
    assert [r["value"] for r in same.rows] == [0.0] * len(layers)
    assert set(ANALYSES["metrics"].plot(res)) == {f"{m}_hidden" for m in METRICS}


def test_parameters_are_checked():
    from lime_probe.specs.metrics import MetricsParams

    with pytest.raises(ValueError, match="--alpha"):
        MetricsParams(alpha=0)
    with pytest.raises(ValueError, match="--shift must be a positive integer"):
        MetricsParams(shift=0)
    with pytest.raises(ValueError, match="LiDAR needs at least 2 views"):
        MetricsParams(metric="lidar", augmentations=1)


@pytest.fixture(scope="module")
def ckpt_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    data = root / "texts.txt"
    data.write_text("\n\n".join(CORPUS) + "\n")
    return save_tiny_checkpoint(root / "llama", "llama"), data


def test_command_writes_the_table_and_chart(capsys, tmp_path, ckpt_and_data):
    ckpt, data = ckpt_and_data
    out = tmp_path / "o"
    argv = ["metrics", "--ckpt", ckpt, "--data", data, "--metric", "angular-distance", "--max-length", "16"]
    code = cli.main([str(a) for a in [*argv, "--shift", "2", "--no-cache", "--out", out]])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "metrics_angular-distance_hidden.json").read_text())
    assert (out / "metrics_angular-distance_hidden.csv").is_file()
    assert (out / "angular-distance_hidden.png").is_file()
    rows = doc["rows"]
    assert [(r["layer"], r["layer_to"]) for r in rows] == [(0, 2)]  # the tiny model: X_0..X_2
    acts = extract(*_load(ckpt), CORPUS, sites=["hidden"], max_length=16, progress=False)
    X, Y = acts["hidden"][0].double().numpy(), acts["hidden"][2].double().numpy()
    cos = (X * Y).sum(1) / np.linalg.norm(X, axis=1) / np.linalg.norm(Y, axis=1)
    assert rows[0]["value"] == pytest.approx(np.mean(np.arccos(np.clip(cos, -1, 1))) / math.pi, rel=1e-6)


def _load(ckpt):
    from lime_probe.extraction.loading import load

    return load(ckpt)


def test_a_bad_metric_is_one_line_and_exit_2(capsys, tmp_path, ckpt_and_data):
    ckpt, data = ckpt_and_data
    out = tmp_path / "o"
    code = cli.main(
        ["metrics", "--ckpt", str(ckpt), "--data", str(data), "--metric", "twonm", "--out", str(out)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--metric" in err and "twonm" in err
    assert not out.exists()
