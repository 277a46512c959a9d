"""The committed 10-seed language-model study (figures/lm-cpu-10-seeds): its four primary endpoints
recomputed independently from the per-run tables (numpy means, scipy's t, a plain loop over all 2^10
sign patterns, Holm by hand) and checked against differences.csv and the numbers its README and
docs/results.md quote."""

import csv
import functools
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "figures" / "lm-cpu-10-seeds"
SEEDS = range(10)
# (measure, model, reference, the sign stated in advance or None), in the protocol's order
PRIMARIES = [
    ("value entropy", "LIMe", "LLaMA", +1),
    ("perplexity", "LIMe", "LLaMA", -1),
    ("value entropy", "LIMe-LLaMA-kv-init", "LLaMA", None),
    ("value entropy", "LIMe", "LIMe-LLaMA-kv-init", None),
]


@functools.cache
def read_csv(name):
    with open(FOLDER / name) as f:
        return list(csv.DictReader(f))


def per_seed(measure, model):
    if measure == "perplexity":
        rows = {
            int(r["seed"]): float(r["perplexity"]) for r in read_csv("perplexity.csv") if r["model"] == model
        }
        return np.array([rows[s] for s in SEEDS])
    # Mean over the 16 layers of the W_V output's entropy, one number per seed.
    rows = [r for r in read_csv("entropy.csv") if r["model"] == model and r["site"] == "values"]
    out = []
    for s in SEEDS:
        layers = {int(r["layer"]): float(r["entropy_mean"]) for r in rows if int(r["seed"]) == s}
        assert sorted(layers) == list(range(16))
        out.append(np.mean([layers[k] for k in range(16)]))
    return np.array(out)


def sign_flip_p(d):
    observed = abs(d.mean())
    flips = [
        abs(np.mean(d * np.array(signs))) >= observed - 1e-12 for signs in product((1, -1), repeat=len(d))
    ]
    return np.mean(flips)


def verdict(low, high, sign):
    if low > 0 or high < 0:
        direction = 1 if low > 0 else -1
        if sign is None:
            return "higher" if direction > 0 else "lower"
        return "holds" if direction == sign else "reversed"
    return "not resolved"


def fmt(x):
    return f"{x:+.4g}"


@pytest.fixture(scope="module")
def recomputed():
    out = []
    for measure, model, reference, sign in PRIMARIES:
        d = per_seed(measure, model) - per_seed(measure, reference)
        n = len(d)
        half = sps.t.ppf(0.975, n - 1) * d.std(ddof=1) / np.sqrt(n)
        p_t = sps.ttest_1samp(d, 0.0).pvalue
        out.append(
            dict(
                measure=measure,
                model=model,
                reference=reference,
                mean=d.mean(),
                low=d.mean() - half,
                high=d.mean() + half,
                p_t=p_t,
                p_flip=sign_flip_p(d),
                verdict=verdict(d.mean() - half, d.mean() + half, sign),
            )
        )
    ps = np.array([r["p_t"] for r in out])
    running = 0.0
    for rank, i in enumerate(np.argsort(ps)):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i]["p_holm"] = running
    return out


def test_the_four_primary_endpoints_match_an_independent_recomputation(recomputed):
    rows = [r for r in read_csv("differences.csv") if r["role"] == "primary"]
    assert len(rows) == 4
    for want, got in zip(recomputed, rows, strict=True):
        assert (got["measure"], got["model"], got["reference"]) == (
            want["measure"],
            want["model"],
            want["reference"],
        )
        for key, col in (
            ("mean", "diff_mean"),
            ("low", "ci_low"),
            ("high", "ci_high"),
            ("p_t", "p_t"),
            ("p_flip", "p_sign_flip"),
            ("p_holm", "p_holm"),
        ):
            assert float(got[col]) == pytest.approx(want[key], rel=1e-9), (
                got["model"],
                got["reference"],
                col,
            )
        assert got["verdict"] == want["verdict"]


def test_the_readmes_quote_the_recomputed_intervals_and_verdicts(recomputed):
    folder_readme = (FOLDER / "README.md").read_text()
    results_row = next(
        line
        for line in (ROOT / "docs" / "results.md").read_text().splitlines()
        if "(../figures/lm-cpu-10-seeds/)" in line
    )
    for r in recomputed:
        interval = f"{fmt(r['mean'])} [{fmt(r['low'])}, {fmt(r['high'])}]"
        row = next((line for line in folder_readme.splitlines() if interval in line), "")
        assert row.endswith(f"| {r['verdict']} |"), interval
    for r in recomputed[:2]:  # the paper's two claims, LIMe - LLaMA
        assert f"{fmt(r['mean'])} [{fmt(r['low'])}, {fmt(r['high'])}]" in results_row
    assert "interim" not in results_row.lower() and "interim" not in folder_readme.split("\n")[0].lower()
