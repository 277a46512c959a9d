"""Re-analysis of the committed seed studies from their per-run tables, by the study runner's statistics.

The study folders below hold per-run CSVs (one row per model, seed and layer, tier or task) written
under an earlier protocol; their training runs are not kept in the repository. This script turns those
tables into the rows the runner's measures give (`lime_probe.studies.findings.compare` reads), compares
them with the study's declared claims (`lime_probe.studies.STUDIES`), checks that every paired mean and
t-interval of the folder's committed differences.csv comes out again (to 1e-9), and writes
``reanalysis.md`` and ``reanalysis.csv`` into the folder: each claim's primary endpoint with its paired
t-interval, the t-test's and the exact sign-flip p and the minimum detectable effect; the per-layer
differences as exploratory, Holm- and BH-adjusted over layers. For the arithmetic studies
the per-tier accuracy figure (`accuracy.png`) is redrawn with its 95 % t-intervals, and for
arithmetic-kv-init every figure the study runner draws from its tables (per-layer, endpoints); the
others are not. A study whose per-run training curves are committed (`CURVE_TABLES`) has its
`loss_vs_flops` figure redrawn from them, as the runner draws it from the runs' metrics.

    python figures/reanalysis.py                      # every study below
    python figures/reanalysis.py figures/lm-cpu       # one

Bad input (a folder that is not one of these studies, a missing table) is a one-line error, exit 2.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
LM_STUDIES = ("lm-cpu", "lm-cpu-baselines", "lm-cpu-kv-init")
ARITHMETIC_STUDIES = ("arithmetic-seeds", "arithmetic-kv-init")
# written by the study runner itself: each per-run table holds its measure's rows as measured
RUNNER_STUDIES = ("lm-cpu-10-seeds",)
ALL = LM_STUDIES + ARITHMETIC_STUDIES + RUNNER_STUDIES
# studies whose per-run training curves are committed: the table loss_vs_flops is redrawn from
CURVE_TABLES = {
    "lm-cpu-lr-sweep": "curves.csv",
    "lm-cpu-lr-sweep-ext": "curves.csv",
    "upcycling": "loss_vs_flops.csv",  # the runner writes it since the table was added
    "lm-cpu-fair-interior": "loss_vs_flops.csv",
}
# per-layer tables (measured on the values, the W_V output): their value column -> the runner's column
PER_LAYER = {"entropy": ("entropy_mean", "entropy_mean"), "separability": ("accuracy", "accuracy_mean")}


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"per-run table not found: {path}")
    with open(path) as f:
        return list(csv.DictReader(f))


def measured_from_tables(folder: Path) -> tuple[dict, list[int]]:
    """{measure: {(model, seed): {"rows": [...]}}} as the runner measures them, from the folder's tables,
    and the seeds. Entropy and separability were measured on the values (W_V output); a BLiMP row's
    accuracy is already its task's mean over the paper's layers (one row per task and site)."""

    def rows_by_run(name: str, row) -> dict:
        out: dict = {}
        for r in read_csv(folder / f"{name}.csv"):
            out.setdefault((r["model"], int(r["seed"])), {"rows": []})["rows"].append(row(r))
        return out

    measured = {
        name: rows_by_run(
            name, lambda r, c=cols: {"site": "values", "layer": int(r["layer"]), c[1]: float(r[c[0]])}
        )
        for name, cols in PER_LAYER.items()
        if name == "entropy" or folder.name in LM_STUDIES
    }
    if folder.name in ARITHMETIC_STUDIES:
        measured["accuracy"] = rows_by_run(
            "accuracy", lambda r: {"n_operators": int(r["operators"]), "accuracy": float(r["accuracy"])}
        )
    else:
        measured["perplexity"] = rows_by_run("perplexity", lambda r: {"perplexity": float(r["perplexity"])})
        measured["blimp"] = rows_by_run(
            "blimp",
            lambda r: {
                "site": r["site"],
                "paradigm": r["task"],
                "layer": 0,
                "probe_accuracy_mean": float(r["accuracy"]),
            },
        )
    seeds = sorted({seed for per in measured.values() for _, seed in per})
    return measured, seeds


def typed(value: str):
    """A CSV cell back as the runner wrote it: int, float or bool where it reads as one, else the string."""
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(value, value)


def measured_from_runner_tables(folder: Path, measures) -> tuple[dict, list[int]]:
    """The runner's measurements from a runner-written folder: ``{measure}.csv`` for each per-run measure."""
    measured: dict = {}
    for name, m in measures.items():
        if m.per != "run":
            continue
        for r in read_csv(folder / f"{name}.csv"):
            row = {k: typed(v) for k, v in r.items() if k not in ("model", "seed") and v != ""}
            runs = measured.setdefault(name, {})
            runs.setdefault((r["model"], int(r["seed"])), {"rows": []})["rows"].append(row)
    seeds = sorted({seed for per in measured.values() for _, seed in per})
    return measured, seeds


def check_runner_rows(folder: Path, diff: Sequence[dict]) -> int:
    """Every row of a runner-written differences.csv again in ``diff``: paired mean, interval and t-test p
    to 1e-9; returns how many rows were checked."""
    new = {(r["endpoint"], r["model"], r["reference"], str(r.get("layer", ""))): r for r in diff}
    old_rows = read_csv(folder / "differences.csv")
    for old in old_rows:
        r = new[old["endpoint"], old["model"], old["reference"], old["layer"]]
        for key in ("diff_mean", "ci_low", "ci_high", "p_t"):
            if not np.isclose(float(old[key]), r[key], rtol=1e-9, atol=1e-12):
                raise AssertionError(
                    f"{folder.name}: {old['endpoint']} {old['model']} {key} {old[key]} != {r[key]}"
                )
    if len(old_rows) != len(diff):
        raise AssertionError(f"{folder.name}: {len(old_rows)} committed rows, {len(diff)} recomputed")
    return len(old_rows)


def same_place(r: dict, layer: str, site: str, tier: str) -> bool:
    """Whether a runner row ``r`` is where a committed row is: its tier, site, layer number, or (layer
    "mean" / "upper half") the claim's own endpoint, which has no layer."""
    if tier:
        return r.get("n_operators") == int(tier) and "layer" not in r
    if site:
        return r.get("site") == site
    if layer.isdigit():
        return r.get("layer") == int(layer)
    return "layer" not in r


def check_against_committed(folder: Path, diff: Sequence[dict]) -> int:
    """Every row of the folder's committed differences.csv has its paired mean and t-interval again in
    ``diff`` (to 1e-9); returns how many rows were checked. A committed row names its model by the one
    filled column among the compared models' labels, its place by ``layer`` (a number, "mean" or "upper
    half"), ``site`` or ``operators``."""
    labels = {r["model"] for r in diff}
    checked = 0
    for old in read_csv(folder / "differences.csv"):
        model = old.get("model") or next(k for k in labels if old.get(k))
        reference = old.get("reference") or "LLaMA"
        layer, site, tier = old.get("layer", ""), old.get("site", ""), old.get("operators", "")

        new = [
            r
            for r in diff
            if (r["model"], r["reference"], r["measure"]) == (model, reference, old["measure"])
            and same_place(r, layer, site, tier)
        ]
        if len(new) != 1:
            raise AssertionError(
                f"{folder.name}: {len(new)} rows for {old['measure']} {model} {layer}{site}{tier}"
            )
        for key in ("diff_mean", "ci_low", "ci_high"):
            if not np.isclose(float(old[key]), new[0][key], rtol=0, atol=1e-9):
                raise AssertionError(
                    f"{folder.name}: {old['measure']} {layer}{site}{tier} {key} {old[key]} != {new[0][key]}"
                )
        checked += 1
    return checked


def reanalyse(folder: Path) -> Path:
    """Write ``folder/reanalysis.md`` and ``reanalysis.csv``; returns the markdown's path."""
    from lime_probe.output.plots import save_figure
    from lime_probe.output.results import atomic_write_text, rows_to_csv
    from lime_probe.studies import STUDIES
    from lime_probe.studies.findings import claim_table, compare, findings, table_figures, tier_figure

    name = folder.name
    if name not in ALL:
        raise ValueError(f"{folder}: not one of the studies this script re-analyses ({', '.join(ALL)})")
    study = STUDIES[name]
    if name in RUNNER_STUDIES:
        measured, seeds = measured_from_runner_tables(folder, study.measures)
        diff = compare(study, measured, seeds)
        checked = check_runner_rows(folder, diff)
        added = compare(replace(study, claims=official_comparison()), measured, seeds)
        intro = (
            "Recomputed by `python figures/reanalysis.py` from this folder's per-run tables (each measure's rows "
            "as the study runner wrote them) with the runner's statistics of today: every row of differences.csv "
            f"comes out again ({checked} rows, paired mean, interval and t-test p to 1e-9). New here: Holm's "
            "adjusted p over the secondary endpoints (the runner adjusted over the primary ones only when this "
            "study was written)."
        )
    else:
        measured, seeds = measured_from_tables(folder)
        diff = compare(study, measured, seeds)
        checked = check_against_committed(folder, diff)
        intro = (
            "Recomputed by `python figures/reanalysis.py` from this folder's per-run tables, with the statistics "
            "of the study runner (`lime_probe.studies.findings`): each claim's primary endpoint with its 95 % "
            "paired t-interval, the t-test's and the exact sign-flip p and the minimum detectable effect (MDE); the "
            "per-layer differences as exploratory results, Holm- and BH-adjusted over layers. The folder's "
            "findings.md and differences.csv were written earlier, with a t-interval per row and a verdict on each "
            f"layer; every paired mean and t-interval of differences.csv comes out again here ({checked} rows "
            "checked to 1e-9), so only the inference differs."
        )
    if name == "arithmetic-kv-init":
        intro += (
            " The protocol named the two primary endpoints tested here (3-operator accuracy: routing at LLaMA's "
            "init, and PyTorch's init without routing); Holm over the secondary endpoints is new. The figures "
            "are redrawn from `accuracy.csv` and `entropy.csv` by the runner's figures of today: `accuracy.png` "
            "(per tier), `endpoints.png` and `value_entropy_values_per_layer.png`."
        )
    elif name in ARITHMETIC_STUDIES:
        intro += (
            " The study's protocol asks about accuracy per operator count and names no single primary endpoint; "
            "this re-analysis makes the hardest tier (3 operators) primary, a choice made after its results were "
            "seen (ours), and the 2-operator tier and the mean value entropy secondary."
        )
    figures = {}
    if name == "arithmetic-kv-init":  # every figure the runner draws from these tables
        figures = table_figures(study, measured, diff, seeds)
    elif name in ARITHMETIC_STUDIES:  # per tier, each model's mean with the 95 % t-interval of the mean
        figures = {"accuracy": tier_figure(list(study.models), measured, seeds)}
    for stem, figure in figures.items():
        save_figure(figure, folder / stem)
    title, rest = findings(study, diff, seeds).split("\n", 1)
    if name in RUNNER_STUDIES:
        rest += "\n".join(
            [
                "",
                "## Added after the results (not pre-registered)",
                "",
                "The official analysis's comparison (LIMe's routed values, what its heads read, against LLaMA's "
                "values, the W_V output), which the protocol did not name; Holm over these two rows only.",
                "",
                *claim_table(added, holm_column=True),
                "",
            ]
        )
        diff = [*diff, *({**r, "role": "added after the results"} for r in added)]
    atomic_write_text(folder / "reanalysis.csv", rows_to_csv(diff))
    return atomic_write_text(folder / "reanalysis.md", f"{title} (re-analysis)\n\n{intro}\n{rest}")


def redraw_curves(folder: Path) -> Path:
    """``folder/loss_vs_flops`` (PNG, PDF) from its committed per-run curves (`CURVE_TABLES`), by the
    runner's figure; returns the PNG's path."""
    from lime_probe.output.plots import save_figure
    from lime_probe.studies import STUDIES
    from lime_probe.studies.findings import curves_figure

    study = STUDIES[folder.name]
    rows = read_csv(folder / CURVE_TABLES[folder.name])
    figure = curves_figure(rows, list(study.models), study.seeds)
    return save_figure(figure, folder / "loss_vs_flops")[0]


def official_comparison() -> tuple:
    """The official analysis's site comparison for each routing model against LLaMA: its routed values'
    mean entropy against LLaMA's values' (value_wrapper.py records the routed read for LIMe)."""
    from lime_probe.studies import Claim
    from lime_probe.studies.lm_cpu import entropy

    return tuple(
        Claim(m, "LLaMA", entropy("routed_values"), "secondary", None, reference_endpoint=entropy())
        for m in ("LIMe", "LIMe-LLaMA-kv-init")
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    folders = [Path(a) for a in args] or [HERE / s for s in (*ALL, *CURVE_TABLES)]
    try:
        for folder in folders:
            print(redraw_curves(folder) if folder.name in CURVE_TABLES else reanalyse(folder))
    except (FileNotFoundError, ValueError) as e:
        print(f"reanalysis: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
