"""Linear CKA and effective rank against closed forms, a kernel-form loop and invariances."""

import numpy as np
import pytest
import torch

from lime_probe.probes.similarity import cka_matrix, effective_rank, effective_ranks, linear_cka


def kernel_cka(X: np.ndarray, Y: np.ndarray) -> float:
    """CKA in its kernel form with the centring matrix H: tr(KHLH) / sqrt(tr(KHKH) tr(LHLH))."""
    n = X.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    K, L = X @ X.T, Y @ Y.T
    hsic = lambda A, B: np.trace(A @ H @ B @ H)  # noqa: E731
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
