"""Layer-to-layer similarity and per-layer dimensionality (beyond the paper).

- Linear CKA (Kornblith et al. 2019): for column-centred X (n, d1) and Y (n, d2) of the same n rows
  (tokens), CKA = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F), in [0, 1]; 1 for identical representations,
  invariant to orthogonal transforms and isotropic scaling of either side.
- Effective rank (Roy & Vetterli 2007): exp of the Shannon entropy of the singular values normalised to
  sum to 1, between 1 and rank(X); of the matrix as given unless `center=True`.

All computations are in float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

Features = Sequence[torch.Tensor | np.ndarray] | Mapping[int, torch.Tensor | np.ndarray]


def _matrix(X: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    X = torch.as_tensor(X)
    if X.ndim != 2 or X.shape[0] < 2 or X.shape[1] < 1:
        raise ValueError(f"{name}: expected shape (n, d) with n >= 2 and d >= 1, got {tuple(X.shape)}")
    if not bool(torch.isfinite(X).all()):
        raise ValueError(f"{name}: contains NaN or Inf")
    return X.to(torch.float64)


def _centered(X: torch.Tensor, name: str) -> torch.Tensor:
    Xc = X - X.mean(0)
    if not bool(Xc.abs().max() > 0):
        raise ValueError(f"{name}: every feature is constant over the rows, so CKA is undefined")
    return Xc


def _layers(features: Features) -> tuple[list, list[torch.Tensor]]:
    items = list(features.items()) if isinstance(features, Mapping) else list(enumerate(features))
    if not items:
        raise ValueError("no layers given")
    names = [k for k, _ in items]
    mats = [_matrix(X, f"layer {k}") for k, X in items]
    for k, X in zip(names, mats, strict=True):
        if X.shape[0] != mats[0].shape[0]:
            raise ValueError(
                f"layer {k}: {X.shape[0]} rows, but layer {names[0]} has {mats[0].shape[0]}; CKA needs the same rows"
            )
    return names, mats


def linear_cka(X: torch.Tensor | np.ndarray, Y: torch.Tensor | np.ndarray) -> float:
    """Linear CKA between X (n, d1) and Y (n, d2), rows paired (e.g. the same tokens at two layers)."""
    return float(cka_matrix([X, Y], progress=False)[0, 1])


def cka_matrix(features: Features, progress: bool = True) -> np.ndarray:
    """Linear CKA between every pair of layers: features [(n, d_l)] or {layer: (n, d_l)} -> (L, L).

    Rows must be the same tokens in every layer. Uses n x n Gram matrices when n is at most the largest
    width (HSIC = <K_l, K_m>_F), otherwise feature cross-products (HSIC = ||X_l^T X_m||_F^2). Cost: about
    L^2 n d^2 / 2 flops for n > d (L n^2 d otherwise); for many tokens a random subsample of rows keeps it cheap.
    """
    names, mats = _layers(features)
    mats = [_centered(X, f"layer {k}") for k, X in zip(names, mats, strict=True)]
    n, L = mats[0].shape[0], len(mats)
    use_grams = n <= max(X.shape[1] for X in mats)
    grams = [X @ X.T for X in mats] if use_grams else None
    hsic = torch.empty(L, L, dtype=torch.float64)
    for i in tqdm(range(L), desc="CKA", unit="layer", disable=not progress):
        for j in range(i, L):
            h = (grams[i] * grams[j]).sum() if use_grams else (mats[i].T @ mats[j]).square().sum()
            hsic[i, j] = hsic[j, i] = h
    norms = hsic.diagonal().sqrt()
    return (hsic / torch.outer(norms, norms)).clamp_(0.0, 1.0).numpy()


def effective_rank(X: torch.Tensor | np.ndarray, center: bool = False) -> float:
    """Effective rank of X (n, d): exp(-sum p_i log p_i) with p = singular values / their sum.

    center: subtract the column means first (the rank of the token cloud around its mean).
    """
    X = _matrix(X, "effective_rank")
    if center:
        X = X - X.mean(0)
    s = torch.linalg.svdvals(X)
    if not bool(s.sum() > 0):
        raise ValueError("effective_rank: the matrix is all zeros")
    p = s / s.sum()
    return float(torch.exp(-torch.special.xlogy(p, p).sum()))


def effective_ranks(features: Features, center: bool = False, progress: bool = True) -> np.ndarray:
    """`effective_rank` of every layer: [(n_l, d_l)] or {layer: (n_l, d_l)} -> (L,) in input order."""
    items = list(features.items()) if isinstance(features, Mapping) else list(enumerate(features))
    if not items:
        raise ValueError("no layers given")
    out = []
    for k, X in tqdm(items, desc="effective rank", unit="layer", disable=not progress):
        try:
            out.append(effective_rank(X, center=center))
        except ValueError as e:
            raise ValueError(f"layer {k}: {e}") from None
    return np.array(out)
