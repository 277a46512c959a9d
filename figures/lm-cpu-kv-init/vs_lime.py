"""Comparisons 2 and 3 of this folder's PROTOCOL.md and its addendum: paired differences between the
k/v-init study's models (ablation minus LIMe; LIMe minus LLaMA with LIMe's k/v init) and each model's
mean training loss at steps 70 and 280.

    python figures/lm-cpu-kv-init/vs_lime.py   # after the protocol's command; writes vs_lime.csv and
                                                # loss_at_steps.csv here
"""

import csv
import json
import sys
from functools import cache
from pathlib import Path

import numpy as np
from scipy import stats

HERE = Path(__file__).resolve().parent
RUNS = HERE.parents[1] / "runs" / "lm-cpu-kv-init" / "train"
SEEDS = (0, 1, 2)
# label in the per-run tables -> run folder prefix
MODELS = {
    "LIMe": "lime",
    "LLaMA": "llama",
    "LIMe-LLaMA-kv-init": "lime-llama-kv-init",
    "LLaMA-torch-kv-init": "llama-torch-kv-init",
}
PAIRS = [("LIMe-LLaMA-kv-init", "LIMe"), ("LIMe", "LLaMA-torch-kv-init")]
MEASURES = {  # name -> (per-run table, column, row filter); the mean over matching rows per seed
    "perplexity": ("perplexity", "perplexity", {}),
    "value entropy, mean over layers": ("entropy", "entropy_mean", {}),
    **{f"value entropy, layer {k}": ("entropy", "entropy_mean", {"layer": str(k)}) for k in range(16)},
    "BLiMP probes on values": ("blimp", "accuracy", {"site": "values"}),
    "BLiMP probes on hidden states": ("blimp", "accuracy", {"site": "hidden"}),
}


@cache
def table(name: str) -> list[dict]:
    with open(HERE / f"{name}.csv", newline="") as f:
        return list(csv.DictReader(f))


def per_seed(name: str, column: str, model: str, where: dict) -> np.ndarray:
    return np.array(
        [
            np.mean(
                [
                    float(r[column])
                    for r in table(name)
                    if r["model"] == model
                    and r["seed"] == str(s)
                    and all(r[k] == v for k, v in where.items())
                ]
            )
            for s in SEEDS
        ]
    )


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    sys.stdout.write((HERE / name).read_text() + "\n")


def main() -> None:
    pairs = []
    for a_label, b_label in PAIRS:
        for measure, (name, column, where) in MEASURES.items():
            a, b = per_seed(name, column, a_label, where), per_seed(name, column, b_label, where)
            ci = stats.ttest_rel(a, b).confidence_interval(0.95)
            pairs.append(
                {
                    "difference": f"{a_label} - {b_label}",
                    "measure": measure,
                    "mean_a": a.mean(),
                    "mean_b": b.mean(),
                    "diff_mean": (a - b).mean(),
                    "ci_low": ci.low,
                    "ci_high": ci.high,
                    "per_seed": " ".join(f"{d:+.4g}" for d in a - b),
                }
            )
    write("vs_lime.csv", pairs)
    losses = []
    for model, run in MODELS.items():
        # per seed: step -> training loss, from one read of the run's metrics
        loss = [
            {
                m.get("step"): m.get("loss")
                for m in map(json.loads, (RUNS / f"{run}-s{s}" / "metrics.jsonl").open())
            }
            for s in SEEDS
        ]
        losses.append(
            {"model": model} | {f"loss_step_{t}": float(np.mean([d[t] for d in loss])) for t in (70, 280)}
        )
    write("loss_at_steps.csv", losses)


if __name__ == "__main__":
    main()
