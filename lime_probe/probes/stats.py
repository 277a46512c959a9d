"""Summaries of a per-sequence statistic, and paired comparisons of two models over training seeds.

The paper reports per-layer entropies as mean and std over sequences with a 95 % bootstrap
confidence interval of the mean (Table 13); `summarize` computes exactly those three numbers.

Comparisons over seeds (ours; the paper reports single runs): `paired_difference` gives the mean
difference with its paired t-interval, the t-test's p, the exact sign-flip permutation p and the
minimum detectable effect at that n, all in one `Difference`. Several endpoints tested together (e.g.
one per layer) are adjusted with `holm` (family-wise error) or `benjamini_hochberg` (false discovery
rate).
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


def bootstrap_ratio_ci(
    numerators: ArrayLike, denominators: ArrayLike, level: float = 0.95, n_boot: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of sum(numerators) / sum(denominators), both (n,).

    Resamples the n (numerator, denominator) pairs, e.g. per-sequence sums of a per-token quantity and
    per-sequence token counts, so the interval is that of a per-token mean with sequences as the unit.
    """
    num = _as_finite_1d(numerators, "bootstrap_ratio_ci")
    den = _as_finite_1d(denominators, "bootstrap_ratio_ci")
    if num.shape != den.shape or den.sum() <= 0:
        raise ValueError("bootstrap_ratio_ci: needs pairs of equal length with a positive denominator sum")
    rng = np.random.default_rng(seed)
    block = max(1, 2**22 // num.size)
    ratios = []
    for i in range(0, n_boot, block):
        draw = rng.integers(0, num.size, size=(min(block, n_boot - i), num.size))
        totals = den[draw].sum(axis=1)
        ratios.append(num[draw].sum(axis=1)[totals > 0] / totals[totals > 0])  # all-empty draws skipped
    lo, hi = np.quantile(np.concatenate(ratios), [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
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

    ``verdict`` is ``"a > b"`` or ``"a < b"`` when the difference is `resolved`, else ``"not resolved"``.
    Beside the interval: ``p`` (the paired t-test's two-sided p, the test the interval inverts),
    ``p_sign_flip`` (``sign_flip_p``, exact, no normality assumed) and ``mde`` (``paired_t_mde``
    at this n and the observed std, two-sided at ``1 - level`` with 80 % power: the smallest true
    difference this many seeds would resolve four times in five).
    """

    mean: float
    std: float
    ci_low: float
    ci_high: float
    n: int
    level: float
    pairs: tuple[float, ...]
    p: float = float("nan")
    p_sign_flip: float = float("nan")
    mde: float = float("nan")

    @property
    def resolved(self) -> bool:
        """The interval excludes 0; at zero spread, where the zero-width interval says nothing,
        ``p`` (then the sign-flip p) is below ``1 - level``."""
        if self.std == 0:
            return self.p < 1 - self.level
        return self.ci_low > 0 or self.ci_high < 0

    @property
    def verdict(self) -> str:
        if not self.resolved:
            return "not resolved"
        return "a > b" if self.mean > 0 else "a < b"


MDE_POWER = 0.8  # the power at which `Difference.mde` is stated (ours: the conventional 80 %)
# A spread of the differences below this share of the values' magnitude is rounding, and counts as
# zero (ours): equal differences computed as a - b differ in their last bits (0.4 - 0.3 is not
# 1.0 - 0.9), and a t-test on that spread would resolve a constant difference at any n.
ZERO_SPREAD = 1e-12


def paired_difference(a: ArrayLike, b: ArrayLike, level: float = 0.95) -> Difference:
    """Mean of ``a - b`` (n,) with Student's t confidence interval (n - 1 degrees of freedom), the
    t-test's p, the exact sign-flip p and the minimum detectable effect (see `Difference`).

    The pairs are independent replicates (one per training seed), so the interval and p are the
    one-sample t-test's on the differences (``scipy.stats.ttest_1samp``; the paired t-test):
    ``mean +- t_{(1+level)/2, n-1} * std / sqrt(n)``. With n = 1 there is no spread to estimate: the
    interval and the MDE are infinite and both p-values 1. With zero spread (every seed's difference
    equal up to rounding, `ZERO_SPREAD`, as coarse accuracies can give at few seeds) the t statistic
    is undefined: the interval has zero width and ``p`` is the exact sign-flip p instead (at least
    ``2 / 2^n``), so a constant difference over 3 seeds is not resolved (p 0.25) and over 10 is
    (p 0.002).
    """
    from scipy.stats import ttest_1samp

    a, b = _as_finite_1d(a, "paired_difference a"), _as_finite_1d(b, "paired_difference b")
    if a.shape != b.shape:
        raise ValueError(f"paired_difference: a has {a.size} values, b has {b.size}; they must pair up")
    if not 0.0 < level < 1.0:
        raise ValueError(f"paired_difference: level must be in (0, 1), got {level}")
    d = a - b
    n = d.size
    mean = float(d.mean())
    pairs = tuple(float(x) for x in d)
    if n == 1:
        inf = float("inf")
        return Difference(mean, float("nan"), -inf, inf, 1, level, pairs, 1.0, 1.0, inf)
    std = float(d.std(ddof=1))
    if std <= ZERO_SPREAD * max(np.abs(a).max(), np.abs(b).max()):
        std = 0.0
    p_sign_flip = sign_flip_p(d)
    mde = paired_t_mde(n, std, alpha=1 - level, power=MDE_POWER)
    if std == 0:
        return Difference(mean, 0.0, mean, mean, n, level, pairs, p_sign_flip, p_sign_flip, mde)
    test = ttest_1samp(d, 0.0)
    ci = test.confidence_interval(level)
    return Difference(
        mean, std, float(ci.low), float(ci.high), n, level, pairs, float(test.pvalue), p_sign_flip, mde
    )


MAX_SIGN_FLIP_PAIRS = 20  # 2^20 sign patterns (about a second); beyond that a sampled test would be needed


def sign_flip_p(d: ArrayLike) -> float:
    """Exact two-sided sign-flip permutation p-value of ``mean(d) = 0`` for paired differences ``d`` (n,).

    Under the null of a distribution symmetric about 0, each difference's sign is a fair coin, so all
    ``2^n`` sign patterns are equally likely; p is the share of patterns whose ``|sum(s * d)|`` is at
    least the observed ``|sum(d)|`` (the observed one included, so p >= 2 / 2^n: 0.25 at n = 3, 0.0625
    at n = 5, 0.002 at n = 10). Ties within 1e-12 relative count as at least. n is at most
    `MAX_SIGN_FLIP_PAIRS`.
    """
    d = _as_finite_1d(d, "sign_flip_p")
    n = d.size
    if n > MAX_SIGN_FLIP_PAIRS:
        raise ValueError(f"sign_flip_p: at most {MAX_SIGN_FLIP_PAIRS} pairs are enumerated, got {n}")
    observed = abs(d.sum())
    tol = 1e-12 * max(1.0, float(np.abs(d).sum()))
    bits = np.arange(n)
    count = 0
    block = 1 << min(n, 14)
    for start in range(0, 1 << n, block):
        codes = np.arange(start, start + block)[:, None]
        signs = 1.0 - 2.0 * ((codes >> bits) & 1)  # (block, n) of +-1
        count += int(np.count_nonzero(np.abs(signs @ d) >= observed - tol))
    return count / float(1 << n)


def paired_t_mde(n: int, sd: float, alpha: float = 0.05, power: float = MDE_POWER) -> float:
    """Minimum detectable effect of a two-sided paired t-test: the true mean difference that n pairs
    with paired standard deviation ``sd`` detect at level ``alpha`` with probability ``power``.

    The power at effect ``delta`` is ``P(|T| > t_{1-alpha/2, n-1})`` with ``T`` noncentral t (n - 1
    degrees of freedom, noncentrality ``delta sqrt(n) / sd``); the MDE solves power(delta) = ``power``.
    """
    from scipy.optimize import brentq
    from scipy.stats import nct
    from scipy.stats import t as student_t

    if n < 2:
        raise ValueError(f"paired_t_mde: need at least 2 pairs, got n = {n}")
    if not (np.isfinite(sd) and sd >= 0):
        raise ValueError(f"paired_t_mde: sd must be finite and >= 0, got {sd}")
    if not (0.0 < alpha < 1.0 and alpha < power < 1.0):
        raise ValueError(f"paired_t_mde: need 0 < alpha < power < 1, got alpha {alpha}, power {power}")
    df = n - 1
    crit = student_t.ppf(1 - alpha / 2, df)

    def shortfall(effect: float) -> float:  # power at a standardised effect (delta / sd), minus the target
        nc = effect * np.sqrt(n)
        # scipy's nct.cdf can return NaN far in its lower tail (nc of ~10 and more), where it is ~0
        return nct.sf(crit, df, nc) + np.nan_to_num(nct.cdf(-crit, df, nc)) - power

    high = 1.0
    while shortfall(high) < 0:
        high *= 2
    return float(brentq(shortfall, 0.0, high, xtol=1e-10) * sd)


def holm(p: ArrayLike) -> np.ndarray:
    """Holm's step-down adjusted p-values (m,) of ``p`` (m,): reject where adjusted p <= alpha, and the
    chance of any false rejection among the m stays <= alpha whatever their dependence.

    With the p-values sorted ascending, ``adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))`` (1-based),
    returned in the input's order.
    """
    p = _as_probabilities(p, "holm")
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out


def benjamini_hochberg(p: ArrayLike) -> np.ndarray:
    """Benjamini-Hochberg q-values (m,) of ``p`` (m,): rejecting where q <= alpha keeps the expected
    share of false rejections among the rejected <= alpha (independent or positively dependent tests).

    With the p-values sorted ascending, ``q_(i) = min_{j >= i} min(1, m p_(j) / j)`` (1-based), returned
    in the input's order (``scipy.stats.false_discovery_control``).
    """
    from scipy.stats import false_discovery_control

    return false_discovery_control(_as_probabilities(p, "benjamini_hochberg"), method="bh")


def _as_probabilities(p: ArrayLike, what: str) -> np.ndarray:
    p = _as_finite_1d(p, what)
    if (p < 0).any() or (p > 1).any():
        raise ValueError(f"{what}: p-values must lie in [0, 1]")
    return p


# The seed level of a percentile bootstrap over n seeds has the spread of a mean with ddof = 0 and
# normal quantiles, so its interval is about 1.96 sqrt((n - 1) / n) / t_{0.975, n-1} of the t-interval's
# width: 0.37 at 3 seeds (which also give only 10 distinct resamples), 0.63 at 5, 0.82 at 10. Ours: from
# 10 seeds on it is within a fifth of the t-interval.
MIN_BOOTSTRAP_SEEDS = 10


def paired_bootstrap_ci(
    a: ArrayLike, b: ArrayLike, level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Two-level percentile bootstrap CI of ``mean(a - b)`` for ``a, b`` of shape (seeds, items).

    Items (e.g. text windows) are shared by both models, so each replicate resamples seeds, then item
    indices, and applies the same indices to ``a`` and ``b``: the interval covers both the spread
    over training seeds and the sampling of the text.

    Refuses fewer than `MIN_BOOTSTRAP_SEEDS` seeds: with 3 seeds there are only 10 distinct multisets
    to resample, and below about 10 the seed level is much narrower than the t-interval (see the
    constant); use `paired_difference` there.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or a.shape != b.shape or a.size == 0:
        raise ValueError(
            f"paired_bootstrap_ci: expected two equal (seeds, items) arrays, got {a.shape}, {b.shape}"
        )
    if a.shape[0] < MIN_BOOTSTRAP_SEEDS:
        raise ValueError(
            f"paired_bootstrap_ci: needs at least {MIN_BOOTSTRAP_SEEDS} seeds to resample, got "
            f"{a.shape[0]} (use the paired t-interval)"
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
    """The order statistic ``k`` of ``median_ci`` for ``n`` values, and the interval's coverage.

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
    (``median_ci_rank``). Returns ``(low, high, coverage)``."""
    v = np.sort(_as_finite_1d(values, "median_ci"))
    k, coverage = median_ci_rank(v.size, level)
    return float(v[k - 1]), float(v[v.size - k]), coverage
