"""t-SNE: shape, seeded determinism, cluster structure preserved, validation."""

import numpy as np
import pytest
import torch

from lime_probe.probes.tsne import tsne_embed, tsne_layers


def clusters(n_per=20, d=10, seed=0):
    g = np.random.default_rng(seed)
    centers = g.standard_normal((3, d)) * 10
    y = np.repeat(np.arange(3), n_per)
    return centers[y] + g.standard_normal((3 * n_per, d)), y


def knn1_agreement(E: np.ndarray, y: np.ndarray) -> float:
    """Fraction of points whose nearest other point in the embedding has the same label."""
    D = ((E[:, None] - E[None]) ** 2).sum(-1)
    np.fill_diagonal(D, np.inf)
    return float((y[D.argmin(1)] == y).mean())


def test_embedding_shape_determinism_and_structure():
    X, y = clusters()
    E = tsne_embed(torch.from_numpy(X), perplexity=10, seed=3, n_iter=200)
    assert E.shape == (60, 2) and E.dtype == np.float64 and np.isfinite(E).all()
    np.testing.assert_array_equal(E, tsne_embed(X, perplexity=10, seed=3, n_iter=200))
    assert not np.allclose(E, tsne_embed(X, perplexity=10, seed=4, n_iter=200))
    assert knn1_agreement(E, y) == 1.0  # well-separated clusters stay separated


def test_tsne_layers_names_layers():
    X, _ = clusters(n_per=8)
    out = tsne_layers({2: X, 5: X * 2}, perplexity=5, progress=False, n_iter=50)
    assert list(out) == [2, 5] and out[5].shape == (24, 2)
    with pytest.raises(ValueError, match="layer 1: .*NaN"):
        tsne_layers([X, np.full_like(X, np.nan)], perplexity=5, progress=False)


@pytest.mark.parametrize(
    "X,perplexity,match",
    [
        (np.zeros((30, 3)), 10, "30 points are too few for perplexity 10"),
        (np.zeros(30), 5, "shape"),
        (np.zeros((30, 3)), 0, "perplexity"),
    ],
)
def test_bad_input(X, perplexity, match):
    with pytest.raises(ValueError, match=match):
        tsne_embed(X, perplexity=perplexity)


def test_rows_are_l2_normalised_first_by_default():
    """The official code's sklearn `normalize` before t-SNE: the default equals embedding the normalised rows,
    so per-row rescaling changes nothing; l2_normalize=False embeds the raw rows."""
    from sklearn.preprocessing import normalize

    X, _ = clusters(n_per=12)
    E = tsne_embed(X, perplexity=5, seed=1, n_iter=100)
    # atol: inputs equal up to an ulp, which the t-SNE iterations amplify to ~1e-8
    raw = tsne_embed(normalize(X), perplexity=5, seed=1, n_iter=100, l2_normalize=False)
    np.testing.assert_allclose(E, raw, atol=1e-5)
    scale = np.random.default_rng(0).uniform(0.1, 10.0, size=(X.shape[0], 1))
    np.testing.assert_allclose(E, tsne_embed(X * scale, perplexity=5, seed=1, n_iter=100), atol=1e-5)
    assert not np.allclose(E, tsne_embed(X, perplexity=5, seed=1, n_iter=100, l2_normalize=False))
    assert np.isfinite(tsne_embed(np.vstack([X, np.zeros((1, X.shape[1]))]), perplexity=5, n_iter=50)).all()
