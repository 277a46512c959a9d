"""Linear CKA (plain, debiased, across models, streamed) and effective rank against closed forms, the
paper's HSIC_1 formula, a U-statistic loop and invariances."""

import itertools

import numpy as np
import pytest
import torch

from lime_probe.probes.similarity import CkaStream, cka_matrix, effective_rank, effective_ranks, linear_cka


def kernel_cka(X: np.ndarray, Y: np.ndarray) -> float:
    """CKA in its kernel form with the centring matrix H: tr(KHLH) / sqrt(tr(KHKH) tr(LHLH))."""
    n = X.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    K, L = X @ X.T, Y @ Y.T
    hsic = lambda A, B: np.trace(A @ H @ B @ H)  # noqa: E731
    return hsic(K, L) / np.sqrt(hsic(K, K) * hsic(L, L))


def hsic1(K: np.ndarray, L: np.ndarray) -> float:
    """Song et al. (2012), eq. (5): the unbiased HSIC estimator, K~ and L~ the Grams with zero diagonal."""
    n = K.shape[0]
    Kt, Lt, one = K - np.diag(np.diag(K)), L - np.diag(np.diag(L)), np.ones(n)
    return (
        np.trace(Kt @ Lt)
        + (one @ Kt @ one) * (one @ Lt @ one) / ((n - 1) * (n - 2))
        - 2 / (n - 2) * (one @ Kt @ Lt @ one)
    ) / (n * (n - 3))


def hsic1_loop(K: np.ndarray, L: np.ndarray) -> float:
    """HSIC_1 as the U-statistic it is (Song et al. 2012, Theorem 2): the mean over ordered quadruples of
    distinct rows (i, j, q, r) of k_ij l_ij + k_ij l_qr - 2 k_ij l_iq."""
    terms = [
        K[i, j] * L[i, j] + K[i, j] * L[q, r] - 2 * K[i, j] * L[i, q]
        for i, j, q, r in itertools.permutations(range(K.shape[0]), 4)
    ]
    return float(np.mean(terms))


def debiased_cka(X: np.ndarray, Y: np.ndarray, hsic=hsic1) -> float:
    """Debiased linear CKA (Kornblith et al. 2019): HSIC_1 of the raw rows' linear kernels, normalised."""
    K, L = X @ X.T, Y @ Y.T
    return hsic(K, L) / np.sqrt(hsic(K, K) * hsic(L, L))


def orthogonal(d: int, seed: int) -> np.ndarray:
    return np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))[0]


@pytest.mark.parametrize("n,d1,d2", [(30, 8, 5), (10, 25, 40)])  # n > d (cross-products), n <= d (Grams)
def test_cka_matches_kernel_form(n, d1, d2):
    g = np.random.default_rng(0)
    X = g.standard_normal((n, d1))
    Y = X[:, :1] @ g.standard_normal((1, d2)) + 0.5 * g.standard_normal((n, d2))
    Z = g.standard_normal((n, 3)) + 2.0
    M = cka_matrix([X, Y, Z], progress=False)
    want = np.array([[kernel_cka(A, B) for B in (X, Y, Z)] for A in (X, Y, Z)])
    np.testing.assert_allclose(M, want, atol=1e-12)
    assert linear_cka(torch.from_numpy(X), Y) == pytest.approx(want[0, 1], abs=1e-12)


@pytest.mark.parametrize("n,d", [(40, 6), (8, 20)])
def test_cka_invariances(n, d):
    g = np.random.default_rng(1)
    X = g.standard_normal((n, d))
    Y = np.tanh(X @ g.standard_normal((d, d)))
    base = linear_cka(X, Y)
    assert linear_cka(X, X) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(X @ orthogonal(d, 2), Y) == pytest.approx(base, abs=1e-12)
    assert linear_cka(7.5 * X, Y * 0.01 + 3.0) == pytest.approx(base, abs=1e-12)  # scaling and offset
    # Not invariant to a general invertible map (a sanity check that the test can fail).
    A = np.diag(np.linspace(0.1, 10, d))
    assert abs(linear_cka(X @ A, Y) - base) > 1e-3


def test_cka_matrix_of_mapping_is_symmetric_with_unit_diagonal():
    g = np.random.default_rng(3)
    feats = {2: g.standard_normal((12, 4)), 5: g.standard_normal((12, 7)), 9: g.standard_normal((12, 3))}
    M = cka_matrix(feats, progress=False)
    assert M.shape == (3, 3)
    np.testing.assert_allclose(M, M.T)
    np.testing.assert_allclose(np.diag(M), 1.0)


@pytest.mark.parametrize("n,d,k", [(50, 10, 4), (6, 30, 6), (20, 20, 1)])
def test_effective_rank_of_rank_k_isotropic_is_k(n, d, k):
    g = np.random.default_rng(4)
    U = np.linalg.qr(g.standard_normal((n, k)))[0]
    V = np.linalg.qr(g.standard_normal((d, k)))[0]
    assert effective_rank(3.0 * U @ V.T) == pytest.approx(k, abs=1e-9)


def test_effective_rank_matches_svd_formula_and_centering():
    g = np.random.default_rng(5)
    X = g.standard_normal((25, 6)) * np.arange(1, 7) + 4.0
    s = np.linalg.svd(X, compute_uv=False)
    p = s / s.sum()
    assert effective_rank(X) == pytest.approx(np.exp(-(p * np.log(p)).sum()), abs=1e-12)
    sc = np.linalg.svd(X - X.mean(0), compute_uv=False)
    pc = sc / sc.sum()
    assert effective_rank(X, center=True) == pytest.approx(np.exp(-(pc * np.log(pc)).sum()), abs=1e-12)
    np.testing.assert_allclose(
        effective_ranks([X, 2 * X], progress=False), [effective_rank(X)] * 2, atol=1e-12
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: cka_matrix([np.ones((5, 2)), np.random.rand(5, 3)], progress=False),
            "layer 0: every feature is constant",
        ),
        (lambda: cka_matrix([np.random.rand(5, 2), np.random.rand(4, 2)], progress=False), "layer 1: 4 rows"),
        (lambda: cka_matrix({3: np.full((4, 2), np.nan)}, progress=False), "layer 3: contains NaN"),
        (lambda: cka_matrix([], progress=False), "no layers"),
        (lambda: effective_rank(np.zeros((3, 3))), "all zeros"),
        (lambda: effective_rank(np.ones(3)), "shape"),
        (lambda: effective_ranks({7: np.zeros((3, 3))}, progress=False), "layer 7"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def related(n: int, d1: int, d2: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """X (n, d1) and a noisy, offset view Y (n, d2) of it: CKA well inside (0, 1)."""
    g = np.random.default_rng(seed)
    X = g.standard_normal((n, d1))
    Y = np.tanh(X @ g.standard_normal((d1, d2)) / np.sqrt(d1)) + 0.3 * g.standard_normal((n, d2)) - 1.0
    return X + 3.0, Y


def test_hsic1_formula_is_the_u_statistic():  # the test's two readings of the paper agree
    X, Y = related(7, 3, 4, seed=0)
    K, L = X @ X.T, Y @ Y.T
    assert hsic1(K, L) == pytest.approx(hsic1_loop(K, L), rel=1e-12)
    assert linear_cka(X, Y, debiased=True) == pytest.approx(debiased_cka(X, Y, hsic1_loop), abs=1e-12)


@pytest.mark.parametrize("n,d1,d2", [(40, 6, 9), (12, 25, 30)])  # cross-products, Grams
def test_debiased_cka_matches_the_papers_formula(n, d1, d2):
    X, Y = related(n, d1, d2, seed=1)
    Z = np.random.default_rng(2).standard_normal((n, 5))
    M = cka_matrix([X, Y, Z], debiased=True, progress=False)
    want = np.array([[debiased_cka(A, B) for B in (X, Y, Z)] for A in (X, Y, Z)])
    np.testing.assert_allclose(M, want, atol=1e-12)
    assert 0.1 < want[0, 1] < 0.95


def test_debiased_cka_removes_the_bias_of_few_rows():
    g = np.random.default_rng(3)
    X, Y = g.standard_normal((100, 500)), g.standard_normal((100, 500))  # independent
    assert linear_cka(X, Y) > 0.75  # plain CKA: near 1 when n << d
    assert abs(linear_cka(X, Y, debiased=True)) < 0.02


@pytest.mark.parametrize("n,d", [(40, 6), (8, 20)])
def test_debiased_cka_invariances(n, d):
    X, Y = related(n, d, d, seed=4)
    base = linear_cka(X, Y, debiased=True)
    assert linear_cka(X, X, debiased=True) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(X @ orthogonal(d, 5), Y, debiased=True) == pytest.approx(base, abs=1e-12)
    assert linear_cka(7.5 * X - 2.0, 0.01 * Y, debiased=True) == pytest.approx(base, abs=1e-12)
    A = np.diag(np.linspace(0.1, 10, d))
    assert abs(linear_cka(X @ A, Y, debiased=True) - base) > 1e-3


@pytest.mark.parametrize("debiased", [False, True])
@pytest.mark.parametrize("n", [30, 6])  # cross-products, Grams
def test_cka_across_models(n, debiased):
    g = np.random.default_rng(6)
    A = [g.standard_normal((n, 4)) + 1.0, g.standard_normal((n, 7))]
    B = {3: np.tanh(A[0] @ g.standard_normal((4, 5))), 8: g.standard_normal((n, 2)), 9: A[1][:, :3]}
    got = cka_matrix(A, B, debiased=debiased, progress=False)
    cka = debiased_cka if debiased else kernel_cka
    np.testing.assert_allclose(got, [[cka(a, b) for b in B.values()] for a in A], atol=1e-12)


@pytest.mark.parametrize("debiased", [False, True])
def test_streamed_cka_equals_all_rows_at_once(debiased):
    g = np.random.default_rng(7)
    n = 90
    A = {la: g.standard_normal((n, 6)) @ g.standard_normal((6, 6)) * (la + 1) + 1e3 for la in range(3)}
    B = [np.tanh((A[0] - 1e3) @ g.standard_normal((6, 4))) - 50.0, g.standard_normal((n, 9)), A[2][:, :5]]
    stream = CkaStream(n_models=2, across=True)
    for lo, hi in [(0, 1), (1, 17), (17, 60), (60, 90)]:  # uneven batches, the first of one row
        stream.update({la: torch.from_numpy(X[lo:hi]).float() for la, X in A.items()}, [Y[lo:hi] for Y in B])
    A32 = {la: torch.from_numpy(X).float().double() for la, X in A.items()}  # as the stream saw it
    B32 = [torch.from_numpy(Y) for Y in B]
    assert stream.n == n
    for got, want in [
        (stream.cka(0, debiased=debiased), cka_matrix(A32, debiased=debiased, progress=False)),
        (stream.cka(1, debiased=debiased), cka_matrix(B32, debiased=debiased, progress=False)),
        (stream.cka(0, 1, debiased=debiased), cka_matrix(A32, B32, debiased=debiased, progress=False)),
        (stream.cka(1, 0, debiased=debiased), cka_matrix(B32, A32, debiased=debiased, progress=False)),
    ]:
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        stream.effective_ranks(0), effective_ranks(A32, center=True, progress=False), rtol=1e-8
    )


@pytest.mark.parametrize("n,d", [(200, 12), (20, 50)])  # more tokens than features, fewer
def test_streamed_effective_rank_equals_the_svd_of_all_rows(n, d):
    g = np.random.default_rng(8)
    X = (g.standard_normal((n, d)) * np.linspace(0.1, 5.0, d)) @ orthogonal(d, 9) + 100.0
    stream = CkaStream()
    for lo in range(0, n, 7):
        stream.update([X[lo : lo + 7]])
    assert stream.effective_ranks(0)[0] == pytest.approx(effective_rank(X, center=True), rel=1e-9)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: cka_matrix([np.random.rand(3, 2)], debiased=True, progress=False), "n >= 4"),
        (lambda: cka_matrix([np.random.rand(5, 2)], [np.random.rand(4, 2)], progress=False), "5 and 4 rows"),
        (lambda: CkaStream(2).cka(0, 1), "at least 2 token rows"),
        (lambda: CkaStream(1).update([np.random.rand(3, 2)], [np.random.rand(3, 2)]), "2 models given"),
    ],
)
def test_bad_input_across_and_debiased(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_stream_refuses_what_it_cannot_compare():
    stream = CkaStream(n_models=2)
    stream.update([np.random.rand(5, 2)], [np.random.rand(5, 3)])
    with pytest.raises(ValueError, match="only with across=True"):
        stream.cka(0, 1)
    with pytest.raises(ValueError, match="model 1 has 4 rows, model 0 5"):
        stream.update([np.random.rand(5, 2)], [np.random.rand(4, 3)])
    with pytest.raises(ValueError, match=r"model 0 has layers \['a'\], earlier \[0\]"):
        stream.update({"a": np.random.rand(5, 2)}, [np.random.rand(5, 3)])
