"""Summaries of a per-sequence statistic: mean, standard deviation and a bootstrap confidence interval.

The paper reports per-layer entropies as mean and std over sequences with a 95 % bootstrap
confidence interval of the mean (Table 13); `summarize` computes exactly those three numbers.
"""

from __future__ import annotations

import math
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


@dataclass(frozen=True)
class Difference:
    """A paired difference ``a - b`` over n pairs (seeds): mean, std (ddof=1), a t-interval, the verdict.

    ``verdict`` is ``"a > b"`` or ``"a < b"`` when the interval excludes 0, else ``"not resolved"``.
    """

    mean: float
    std: float
    ci_low: float
    ci_high: float
    n: int
    level: float
    pairs: tuple[float, ...]

    @property
    def verdict(self) -> str:
        if self.ci_low > 0:
            return "a > b"
        if self.ci_high < 0:
            return "a < b"
        return "not resolved"


def paired_difference(a: ArrayLike, b: ArrayLike, level: float = 0.95) -> Difference:
    """Mean of ``a - b`` (n,) with Student's t confidence interval (n - 1 degrees of freedom).

    The pairs are independent replicates (one per training seed), so the interval is
    ``mean +- t_{(1+level)/2, n-1} * std / sqrt(n)``. With n = 1 there is no spread to estimate and
    the interval is infinite.
    """
    from scipy.stats import t as student_t

    a, b = _as_finite_1d(a, "paired_difference a"), _as_finite_1d(b, "paired_difference b")
    if a.shape != b.shape:
        raise ValueError(f"paired_difference: a has {a.size} values, b has {b.size}; they must pair up")
    if not 0.0 < level < 1.0:
        raise ValueError(f"paired_difference: level must be in (0, 1), got {level}")
    d = a - b
    n = d.size
    std = float(d.std(ddof=1)) if n > 1 else float("nan")
    half = float(student_t.ppf((1 + level) / 2, n - 1) * std / np.sqrt(n)) if n > 1 else float("inf")
    mean = float(d.mean())
    return Difference(mean, std, mean - half, mean + half, n, level, tuple(float(x) for x in d))


def paired_bootstrap_ci(
    a: ArrayLike, b: ArrayLike, level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Two-level percentile bootstrap CI of ``mean(a - b)`` for ``a, b`` of shape (seeds, items).

    Items (e.g. text windows) are shared by both models, so each replicate resamples seeds, then item
    indices, and applies the same indices to ``a`` and ``b``: the interval covers both the spread
    over training seeds and the sampling of the text.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or a.shape != b.shape or a.size == 0:
        raise ValueError(
            f"paired_bootstrap_ci: expected two equal (seeds, items) arrays, got {a.shape}, {b.shape}"
        )
    d = a - b
    n_seeds, n_items = d.shape
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, n_seeds, size=(n_boot, n_seeds))
    items = rng.integers(0, n_items, size=(n_boot, n_seeds, n_items))
    means = d[seeds[..., None], items].mean(axis=(1, 2))
    lo, hi = np.quantile(means, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(lo), float(hi)


def median_ci_rank(n: int, level: float = 0.95) -> tuple[int, float]:
    """The order statistic ``k`` of :func:`median_ci` for ``n`` values, and the interval's coverage.

    ``(x_(k), x_(n+1-k))`` covers the population median with probability
    ``1 - 2 P(Binomial(n, 1/2) < k)`` whatever the distribution (independent draws); ``k`` is the
    largest whose coverage is at least ``level``, or 1 (min, max) when none reaches it (below 6 values
    at 95 %).
    """
    if n < 1:
        raise ValueError(f"median_ci_rank: need at least one value, got n = {n}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"median_ci: level must be in (0, 1), got {level}")

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n

    k = 1
    while 2 * (k + 1) <= n + 1 and coverage(k + 1) >= level:
        k += 1
    return k, coverage(k)


def median_ci(values: ArrayLike, level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free confidence interval of the median of ``values`` (n,), from order statistics
    (:func:`median_ci_rank`). Returns ``(low, high, coverage)``."""
    v = np.sort(_as_finite_1d(values, "median_ci"))
    k, coverage = median_ci_rank(v.size, level)
    return float(v[k - 1]), float(v[v.size - k]), coverage
