"""Comparisons 2 and 3 of this folder's PROTOCOL.md: the ablation minus LIMe, paired by seed, and the
mean training loss of each model at steps 70 and 280.

    python figures/lm-cpu-kv-init/vs_lime.py   # after the protocol's command; writes vs_lime.csv here
"""

import csv
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats

HERE = Path(__file__).resolve().parent
RUNS = HERE.parents[1] / "runs" / "lm-cpu-kv-init" / "train"
ABLATION, LIME, LLAMA = "LIMe-LLaMA-kv-init", "LIMe", "LLaMA"
SEEDS = (0, 1, 2)


def rows(name: str) -> list[dict]:
    with open(HERE / f"{name}.csv", newline="") as f:
        return list(csv.DictReader(f))


def per_seed(name: str, column: str, model: str, **where: str) -> np.ndarray:
    """The mean of ``column`` over the rows of ``model`` matching ``where``, per seed."""
    table = rows(name)
    return np.array(
        [
            np.mean(
                [
                    float(r[column])
                    for r in table
                    if r["model"] == model
                    and r["seed"] == str(s)
                    and all(r[k] == v for k, v in where.items())
                ]
            )
            for s in SEEDS
        ]
    )


def main() -> None:
    measures = {
        "perplexity": ("perplexity", "perplexity", {}),
        "value entropy, mean over layers": ("entropy", "entropy_mean", {}),
        "value entropy, layer 0": ("entropy", "entropy_mean", {"layer": "0"}),
        "BLiMP probes on values": ("blimp", "accuracy", {"site": "values"}),
        "BLiMP probes on hidden states": ("blimp", "accuracy", {"site": "hidden"}),
    }
    out = []
    for measure, (name, column, where) in measures.items():
        a, b = per_seed(name, column, ABLATION, **where), per_seed(name, column, LIME, **where)
        ci = stats.ttest_rel(a, b).confidence_interval(0.95)
        out.append(
            {
                "measure": measure,
                ABLATION: a.mean(),
                LIME: b.mean(),
                "diff_mean": (a - b).mean(),
                "ci_low": ci.low,
                "ci_high": ci.high,
                "per_seed": " ".join(f"{d:+.4g}" for d in a - b),
            }
        )
    for step in (70, 280):
        row = {"measure": f"training loss at step {step}"}
        for model, run in ((ABLATION, "lime-llama-kv-init"), (LIME, "lime"), (LLAMA, "llama")):
            losses = []
            for s in SEEDS:
                lines = (RUNS / f"{run}-s{s}" / "metrics.jsonl").read_text().splitlines()
                losses.append(next(json.loads(x)["loss"] for x in lines if json.loads(x).get("step") == step))
            row[model] = float(np.mean(losses))
        out.append(row)
    fields = ["measure", ABLATION, LIME, LLAMA, "diff_mean", "ci_low", "ci_high", "per_seed"]
    with open(HERE / "vs_lime.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(out)
    sys.stdout.write((HERE / "vs_lime.csv").read_text())


if __name__ == "__main__":
    main()
