"""Summaries of a per-sequence statistic: mean, standard deviation and a bootstrap confidence interval.

The paper reports per-layer entropies as mean and std over sequences with a 95 % bootstrap
confidence interval of the mean (Table 13); `summarize` computes exactly those three numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


@dataclass(frozen=True)
class Summary:
    """Mean, std (ddof=0, as `np.std` in the official code) and a percentile-bootstrap CI of the mean."""

    mean: float
    std: float
    ci_low: float
    ci_high: float
    n: int
    level: float


def _as_finite_1d(values: ArrayLike, what: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"{what}: expected a non-empty 1-D array, got shape {v.shape}")
    if not np.isfinite(v).all():
        raise ValueError(f"{what}: contains NaN or Inf")
    return v


def bootstrap_ci(
    values: ArrayLike, level: float = 0.95, n_boot: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the mean of `values` (n,).

    Resamples the n values with replacement `n_boot` times (seeded, so deterministic) and returns the
    (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled means. With n = 1 the interval
    collapses to the single value.
    """
    v = _as_finite_1d(values, "bootstrap_ci")
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_ci: level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"bootstrap_ci: n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    # Drawn in blocks so that memory stays bounded for long value lists.
    block = max(1, 2**22 // v.size)
    means = np.concatenate(
        [
            v[rng.integers(0, v.size, size=(min(block, n_boot - i), v.size))].mean(axis=1)
            for i in range(0, n_boot, block)
        ]
    )
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def summarize(values: ArrayLike, level: float = 0.95, n_boot: int = 1000, seed: int = 0) -> Summary:
    """`Summary` of `values` (n,): mean, std (ddof=0) and `bootstrap_ci(values, level, n_boot, seed)`."""
    v = _as_finite_1d(values, "summarize")
    lo, hi = bootstrap_ci(v, level=level, n_boot=n_boot, seed=seed)
    return Summary(
        mean=float(v.mean()), std=float(v.std()), ci_low=lo, ci_high=hi, n=int(v.size), level=level
    )
