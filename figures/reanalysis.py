"""Re-analysis of the committed seed studies from their per-run tables, with the current statistics.

Each study folder holds per-run CSVs (one row per model, seed and layer, tier or task). This script
rebuilds the measurements `lime_probe.studies.lm.compare` (or `reproduce_arithmetic.compare`) takes
from them, checks that every paired mean and t-interval of the folder's committed differences.csv
comes out again, and writes ``reanalysis.md`` and ``reanalysis.csv`` into the folder: each claim's one
primary endpoint with its paired t-interval, the t-test's and the exact sign-flip p and the minimum
detectable effect; the per-layer differences as exploratory, Holm- and BH-adjusted over layers. It
also redraws the figures those tables determine (`reproduce.draw_per_layer`,
`reproduce_arithmetic.draw_accuracy` and `draw_tables`), each interval labelled with what it is. The
training curves are not among them: the folders hold no per-run loss curves (the runs' metrics.jsonl).

    python figures/reanalysis.py                      # every study below
    python figures/reanalysis.py figures/lm-cpu       # one
    python figures/reanalysis.py --no-figures ...     # the tables only

Bad input (a folder that is not one of these studies, a missing table) is a one-line error, exit 2.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
LM_STUDIES = ("lm-cpu", "lm-cpu-baselines", "lm-cpu-kv-init")
ARITHMETIC_STUDIES = ("arithmetic-seeds",)
# the k/v-init study's comparisons that are not against LLaMA (its PROTOCOL.md, comparisons 2 and 3, and
# the addendum): model, reference
KV_INIT_PAIRS = (("LIMe-LLaMA-kv-init", "LIMe"), ("LIMe", "LLaMA-torch-kv-init"))


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"per-run table not found: {path}")
    with open(path) as f:
        return list(csv.DictReader(f))


def _per_run(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    out: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        out.setdefault((r["model"], int(r["seed"])), []).append(r)
    return out


def _entropy(folder: Path) -> dict:
    """{(model, seed): {"layers", "values": [[mean over windows], ...]}}: each layer's one value is the
    per-run mean the table holds (the mean over layers of these equals the mean over all windows and
    layers, as every layer has the same windows)."""
    out = {}
    for key, rows in _per_run(read_csv(folder / "entropy.csv")).items():
        rows = sorted(rows, key=lambda r: int(r["layer"]))
        out[key] = {
            "layers": [int(r["layer"]) for r in rows],
            "values": [[float(r["entropy_mean"])] for r in rows],
        }
    return out


def lm_measurements(folder: Path) -> tuple[dict, list[int], list[str]]:
    """The ``m`` of `reproduce.compare` from an LM study's per-run tables, its seeds and model labels."""
    ppl = read_csv(folder / "perplexity.csv")
    labels = list(dict.fromkeys(r["model"] for r in ppl))
    seeds = sorted({int(r["seed"]) for r in ppl})
    m: dict[str, dict] = {
        "perplexity": {(r["model"], int(r["seed"])): {"perplexity": float(r["perplexity"])} for r in ppl},
        "entropy": _entropy(folder),
        "separability": {},
        "blimp": {},
    }
    for key, rows in _per_run(read_csv(folder / "separability.csv")).items():
        rows = sorted(rows, key=lambda r: int(r["layer"]))
        m["separability"][key] = {
            "layers": [int(r["layer"]) for r in rows],
            "accuracy": [float(r["accuracy"]) for r in rows],
        }
    for key, rows in _per_run(read_csv(folder / "blimp.csv")).items():
        tasks: dict[str, dict] = {}
        for r in rows:  # the table's accuracy is already the mean over the task's layers
            tasks.setdefault(r["task"], {})[r["site"]] = {"accuracy": [float(r["accuracy"])]}
        m["blimp"][key] = {"tasks": tasks}
    return m, seeds, labels


def arithmetic_measurements(folder: Path) -> tuple[dict, list[int]]:
    """The ``m`` of `reproduce_arithmetic.compare` from the study's per-run tables, and its seeds."""
    acc = read_csv(folder / "accuracy.csv")
    m: dict[str, dict] = {"accuracy": {}, "entropy": _entropy(folder)}
    for key, rows in _per_run(acc).items():
        m["accuracy"][key] = {"accuracy": {r["operators"]: float(r["accuracy"]) for r in rows}}
    return m, sorted({int(r["seed"]) for r in acc})


def check_against_committed(folder: Path, diff: Sequence[dict]) -> int:
    """Every row of the folder's committed differences.csv has its paired mean and t-interval again in
    ``diff`` (to 1e-9); returns how many rows were checked. The committed rows name their model by the
    one filled column among the compared models' labels."""
    checked = 0
    labels = {r["model"] for r in diff}
    for old in read_csv(folder / "differences.csv"):
        model = next(k for k in labels if old.get(k))
        where = next((old[k] for k in ("layer", "site", "operators") if old.get(k)), "")
        new = next(
            r
            for r in diff
            if r["model"] == model
            and r["reference"] == "LLaMA"
            and r["measure"] == old["measure"]
            and str(r.get("layer", r.get("site", r.get("operators", "")))) == where
        )
        for key in ("diff_mean", "ci_low", "ci_high"):
            if not np.isclose(float(old[key]), new[key], rtol=0, atol=1e-9):
                raise AssertionError(
                    f"{folder.name}: {old['measure']} {where} {key} {old[key]} != {new[key]}"
                )
        checked += 1
    return checked


def pair_table(rows: Sequence[dict]) -> list[str]:
    """Markdown lines: the primary endpoints of comparisons that are not against LLaMA."""
    from lime_probe.studies.lm import CLAIMS, format_p

    lines = [
        "| measure | difference | model's mean | reference's mean | difference [95 % paired t-interval] | p (t) "
        "| p (sign-flip) | MDE | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for measure, where, _ in CLAIMS:
        for r in rows:
            if (
                r["measure"] == measure
                and r["endpoint"] != "exploratory"
                and where in (None, r.get("layer"), r.get("site"))
            ):
                lines.append(
                    f"| {measure}{f' ({where})' if where else ''} | {r['model']} - {r['reference']} | "
                    f"{r[r['model']]:.4g} | {r[r['reference']]:.4g} | {r['diff_mean']:+.4g} "
                    f"[{r['ci_low']:+.4g}, {r['ci_high']:+.4g}] | {format_p(r['p_t'])} | "
                    f"{format_p(r['p_sign_flip'])} | {r['mde']:.3g} | {r['verdict']} |"
                )
    return lines


def reanalyse(folder: Path, redraw: bool = True) -> Path:
    """Write ``folder/reanalysis.md`` and ``reanalysis.csv``; returns the markdown's path. ``redraw``:
    also redraw the figures the per-run tables determine (per-layer entropy and separability with their
    bands labelled, the differences with their paired t-intervals, the arithmetic accuracy with its
    t-intervals over seeds)."""
    from lime_probe.output.results import atomic_write_text, rows_to_csv
    from lime_probe.studies import arithmetic as reproduce_arithmetic
    from lime_probe.studies import lm as reproduce

    name = folder.name
    intro = (
        "Recomputed by `python figures/reanalysis.py` from this folder's per-run tables, with the statistics "
        "of the current code: each claim's one primary endpoint with its 95 % paired t-interval, the t-test's "
        "and the exact sign-flip p and the minimum detectable effect (MDE); the per-layer differences as "
        "exploratory results, Holm- and BH-adjusted over layers. The folder's findings.md and differences.csv "
        "were written earlier, with a t-interval per row and a verdict on each layer; every paired mean and "
        "t-interval of differences.csv comes out again here ({checked} rows checked to 1e-9), so only the "
        "inference differs."
    )
    if name in ARITHMETIC_STUDIES:
        m, seeds = arithmetic_measurements(folder)
        diff = reproduce_arithmetic.compare(m, seeds)
        settings = json.loads((folder / "summary.json").read_text())["meta"]["settings"]
        body = reproduce_arithmetic.findings(diff, seeds, settings["recipe"], settings["size"])
        intro += (
            " The study's protocol asks about accuracy per operator count and names no single primary "
            "endpoint; this re-analysis makes the hardest tier (3 operators) primary, a choice made after its "
            "results were seen (ours), and the 2-operator tier and the mean value entropy secondary."
        )
    elif name in LM_STUDIES:
        m, seeds, labels = lm_measurements(folder)
        compared = [label for label in labels if label != "LLaMA"]
        diff = reproduce.compare(m, seeds, compared)
        body = reproduce.findings(diff, seeds, compared, "PROTOCOL.md in this folder")
        if name == "lm-cpu-kv-init":
            pairs = [r for a, b in KV_INIT_PAIRS for r in reproduce.compare(m, seeds, [a], reference=b)]
            body += "\n".join(
                [
                    "",
                    "## The comparisons that are not against LLaMA (vs_lime.py's)",
                    "",
                    "Same statistics; the paper states no sign for these.",
                    "",
                    *pair_table(pairs),
                    "",
                    *reproduce.exploratory_table(pairs, ("value entropy", "separability")),
                    "",
                ]
            )
            diff = diff + pairs
    else:
        raise ValueError(
            f"{folder}: not one of the studies this script re-analyses ({', '.join(LM_STUDIES + ARITHMETIC_STUDIES)})"
        )
    checked = check_against_committed(folder, diff)
    title, rest = body.split("\n", 1)
    text = f"{title} (re-analysis)\n\n{intro.format(checked=checked)}\n{rest}"
    if redraw:
        if name in ARITHMETIC_STUDIES:
            reproduce_arithmetic.draw_accuracy(folder, m, seeds)
            reproduce_arithmetic.draw_tables(folder, m, diff, seeds)
        else:
            against_llama = [r for r in diff if r["reference"] == "LLaMA"]
            reproduce.draw_per_layer(folder, m, against_llama, seeds, labels)
    atomic_write_text(folder / "reanalysis.csv", rows_to_csv(diff))
    return atomic_write_text(folder / "reanalysis.md", text)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    redraw = "--no-figures" not in args
    folders = [Path(a) for a in args if a != "--no-figures"] or [
        HERE / s for s in LM_STUDIES + ARITHMETIC_STUDIES
    ]
    try:
        for folder in folders:
            print(reanalyse(folder, redraw))
    except (FileNotFoundError, ValueError) as e:
        print(f"reanalysis: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
