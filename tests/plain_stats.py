"""Reference statistics written from their formulas in plain arithmetic, for the tests of
`lime_probe.probes.stats` (which uses scipy): Student's t, the paired t-interval, Holm, Benjamini-Hochberg."""

import math


def t_two_sided_p(t: float, df: int) -> float:
    """``P(|T| >= |t|)`` for Student's t with an integer ``df``, from the finite sums of Abramowitz and
    Stegun 26.7.3 (odd df) and 26.7.4 (even df) in ``theta = atan(|t| / sqrt(df))``. Computed as one minus
    the central probability: accurate in absolute terms (about 1e-15), not relative for tiny p."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... + cos^(df-2) term)
        term = total = 1.0
        for j in range(1, df // 2):
            term *= (2 * j - 1) / (2 * j) * c2
            total += term
        central = math.sin(theta) * total
    else:  # 2/pi (theta + sin(theta) (cos + 2/3 cos^3 + ... + cos^(df-2) term)); df 1: 2 theta / pi
        term = total = math.cos(theta) if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= 2 * j / (2 * j + 1) * c2
            total += term
        central = 2 / math.pi * (theta + math.sin(theta) * total)
    return 1.0 - central


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (``q`` > 0.5) of Student's t: ``t_two_sided_p`` inverted by bisection."""
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > 2 * (1 - q) else (lo, mid)
    return (lo + hi) / 2


def paired_t(a, b, level: float = 0.95) -> tuple[float, float, float, float]:
    """Mean of the differences ``a - b``, its t-interval at ``level`` and the two-sided t-test's p,
    with loops: ``mean +- t_{(1+level)/2, n-1} sd / sqrt(n)``, ``t = mean / (sd / sqrt(n))``."""
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    half = t_quantile((1 + level) / 2, n - 1) * se
    return mean, mean - half, mean + half, t_two_sided_p(mean / se, n - 1)


def holm_loop(p) -> list[float]:
    """Holm's adjusted p-values: ascending, ``(m - rank) p`` (rank from 0) capped at 1, running maximum."""
    m = len(p)
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p[i])):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def bh_loop(p) -> list[float]:
    """Benjamini-Hochberg q-values: descending, ``m p / rank`` (rank from 1) capped at 1, running minimum."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out, running = [0.0] * m, 1.0
    for rank in range(m - 1, -1, -1):
        i = order[rank]
        running = min(running, min(1.0, p[i] * m / (rank + 1)))
        out[i] = running
    return out
