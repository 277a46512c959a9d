"""Paired differences across seeds against scipy's paired t-test and a plain-loop bootstrap."""

import numpy as np
import pytest
from scipy import stats as sps

from lime_probe.stats import median_ci, paired_bootstrap_ci, paired_difference


def test_paired_difference_matches_scipy_ttest_rel():
    a = np.array([5.1, 4.8, 5.6, 5.0])
    b = np.array([4.9, 4.9, 5.1, 4.6])
    d = paired_difference(a, b, level=0.9)
    ci = sps.ttest_rel(a, b).confidence_interval(confidence_level=0.9)
    assert d.mean == pytest.approx((a - b).mean())
    assert (d.ci_low, d.ci_high) == pytest.approx((ci.low, ci.high))
    assert d.pairs == pytest.approx(tuple(a - b)) and d.n == 4


def test_verdicts():
    assert paired_difference([3.0, 3.1, 2.9], [1.0, 1.0, 1.1]).verdict == "a > b"
    assert paired_difference([1.0, 1.0, 1.1], [3.0, 3.1, 2.9]).verdict == "a < b"
    assert paired_difference([1.0, 2.0, 0.0], [1.0, 1.0, 1.0]).verdict == "not resolved"
    one = paired_difference([2.0], [1.0])
    assert one.ci_low == -np.inf and one.verdict == "not resolved"


def test_paired_difference_rejects_bad_input():
    with pytest.raises(ValueError, match="pair up"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        paired_difference([1.0, np.nan], [1.0, 2.0])


def test_paired_bootstrap_ci_against_a_plain_loop():
    rng = np.random.default_rng(3)
    a = rng.normal(1.0, 0.3, size=(3, 40))
    b = a - 0.2 + rng.normal(0, 0.1, size=(3, 40))
    lo, hi = paired_bootstrap_ci(a, b, level=0.9, n_boot=500, seed=7)
    # The same two-level resampling written out as loops over replicates, seeds and items.
    rng = np.random.default_rng(7)
    seeds = rng.integers(0, 3, size=(500, 3))
    items = rng.integers(0, 40, size=(500, 3, 40))
    means = []
    for r in range(500):
        total = 0.0
        for k in range(3):
            s = seeds[r, k]
            total += sum(a[s, i] - b[s, i] for i in items[r, k]) / 40
        means.append(total / 3)
    assert (lo, hi) == pytest.approx(tuple(np.quantile(means, [0.05, 0.95])))
    assert lo < 0.2 < hi


@pytest.mark.parametrize("n", [6, 10, 12, 25])
def test_median_ci_is_the_order_statistic_interval_of_the_binomial_tables(n):
    """k from scipy's binomial CDF; the interval's empirical coverage on a skewed distribution."""
    from scipy.stats import binom

    k = max(k for k in range(1, (n + 1) // 2 + 1) if 1 - 2 * binom.cdf(k - 1, n, 0.5) >= 0.95)
    values = np.random.default_rng(n).permutation(np.arange(n, dtype=float) ** 2)
    lo, hi, coverage = median_ci(values)
    assert (lo, hi) == ((k - 1) ** 2, (n - k) ** 2)
    assert coverage == pytest.approx(1 - 2 * binom.cdf(k - 1, n, 0.5))
    draws = np.random.default_rng(0).lognormal(size=(4000, n))  # population median 1
    covered = np.mean([median_ci(d)[0] <= 1.0 <= median_ci(d)[1] for d in draws])
    assert covered == pytest.approx(coverage, abs=0.015)


def test_median_ci_with_too_few_values_returns_min_max_and_says_how_little_it_covers():
    lo, hi, coverage = median_ci([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (lo, hi, coverage) == (1.0, 5.0, 1 - 2 / 32)
    with pytest.raises(ValueError, match="level"):
        median_ci([1.0, 2.0], level=1.5)
    with pytest.raises(ValueError, match="NaN"):
        median_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="non-empty"):
        median_ci([])
