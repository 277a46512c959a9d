"""2-D t-SNE maps of token representations (paper Figures 3 and 8), with openTSNE.

The figures embed the representations of chosen tokens (e.g. every occurrence of " is", " are",
" was", " were") at one layer; a collapsed layer shows the words mixed together.

Rows are L2-normalised before the embedding by default, as the official code does
(src/analysis/representations.py, `sklearn.preprocessing.normalize` before `TSNE`): the map then shows
directions, not norms. ``l2_normalize=False`` embeds the raw rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm


def tsne_embed(
    X: np.ndarray | torch.Tensor,
    perplexity: float = 30.0,
    seed: int = 0,
    n_jobs: int = 1,
    l2_normalize: bool = True,
    **tsne_kwargs: Any,
) -> np.ndarray:
    """openTSNE embedding of X (n, d) -> (n, 2) float64, deterministic for a given `seed`.

    l2_normalize: divide each row by its L2 norm first (the official code; all-zero rows stay zero).

    openTSNE's defaults otherwise (PCA initialisation, exact neighbours below 1,000 points, 250
    early-exaggeration + 500 iterations); `tsne_kwargs` go to `openTSNE.TSNE`. Determinism holds for
    n_jobs=1 (the default). Perplexity is not clamped: each point needs 3 * perplexity neighbours, so
    n > 3 * perplexity is required and a smaller n raises ValueError.
    """
    from openTSNE import TSNE

    X = X.detach().cpu().numpy() if isinstance(X, torch.Tensor) else np.asarray(X)
    if X.ndim != 2 or X.shape[1] < 1:
        raise ValueError(f"tsne_embed: X must have shape (n, d), got {X.shape}")
    if not (perplexity > 0 and np.isfinite(perplexity)):
        raise ValueError(f"tsne_embed: perplexity must be a finite number > 0, got {perplexity}")
    n = X.shape[0]
    if n <= 3 * perplexity:
        raise ValueError(
            f"tsne_embed: {n} points are too few for perplexity {perplexity} (needs n > 3 * perplexity); "
            f"use perplexity < {n / 3:g} or more points"
        )
    if not np.isfinite(X).all():
        raise ValueError("tsne_embed: X contains NaN or Inf")
    X = X.astype(np.float64)
    if l2_normalize:
        norms = np.linalg.norm(X, axis=1, keepdims=True)
        X = X / np.where(norms > 0, norms, 1.0)
    tsne = TSNE(n_components=2, perplexity=perplexity, random_state=seed, n_jobs=n_jobs, **tsne_kwargs)
    return np.asarray(tsne.fit(X), dtype=np.float64)


def tsne_layers(
    features: Mapping[Any, np.ndarray | torch.Tensor] | Sequence[np.ndarray | torch.Tensor],
    perplexity: float = 30.0,
    seed: int = 0,
    progress: bool = True,
    l2_normalize: bool = True,
    **tsne_kwargs: Any,
) -> dict[Any, np.ndarray]:
    """`tsne_embed` of every layer: {layer: (n, d)} or [(n, d)] -> {layer: (n, 2)}, each with the same seed."""
    items = list(features.items()) if isinstance(features, Mapping) else list(enumerate(features))
    if not items:
        raise ValueError("tsne_layers: no layers given")
    out = {}
    for layer, X in tqdm(items, desc="t-SNE", unit="layer", disable=not progress):
        try:
            out[layer] = tsne_embed(
                X, perplexity=perplexity, seed=seed, l2_normalize=l2_normalize, **tsne_kwargs
            )
        except ValueError as e:
            raise ValueError(f"layer {layer}: {e}") from None
    return out
