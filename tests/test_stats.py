"""Paired differences across seeds against the t-interval and t-test written from the formulas
(`plain_stats`), plain loops written from the formulas (bootstrap, Holm, Benjamini-Hochberg, sign-flip
enumeration) and a noncentral-t power computation."""

import itertools
import math

import numpy as np
import pytest
from plain_stats import bh_loop, holm_loop, paired_t, t_quantile
from scipy import stats as sps

from lime_probe.probes.stats import (
    MIN_BOOTSTRAP_SEEDS,
    benjamini_hochberg,
    holm,
    median_ci,
    paired_bootstrap_ci,
    paired_difference,
    paired_t_mde,
    sign_flip_p,
)


def test_paired_difference_is_the_t_interval_from_the_formula():
    a = [5.1, 4.8, 5.6, 5.0]
    b = [4.9, 4.9, 5.1, 4.6]
    mean, lo, hi, p = paired_t(a, b, level=0.9)
    assert t_quantile(0.95, 3) == pytest.approx(2.353363, abs=1e-6)  # the printed tables' value
    d = paired_difference(a, b, level=0.9)
    assert d.mean == pytest.approx(mean) and (d.ci_low, d.ci_high) == pytest.approx((lo, hi), rel=1e-12)
    assert d.std == pytest.approx(math.sqrt(sum((x - y - mean) ** 2 for x, y in zip(a, b, strict=True)) / 3))
    assert d.pairs == pytest.approx(tuple(x - y for x, y in zip(a, b, strict=True))) and d.n == 4
    # the interval excludes 0 at level 0.9 exactly when the two-sided p is below 0.1
    assert d.p == pytest.approx(p, rel=1e-9) and (d.verdict != "not resolved") == (p < 0.1)


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
    n = MIN_BOOTSTRAP_SEEDS
    rng = np.random.default_rng(3)
    a = rng.normal(1.0, 0.3, size=(n, 40))
    b = a - 0.2 + rng.normal(0, 0.1, size=(n, 40))
    lo, hi = paired_bootstrap_ci(a, b, level=0.9, n_boot=300, seed=7)
    # The same two-level resampling written out as loops over replicates, seeds and items.
    rng = np.random.default_rng(7)
    seeds = rng.integers(0, n, size=(300, n))
    items = rng.integers(0, 40, size=(300, n, 40))
    means = []
    for r in range(300):
        total = 0.0
        for k in range(n):
            s = seeds[r, k]
            total += sum(a[s, i] - b[s, i] for i in items[r, k]) / 40
        means.append(total / n)
    assert (lo, hi) == pytest.approx(tuple(np.quantile(means, [0.05, 0.95])))
    assert lo < 0.2 < hi


def test_paired_bootstrap_refuses_too_few_seeds_and_names_the_minimum():
    a = np.ones((MIN_BOOTSTRAP_SEEDS - 1, 5))
    with pytest.raises(ValueError, match=f"at least {MIN_BOOTSTRAP_SEEDS} seeds"):
        paired_bootstrap_ci(a, a)
    # the stated reason: at 3 seeds only C(5, 3) = 10 distinct multisets of seeds can be drawn
    assert len(set(itertools.combinations_with_replacement(range(3), 3))) == 10


def test_paired_difference_p_values_and_mde():
    a = np.array([5.1, 4.8, 5.6, 5.0, 5.3])
    b = np.array([4.9, 4.9, 5.1, 4.6, 5.0])
    d = paired_difference(a, b)
    assert d.p == pytest.approx(paired_t(a, b)[3], rel=1e-9)
    assert d.p_sign_flip == sign_flip_p(a - b)
    assert d.mde == pytest.approx(paired_t_mde(5, (a - b).std(ddof=1)))
    # the interval excludes 0 exactly when the t-test's p is below 1 - level
    assert (d.verdict != "not resolved") == (d.p < 0.05)
    one = paired_difference([2.0], [1.0])
    assert (one.p, one.p_sign_flip, one.mde) == (1.0, 1.0, np.inf)
    # zero spread: a zero-width interval decides nothing; p is the exact sign-flip p (2 / 2^n)
    constant = paired_difference([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    assert constant.ci_low == constant.ci_high == 1.0
    assert constant.p == 0.25 and constant.verdict == "not resolved"
    constant10 = paired_difference(np.arange(10.0) + 0.5, np.arange(10.0))
    assert constant10.p == 2 / 2**10 and constant10.verdict == "a > b"
    assert paired_difference([1.0, 1.0], [1.0, 1.0]).p == 1.0


def test_a_constant_difference_off_in_its_last_bits_is_zero_spread():
    """0.4 - 0.3, 0.6 - 0.5 and 1.0 - 0.9 are 0.1 up to rounding: the zero-spread rule applies (p 0.25 at
    3 seeds), not a t-test on a spread of 3e-17 (p 4e-32)."""
    d = paired_difference([0.4, 0.6, 1.0], [0.3, 0.5, 0.9])
    assert len(set(d.pairs)) == 2  # the differences are not bitwise equal
    assert d.std == 0 and d.ci_low == d.ci_high == d.mean
    assert d.p == d.p_sign_flip == 0.25 and d.verdict == "not resolved"
    # a spread just above the values' rounding is a spread
    assert paired_difference([0.4, 0.6, 1.0 + 1e-9], [0.3, 0.5, 0.9]).std > 0


def test_sign_flip_p_of_a_hand_enumerated_case():
    # d = (1, 2, -0.5), sum 2.5. The 8 signed sums: +-3.5, +-2.5, +-1.5, +-0.5; |sum| >= 2.5 for 4 of 8.
    assert sign_flip_p([1.0, 2.0, -0.5]) == 0.5
    # all of one sign: only the observed pattern and its mirror reach |sum(d)|
    assert sign_flip_p([0.3, 0.1, 0.2, 0.5, 0.4]) == 2 / 32
    assert sign_flip_p([0.1, 0.2, 0.3]) == 0.25  # the floor at 3 seeds
    assert sign_flip_p([0.0, 0.0]) == 1.0


def test_sign_flip_p_against_itertools_and_scipy_permutation_test():
    d = np.random.default_rng(5).normal(0.3, 1.0, size=9)
    hand = np.mean(
        [
            abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= abs(d.sum()) - 1e-12
            for signs in itertools.product((1, -1), repeat=d.size)
        ]
    )
    assert sign_flip_p(d) == pytest.approx(hand)
    ref = sps.permutation_test(
        (d,), np.mean, permutation_type="samples", n_resamples=np.inf, alternative="two-sided"
    )
    assert sign_flip_p(d) == pytest.approx(ref.pvalue)
    with pytest.raises(ValueError, match="at most 20 pairs"):
        sign_flip_p(np.ones(21))


def _power(n, delta, sd, alpha=0.05):
    """Power of a two-sided paired t-test, from scipy's noncentral t."""
    crit = sps.t.ppf(1 - alpha / 2, n - 1)
    nc = delta * np.sqrt(n) / sd
    return sps.nct.sf(crit, n - 1, nc) + sps.nct.cdf(-crit, n - 1, nc)


@pytest.mark.parametrize("n", [3, 5, 10, 30])
def test_mde_is_the_effect_with_the_stated_power(n):
    mde = paired_t_mde(n, 0.1, alpha=0.05, power=0.8)
    assert _power(n, mde, 0.1) == pytest.approx(0.8, abs=1e-6)
    assert _power(n, 0.99 * mde, 0.1) < 0.8 < _power(n, 1.01 * mde, 0.1)


def test_mde_against_a_simulation_and_the_normal_approximation():
    # a simulated paired t-test at the MDE rejects about 80 % of the time
    n, sd = 5, 1.0
    mde = paired_t_mde(n, sd)
    d = np.random.default_rng(0).normal(mde, sd, size=(20000, n))
    rejected = sps.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05
    assert rejected.mean() == pytest.approx(0.8, abs=0.01)
    # for many pairs, (z_{0.975} + z_{0.8}) sd / sqrt(n)
    assert paired_t_mde(400, 1.0) == pytest.approx((1.959964 + 0.841621) / 20, rel=0.005)
    with pytest.raises(ValueError, match="at least 2 pairs"):
        paired_t_mde(1, 1.0)


def test_holm_and_bh_against_plain_loops():
    p = [0.01, 0.04, 0.03, 0.2, 0.005, 0.04, 0.9]
    assert holm(p) == pytest.approx(holm_loop(p))
    assert benjamini_hochberg(p) == pytest.approx(bh_loop(p))
    # by hand: sorted 0.005, 0.01, 0.03, 0.04, 0.04, 0.2, 0.9 -> Holm 7x, 6x, 5x, 4x, 3x (monotone), ...
    assert holm(p)[4] == pytest.approx(0.035) and holm(p)[0] == pytest.approx(0.06)
    assert holm(p)[2] == pytest.approx(0.15) and holm(p)[1] == holm(p)[5] == pytest.approx(0.16)
    rng = np.random.default_rng(1)
    for _ in range(20):
        q = rng.uniform(size=16) ** 3
        assert holm(q) == pytest.approx(holm_loop(list(q)))
        assert benjamini_hochberg(q) == pytest.approx(bh_loop(list(q)))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([0.5, 1.5])
    with pytest.raises(ValueError, match=r"benjamini_hochberg: p-values must lie in \[0, 1\]"):
        benjamini_hochberg([0.5, -0.1])


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
