"""The sweep extension's README: every number it quotes recomputed from the two folders' per-run curves.

Mutations tried, each failing a test here: a chosen mean (5.2561 -> 5.2651), a std (0.0114 -> 0.0141),
the gap between the bests (0.0293 -> 0.0294), the LIMe move (0.0926 -> 0.0962), the trainings count
(21 of 21 -> 27 of 21)."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest

from lime_probe.studies.catalog import STUDIES
from lime_probe.studies.sweep_extension import extended_choice

FIGURES = Path(__file__).resolve().parents[1] / "figures"
FOLDERS = (FIGURES / "lm-cpu-lr-sweep", FIGURES / "lm-cpu-lr-sweep-ext")
README = (FOLDERS[1] / "README.md").read_text()


def last_losses() -> dict[str, list[float]]:
    """Each setting's validation loss at its last evaluated step, one per seed (plain reading of the CSVs)."""
    runs: dict[str, dict[str, tuple[float, float]]] = {}
    for folder in FOLDERS:
        with open(folder / "curves.csv") as f:
            for r in csv.DictReader(f):
                if r["val_loss"]:
                    seen = runs.setdefault(r["model"], {}).get(r["seed"])
                    if seen is None or float(r["step"]) > seen[0]:
                        runs[r["model"]][r["seed"]] = (float(r["step"]), float(r["val_loss"]))
    return {m: [v for _, v in seeds.values()] for m, seeds in runs.items()}


def mean(label: str) -> float:
    return statistics.mean(last_losses()[label])


def test_the_choice_and_every_quoted_mean_and_std_recompute():
    losses = last_losses()
    assert extended_choice(STUDIES["lm-cpu-lr-sweep"], STUDIES["lm-cpu-lr-sweep-ext"], FOLDERS) == {
        "LLaMA": "LLaMA-lr5e-3",
        "LIMe": "LIMe-lr5e-3-r10",
    }
    assert "| LLaMA | base 5e-3 |" in README and "| LIMe | base 5e-3, router x10 |" in README
    for label in ("LLaMA-lr5e-3", "LIMe-lr5e-3-r10", "LLaMA-lr3e-3", "LIMe-lr3e-3-r10"):
        x = losses[label]
        assert len(x) == 3
        assert f"{statistics.mean(x):.4f} ({statistics.stdev(x):.4f})" in README, label


@pytest.mark.parametrize(
    ("words", "value"),
    [
        ("LIMe (0.0926 nats)", lambda: mean("LIMe-lr3e-3-r10") - mean("LIMe-lr5e-3-r10")),
        ("LLaMA (0.0141)", lambda: mean("LLaMA-lr3e-3") - mean("LLaMA-lr5e-3")),
        ("by 0.0293 nats", lambda: mean("LLaMA-lr5e-3") - mean("LIMe-lr5e-3-r10")),
    ],
)
def test_the_prose_differences_recompute(words, value):
    number = words.split("(")[-1].split(" nats")[0].rstrip(")") if "(" in words else words.split()[1]
    assert words in README
    assert f"{value():.4f}" == number


def test_both_choices_are_interior_and_the_run_count_is_the_declared_grid():
    m = {label: statistics.mean(x) for label, x in last_losses().items()}
    assert m["LLaMA-lr5e-3"] < min(m["LLaMA-lr3e-3"], m["LLaMA-lr1e-2"])
    lime = m["LIMe-lr5e-3-r10"]
    assert lime < min(m["LIMe-lr3e-3-r10"], m["LIMe-lr1e-2-r10"], m["LIMe-lr5e-3-r1"], m["LIMe-lr5e-3-r30"])
    assert "both are interior" in README
    new = STUDIES["lm-cpu-lr-sweep-ext"].models
    assert len(new) * 3 == 21 and "21 of 21 trainings" in README


def test_the_interior_comparison_is_lm_cpu_fair_at_the_extended_choice():
    """The amendment's follow-up: lm-cpu-fair's declaration (arms, seeds, measures, claims) with the two
    chosen settings of the extended sweep, and the three side arms moved with them (base rate only)."""
    fair, interior = STUDIES["lm-cpu-fair"], STUDIES["lm-cpu-fair-interior"]
    ext = STUDIES["lm-cpu-lr-sweep-ext"]
    chosen = extended_choice(STUDIES["lm-cpu-lr-sweep"], ext, FOLDERS)
    assert interior.models["LIMe"] == ext.models[chosen["LIMe"]]
    assert interior.models["LLaMA"] == ext.models[chosen["LLaMA"]]
    assert (interior.claims, interior.measures, interior.seeds) == (fair.claims, fair.measures, fair.seeds)
    assert list(interior.models) == list(fair.models)
    for label, setting in fair.models.items():
        assert interior.models[label] == {**setting, "lr": 5e-3, "min_lr": 5e-4}, label
    assert interior.reproducible and (FIGURES / "lm-cpu-fair-interior" / "PROTOCOL.md").is_file()
