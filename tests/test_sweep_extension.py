"""The learning-rate sweep's extension (figures/lm-cpu-lr-sweep/PROTOCOL.md, amendment): the declared
study trains exactly the amendment's table, on the sweep's budget, beyond each family's current best,
and the choice over both grids follows the sweep's rule. Nothing here trains.

Mutations tried, each failing a test here: the table's "| LLaMA | 5e-3 |" -> "| LLaMA | 4e-3 |";
"| LIMe | 1e-3, 3e-3, 1e-2 | 30 |" -> "| LIMe | 3e-3, 1e-2 | 30 |"; "(7 settings x 3 seeds = 21
trainings)" -> "(7 settings x 3 seeds = 24 trainings)"; "16 in all" -> "15 in all"; EXTRA_ROUTER_MULTS
(30,) -> (20,) in the module; a tie going to the extension's setting."""

import ast
import csv
import re
from pathlib import Path

import pytest

from lime_model.recipes import load_recipe
from lime_probe.studies import STUDIES
from lime_probe.studies.runner import run_name
from lime_probe.studies.sweep import SWEEP_ROUTER_MULTS
from lime_probe.studies.sweep_extension import NAME, extended_choice

ROOT = Path(__file__).resolve().parents[1]
SWEEP_DIR = ROOT / "figures" / "lm-cpu-lr-sweep"
SWEEP, EXT = STUDIES["lm-cpu-lr-sweep"], STUDIES[NAME]


def amendment() -> str:
    return (SWEEP_DIR / "PROTOCOL.md").read_text().split("## Amendment, 2026-12-04: the grid extended", 1)[1]


def grid(models) -> set[tuple[str, float, float | None]]:
    """(family, base rate, router multiplier or None) of each setting."""
    return {(label.split("-")[0], o["lr"], o.get("router_lr_mult")) for label, o in models.items()}


def table() -> set[tuple[str, float, float | None]]:
    """The settings the amendment's table adds."""
    out = set()
    for family, lrs, mults in re.findall(
        r"^\| (LLaMA|LIMe) \| ([\d.e, -]+) \| ([^|]+) \|$", amendment(), re.M
    ):
        for lr in lrs.split(", "):
            for r in [None] if family == "LLaMA" else mults.split(", "):
                out.add((family, float(lr), None if r is None else float(r)))
    return out


def test_the_study_trains_exactly_the_amendments_runs():
    assert grid(EXT.models) == table()
    assert not set(EXT.models) & set(SWEEP.models)  # the sweep's runs are not repeated
    runs = [run_name(label, s) for s in EXT.seeds for label in EXT.models]
    n_settings, n_runs = re.search(r"\((\d+) settings x 3 seeds = (\d+) trainings\)", amendment()).groups()
    assert (len(EXT.models), len(runs), len(set(runs))) == (int(n_settings), int(n_runs), int(n_runs))
    assert f"--study {NAME} --data ../shared/data --threads 1" in " ".join(amendment().split())
    assert EXT.protocol == SWEEP.protocol and EXT.results == f"figures/{NAME}"


def test_the_extension_has_the_sweeps_budget_and_everything_else():
    assert (EXT.recipe, EXT.seeds, dict(EXT.overrides), EXT.measures) == (
        SWEEP.recipe,
        SWEEP.seeds,
        dict(SWEEP.overrides),
        SWEEP.measures,
    )
    assert EXT.select is not None and EXT.select.endpoint == SWEEP.select.endpoint
    for label, overrides in EXT.models.items():
        family = label.split("-")[0]
        like = [o for x, o in SWEEP.models.items() if x.startswith(family + "-")]
        tuned = ("lr", "min_lr", "router_lr_mult")
        assert {k: v for k, v in overrides.items() if k not in tuned} == {
            k: v for k, v in like[0].items() if k not in tuned
        }
        assert overrides["min_lr"] == pytest.approx(overrides["lr"] / 10)
        recipe = load_recipe(EXT.recipe, {"data": "unused.txt", **EXT.overrides, **overrides})
        assert (recipe.steps, recipe.batch_size, recipe.eval_holdout) == (300, 16, 0.1)


def test_both_families_share_one_grid_beyond_each_current_best():
    both = grid(SWEEP.models) | grid(EXT.models)
    rates = {f: {lr for fam, lr, _ in both if fam == f} for f in ("LLaMA", "LIMe")}
    assert rates["LLaMA"] == rates["LIMe"] == {1e-3, 3e-3, 5e-3, 1e-2}
    mults = {r for f, _, r in both if f == "LIMe"}
    assert {(lr, r) for f, lr, r in both if f == "LIMe"} == {(lr, r) for lr in rates["LIMe"] for r in mults}
    text = " ".join(amendment().split())
    assert f"LLaMA: {len(rates['LLaMA'])} settings; LIMe: x {len(mults)} multipliers" in text
    assert f"= {len(rates['LIMe']) * len(mults)} settings; {len(both)} in all" in text
    with open(SWEEP_DIR / "selection.csv") as f:
        chosen = [r for r in csv.DictReader(f) if r["chosen"] == "True"]
    for row in chosen:  # each axis of the current best has a setting past it on both sides
        family, lr, r = next(iter(grid({row["model"]: ast.literal_eval(row["overrides"])})))
        assert [x for x in rates[family] if x > lr] and [x for x in rates[family] if x < lr]
        if r is not None:
            assert r == max(SWEEP_ROUTER_MULTS) and [m for m in mults if m > r]  # x10 was the edge


def write_curves(folder: Path, ends: dict[str, float | list[str]]) -> Path:
    """A per-run curves.csv whose runs end at ``ends[model]`` (per seed; a number: seeds spread by +-0.01
    around it), with an earlier validation loss that the rule must not read."""
    folder.mkdir()
    with open(folder / "curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["model", "seed", "step", "loss", "val_loss"])
        w.writeheader()
        for m, v in ends.items():
            last = v if isinstance(v, list) else [v - 0.01, v, v + 0.01]
            for seed, end in zip(EXT.seeds, last, strict=True):
                w.writerow({"model": m, "seed": seed, "step": 150.0, "loss": 1.0, "val_loss": 0.0})
                w.writerow({"model": m, "seed": seed, "step": 200.0, "loss": 1.0, "val_loss": ""})
                w.writerow({"model": m, "seed": seed, "step": 300.0, "loss": 1.0, "val_loss": end})
    return folder


def test_the_choice_over_both_grids_is_the_sweeps_rule(tmp_path):
    with open(SWEEP_DIR / "selection.csv") as f:
        old = {r["model"]: float(r["mean"]) for r in csv.DictReader(f)}
    best = {f: min((v, m) for m, v in old.items() if m.startswith(f + "-")) for f in ("LLaMA", "LIMe")}
    chosen = {f: m for f, (_, m) in best.items()}
    worse = write_curves(tmp_path / "worse", {m: 9.0 for m in EXT.models})
    assert extended_choice(SWEEP, EXT, [SWEEP_DIR, worse]) == chosen  # the committed choice, from curves.csv
    lower = {m: 9.0 for m in EXT.models} | {"LIMe-lr5e-3-r30": best["LIMe"][0] - 0.001}
    moved = write_curves(tmp_path / "moved", lower)
    assert extended_choice(SWEEP, EXT, [SWEEP_DIR, moved]) == {**chosen, "LIMe": "LIMe-lr5e-3-r30"}
    with open(SWEEP_DIR / "curves.csv") as f:  # the chosen LLaMA's runs, again under the new label
        same = [
            r["val_loss"]
            for r in csv.DictReader(f)
            if r["model"] == best["LLaMA"][1] and r["step"] == "300.0"
        ]
    tie = write_curves(tmp_path / "tie", {m: 9.0 for m in EXT.models} | {"LLaMA-lr5e-3": same})
    assert (
        extended_choice(SWEEP, EXT, [SWEEP_DIR, tie])["LLaMA"] == best["LLaMA"][1]
    )  # the sweep's wins a tie
    nan = write_curves(tmp_path / "nan", {m: float("nan") for m in EXT.models})
    assert extended_choice(SWEEP, EXT, [SWEEP_DIR, nan]) == chosen
    with pytest.raises(ValueError, match="no validation loss for LLaMA-lr5e-3"):
        extended_choice(SWEEP, EXT, [SWEEP_DIR])
