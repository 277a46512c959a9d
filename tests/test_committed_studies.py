"""The committed learning-rate sweep (figures/lm-cpu-lr-sweep): its choice recomputed from the per-run
curves by a plain loop, the numbers its README quotes, and the fair comparison's declaration held equal
to the committed choice."""

import ast
import csv
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest

from lime_probe.studies import STUDIES

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "figures" / "lm-cpu-lr-sweep"


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def sweep():
    """{model: [validation loss at the last logged step of each seed, in seed order]}, from curves.csv."""
    last: dict[tuple[str, int], tuple[float, float]] = {}
    for r in read_csv(SWEEP / "curves.csv"):
        if r["val_loss"]:
            key, step = (r["model"], int(r["seed"])), float(r["step"])
            if key not in last or step > last[key][0]:
                last[key] = (step, float(r["val_loss"]))
    out: dict[str, list[float]] = {}
    for (model, _seed), (_, loss) in sorted(last.items()):
        out.setdefault(model, []).append(loss)
    return out


def test_the_sweep_choice_is_the_lowest_mean_validation_loss_per_family(sweep):
    study = STUDIES["lm-cpu-lr-sweep"]
    assert set(sweep) == set(study.models) and all(len(v) == len(study.seeds) for v in sweep.values())
    table = {r["model"]: r for r in read_csv(SWEEP / "selection.csv")}
    for family, labels in study.select.families.items():
        means = {m: float(np.mean(sweep[m])) for m in labels}
        best = min(labels, key=lambda m: math.inf if math.isnan(means[m]) else means[m])
        for m in labels:
            row = table[m]
            assert row["family"] == family and float(row["mean"]) == pytest.approx(means[m], rel=1e-12)
            assert float(row["std"]) == pytest.approx(np.std(sweep[m], ddof=1), rel=1e-9)
            assert (row["chosen"] == "True") == (m == best), m


def test_the_fair_comparison_trains_each_model_at_the_committed_choice():
    chosen = {r["family"]: r for r in read_csv(SWEEP / "selection.csv") if r["chosen"] == "True"}
    fair = STUDIES["lm-cpu-fair"].models
    for family in ("LIMe", "LLaMA"):
        assert dict(fair[family]) == ast.literal_eval(chosen[family]["overrides"]), family
    # the other arms differ from the chosen settings in one named override each
    assert {k: v for k, v in fair["LIMe-router-x1"].items() if fair["LIMe"].get(k) != v} == {
        "router_lr_mult": 1
    }
    assert {k: v for k, v in fair["LIMe-LLaMA-kv-init"].items() if fair["LIMe"].get(k) != v} == {
        "model.kv_proj_init": "normal"
    }
    assert {k: v for k, v in fair["LLaMA-torch-kv-init"].items() if fair["LLaMA"].get(k) != v} == {
        "model.kv_proj_init": "torch"
    }


def test_the_sweep_readme_quotes_the_recomputed_means(sweep):
    text = (SWEEP / "README.md").read_text()
    table = next(line for line in text.splitlines() if line.startswith("| LLaMA | base 3e-3"))
    assert f"{np.mean(sweep['LLaMA-lr3e-3']):.4f} ({np.std(sweep['LLaMA-lr3e-3'], ddof=1):.4f})" in table
    assert f"{np.mean(sweep['LLaMA-lr1e-2']):.4f} ({np.std(sweep['LLaMA-lr1e-2'], ddof=1):.4f})" in table
    table = next(line for line in text.splitlines() if line.startswith("| LIMe | base 3e-3"))
    for m in ("LIMe-lr3e-3-r10", "LIMe-lr1e-2-r10"):
        assert f"{np.mean(sweep[m]):.4f} ({np.std(sweep[m], ddof=1):.4f})" in table
    gap = np.mean(sweep["LIMe-lr3e-3-r10"]) - np.mean(sweep["LLaMA-lr3e-3"])
    assert f"by {gap:.3f} nats" in text
    x1, x10 = (f"{np.mean(sweep[f'LIMe-lr3e-3-r{r}']):.4f}" for r in (1, 10))
    assert f"3e-3: {x10} against {x1}" in text
    # "at each base rate LIMe's x10 router was no worse than x1"
    assert all(
        np.mean(sweep[f"LIMe-lr{lr}-r10"]) <= np.mean(sweep[f"LIMe-lr{lr}-r1"])
        for lr in ("1e-3", "3e-3", "1e-2")
    )
    assert (
        re.search(r"\*\*Status: complete, 27 of 27 trainings", text) and sum(map(len, sweep.values())) == 27
    )


def test_the_fair_studys_descriptive_numbers_are_its_tables():
    """The prose of figures/lm-cpu-fair/README.md: the probes' ranges and the retrained seeds' perplexity
    beside the 10-seed study's, read from the per-run tables."""
    fair = ROOT / "figures" / "lm-cpu-fair"
    text = " ".join((fair / "README.md").read_text().split())
    converged = min(float(r["accuracy_mean"]) for r in read_csv(fair / "separability-converged.csv"))
    one_epoch = [float(r["accuracy_mean"]) for r in read_csv(fair / "separability.csv")]
    assert f"at {100 * converged:.1f} % or more" in text
    assert f"ranges from {100 * min(one_epoch):.0f} % to {100 * max(one_epoch):.0f} %" in text

    def ppl(folder: Path, model: str, seed: int) -> float:
        rows = read_csv(folder / "perplexity.csv")
        return next(float(r["perplexity"]) for r in rows if r["model"] == model and int(r["seed"]) == seed)

    lm10 = ROOT / "figures" / "lm-cpu-10-seeds"
    pairs = [
        f"{ppl(fair, m, s):.2f} against {ppl(lm10, m, s):.2f}" for s in (0, 1) for m in ("LIMe", "LLaMA")
    ]
    assert f"LIMe perplexity {pairs[0]}" in text and f"(LLaMA {pairs[1]})" in text
    assert f"seed 1 gives {pairs[2]} and {pairs[3]}" in text
    seeds = sorted({int(r["seed"]) for r in read_csv(fair / "perplexity.csv")})
    assert "Status: complete, 10 seeds (0-9)." in text and seeds == list(range(10))
    # the machine's effect over the ten seeds, and the seed-to-seed spread
    for m, mean_abs, largest in (("LIMe", "1.30", "5.84"), ("LLaMA", "0.89", "2.46")):
        diffs = [abs(ppl(fair, m, s) - ppl(lm10, m, s)) for s in seeds]
        assert (f"{sum(diffs) / len(diffs):.2f}", f"{max(diffs):.2f}") == (mean_abs, largest), m
    assert "by 1.30 on average for LIMe (at most 5.84) and 0.89 for LLaMA (at most 2.46)" in text
    sd = {m: statistics.stdev(ppl(fair, m, s) for s in seeds) for m in ("LIMe", "LLaMA")}
    assert f"SD of perplexity is {sd['LIMe']:.2f} against LLaMA's {sd['LLaMA']:.2f}" in text

    def upper_mean(name: str, model: str) -> float:
        rows = read_csv(fair / name)
        return statistics.mean(
            float(r["accuracy_mean"])
            for r in rows
            if r["model"] == model and r["site"] == "values" and int(r["layer"]) >= 8
        )

    one = [f"{100 * upper_mean('separability.csv', m):.1f} %" for m in ("LIMe", "LLaMA")]
    assert f"({one[0]} against {one[1]})" in text
