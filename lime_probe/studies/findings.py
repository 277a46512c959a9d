"""A study's comparisons and what it writes: every claim's paired difference over seeds, the per-run
tables, the figures and findings.md.

Each row of ``differences.csv`` is one `Claim` (an exploratory claim: one row per layer): the mean of
``model - reference`` over seeds with its 95 % paired t-interval, the t-test's p, the exact sign-flip p
and the minimum detectable effect at this many seeds (`stats.paired_difference`). Primary and secondary
rows carry a verdict from the interval; the primary p-values are also Holm-adjusted over the study's
primary endpoints; exploratory rows get Holm-adjusted p and BH q over each family (one claim's layers)
and no verdict, and an exploratory endpoint read alone (no ``per``) neither.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .study import Claim, Effect, Endpoint, Study

Measured = Mapping[str, Mapping[tuple[str, int], dict]]  # measure -> (label, seed) -> {"rows", ...}


def name_of(side: str | Effect) -> str:
    return side.name if isinstance(side, Effect) else side


def side_values(side: str | Effect, get, seeds: Sequence[int]) -> np.ndarray:
    """Per seed: the endpoint of model ``side``, or for an `Effect` its two models' difference."""
    if isinstance(side, Effect):
        return side_values(side.model, get, seeds) - side_values(side.reference, get, seeds)
    return np.array([get(side, s) for s in seeds], dtype=float)


def verdict(role: str, sign: int | None, resolved: bool, mean: float) -> str:
    """'exploratory' rows carry none; otherwise 'not resolved', or against a stated sign 'holds' /
    'reversed', or without one which way the resolved difference goes."""
    if role == "exploratory":
        return "exploratory"
    if not resolved:
        return "not resolved"
    if sign is None:
        return "higher" if mean > 0 else "lower"
    return "holds" if (mean > 0) == (sign > 0) else "reversed"


def difference_row(claim: Claim, a: np.ndarray, b: np.ndarray, **where: Any) -> dict:
    """One comparison: ``a - b`` (per seed) as the claim states it, with every statistic."""
    from lime_probe.probes.stats import paired_difference

    d = paired_difference(a, b)
    model, reference = name_of(claim.model), name_of(claim.reference)
    return {
        "endpoint": claim.label(),
        "measure": claim.endpoint.name,
        "scale": claim.endpoint.scale,  # for display: 100 shows a fraction in points
        "unit": claim.endpoint.unit,
        **where,
        "model": model,
        "reference": reference,
        "role": claim.role,
        "claim": claim.text,
        "sign": claim.sign,
        "model_mean": float(np.mean(a)),
        "reference_mean": float(np.mean(b)),
        "diff_mean": d.mean,
        "diff_std": d.std,
        "ci_low": d.ci_low,
        "ci_high": d.ci_high,
        "n_seeds": d.n,
        "per_seed_diff": list(d.pairs),
        "p_t": d.p,
        "p_sign_flip": d.p_sign_flip,
        "mde": d.mde,
        "verdict": verdict(claim.role, claim.sign, d.resolved, d.mean),
    }


def compare(study: Study, measured: Measured, seeds: Sequence[int]) -> list[dict]:
    """Every claim of ``study`` over ``seeds``, one row each (per layer for exploratory claims), with
    Holm over the primary endpoints and Holm / BH within each exploratory family."""
    from lime_probe.probes.stats import benjamini_hochberg, holm

    rows = []
    for claim in study.claims:
        e, er = claim.endpoints

        def rows_of(label: str, seed: int, e: Endpoint) -> list[dict]:
            return measured[e.measure][label, seed]["rows"]

        def get(endpoint: Endpoint):
            return lambda label, seed: endpoint.of(rows_of(label, seed, endpoint))

        if claim.per is None:
            a, b = side_values(claim.model, get(e), seeds), side_values(claim.reference, get(er), seeds)
            first = e.rows(rows_of(models_of(claim.model)[0], seeds[0], e))  # "largest" resolved
            rows.append(difference_row(claim, a, b, **{k: first[0][k] for k in e.where}))
            continue
        family = []
        keys = list(e.per(claim.per, rows_of(models_of(claim.model)[0], seeds[0], e)))
        for key in keys:

            def get_at(endpoint: Endpoint, key=key, per=claim.per):
                return lambda label, seed: endpoint.per(per, rows_of(label, seed, endpoint))[key]

            a = side_values(claim.model, get_at(e), seeds)
            b = side_values(claim.reference, get_at(er), seeds)
            family.append(difference_row(claim, a, b, **dict(e.where), **{claim.per: key}))
        p = [r["p_t"] for r in family]
        for r, ph, q in zip(family, holm(p), benjamini_hochberg(p), strict=True):
            r["p_holm"], r["q_bh"] = float(ph), float(q)
        rows += family
    for role in ("primary", "secondary"):  # each role's family: Holm over its endpoints
        family = [r for r in rows if r["role"] == role]
        for r, ph in zip(family, holm([r["p_t"] for r in family]) if family else [], strict=True):
            r["p_holm"] = float(ph)
    return rows


def selection_table(study: Study, measured: Measured, seeds: Sequence[int]) -> list[dict]:
    """Every candidate of ``study.select``: its endpoint's mean and sample std over ``seeds``, each seed's
    value and whether the declared rule chose it."""
    sel = study.select
    if sel is None:
        return []
    e = sel.endpoint
    values = {
        label: [e.of(measured[e.measure][label, s]["rows"]) for s in seeds]
        for labels in sel.families.values()
        for label in labels
    }
    chosen = sel.choose({label: float(np.mean(v)) for label, v in values.items()})
    return [
        {
            "family": family,
            "model": label,
            "overrides": dict(study.models[label]),
            "endpoint": e.label(),
            "mean": float(np.mean(values[label])),
            "std": float(np.std(values[label], ddof=1)),
            "per_seed": values[label],
            "chosen": chosen[family] == label,
        }
        for family, labels in sel.families.items()
        for label in labels
    ]


# --------------------------------------------------------------------------- tables


def per_run_tables(measured: Measured) -> dict[str, list[dict]]:
    """Per measure: every run's rows with its ``model`` label and ``seed``."""
    out: dict[str, list[dict]] = {}
    for name, per_run in measured.items():
        out[name] = [
            {"model": label, "seed": seed, **{k: v for k, v in row.items() if k != "model"}}
            for (label, seed), m in per_run.items()
            for row in m["rows"]
        ]
    return out


def models_of(side: str | Effect) -> list[str]:
    return [*models_of(side.model), *models_of(side.reference)] if isinstance(side, Effect) else [side]


def endpoint_table(study: Study, measured: Measured, seeds: Sequence[int]) -> list[dict]:
    """Each run's value of every non-exploratory endpoint, for the models its claims compare: what the
    differences pair up."""
    wanted: dict[str, tuple[Endpoint, set[str]]] = {}
    for claim in study.claims:
        if claim.per is None:
            for e, side in zip(claim.endpoints, (claim.model, claim.reference), strict=True):
                wanted.setdefault(e.label(), (e, set()))[1].update(models_of(side))
    return [
        {
            "endpoint": label,
            "model": model,
            "seed": seed,
            "value": e.of(measured[e.measure][model, seed]["rows"]),
        }
        for label, (e, models) in wanted.items()
        for model in study.models
        if model in models
        for seed in seeds
    ]


# --------------------------------------------------------------------------- figures


def interval_label(n_seeds: int) -> str:
    return f"95 % paired t-interval over {n_seeds} seeds"


def per_layer_figure(study: Study, measured: Measured, diff: Sequence[dict], claims: Sequence[Claim], seeds):
    """Left: each model's per-layer endpoint, mean over seeds, band min-max over seeds. Right: each
    contrast's paired difference per layer, band its 95 % paired t-interval."""
    from matplotlib.figure import Figure

    from lime_probe.output import charts as C
    from lime_probe.output import plots as F

    e, key = claims[0].endpoint, claims[0].per
    assert key is not None  # `draw` groups the claims with a `per` key
    read_at: dict[
        str | Effect, Endpoint
    ] = {}  # each model's own endpoint: a cross-site claim reads its reference elsewhere
    for c in claims:
        read_at |= {c.reference: c.endpoints[1], c.model: c.endpoints[0]}
    labels = [x for x in study.models if x in read_at]
    curves = {}
    for label in labels:
        at = read_at[label]
        per = [at.per(key, measured[at.measure][label, s]["rows"]) for s in seeds]
        layers = sorted(per[0])
        values = np.array([[p[la] for la in layers] for p in per])  # (seeds, layers)
        curves[label] = {
            "layers": layers,
            "mean": values.mean(0),
            "low": values.min(0),
            "high": values.max(0),
        }
    series = {}
    for c in claims:
        rs = [
            r
            for r in diff
            if r["endpoint"] == c.label()
            and (r["model"], r["reference"]) == (name_of(c.model), name_of(c.reference))
            and key in r
        ]
        series[f"{name_of(c.model)} - {name_of(c.reference)}"] = {
            "layers": [r[key] for r in rs],
            "mean": [r["diff_mean"] for r in rs],
            "low": [r["ci_low"] for r in rs],
            "high": [r["ci_high"] for r in rs],
        }
    site = e.where.get("site", "values")
    sites = " vs ".join(dict.fromkeys(at.where.get("site", "values") for at in read_at.values()))
    with F.style():
        fig = Figure(figsize=(10.0, 3.8), layout="constrained")
        left, right = fig.subplots(1, 2)
    unit = f" [{e.unit}]" if e.unit else ""
    C.plot_layer_curves(
        curves,
        ylabel=f"{e.name}{unit}",
        xlabel=F.layer_axis_label(site),
        title=f"{e.name} ({sites}) per {key}\n(mean, band: min-max over {len(seeds)} seeds)",
        ax=left,
    )
    C.plot_layer_curves(
        series,
        ylabel=f"difference{unit}",
        xlabel=F.layer_axis_label(site),
        baseline=0.0,
        baseline_label="no difference",
        title=f"Paired difference per {key} (exploratory)\n(mean, band: {interval_label(len(seeds))})",
        ax=right,
    )
    return fig


def tier_figure(models: Sequence[str], measured: Measured, seeds: Sequence[int], measure: str = "accuracy"):
    """Arithmetic accuracy per operator count: each model's mean over ``seeds`` as a bar, its error bar
    the 95 % t-interval of that mean (one-sample, n - 1 df; not a paired interval)."""
    from scipy import stats

    from lime_probe.output import charts as F

    means: dict[str, dict[int, float]] = {}
    intervals: dict[str, dict[int, tuple[float, float]]] = {}
    for label in models:
        per_tier: dict[int, list[float]] = {}
        for s in seeds:
            for r in measured[measure][label, s]["rows"]:
                per_tier.setdefault(int(r["n_operators"]), []).append(float(r["accuracy"]))
        means[label], intervals[label] = {}, {}
        for n, xs in sorted(per_tier.items()):
            x = np.array(xs)
            half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
            means[label][n], intervals[label][n] = x.mean(), (x.mean() - half, x.mean() + half)
    return F.plot_accuracy_by_operators(
        means,
        intervals=intervals,
        interval_label=f"bars: mean over {len(seeds)} seeds; error bars: 95 % t-interval of the mean",
    )


def endpoints_figure(diff: Sequence[dict], seeds: Sequence[int]):
    """Every primary and secondary comparison as an interval, one panel per endpoint."""
    from lime_probe.output import charts as F

    rows = []
    for r in diff:
        if r["role"] == "exploratory":
            continue
        s, unit = r["scale"], f" ({r['unit']})" if r["unit"] else ""
        rows.append(
            {
                "panel": f"{r['endpoint']}{unit}",
                "label": f"{r['model']} - {r['reference']} ({r['role']})",
                "mean": s * r["diff_mean"],
                "low": s * r["ci_low"],
                "high": s * r["ci_high"],
            }
        )
    return F.plot_intervals(rows, title=f"Paired differences, mean and {interval_label(len(seeds))}")


def mean_curve(metrics: Sequence[Mapping[str, np.ndarray]]) -> dict:
    """Loss vs FLOPs and tokens averaged over seeds (the seeds share one step grid), with the loss's
    min and max over seeds at each record as ``"low"``/``"high"`` (n_records,)."""
    n = min(len(x["loss"]) for x in metrics)
    out = {k: np.mean([x[k][:n] for x in metrics], axis=0) for k in ("flops", "tokens", "loss")}
    losses = np.array([x["loss"][:n] for x in metrics])  # (seeds, records)
    return out | {"low": losses.min(0), "high": losses.max(0)}


CURVE_COLUMNS = ("step", "tokens", "flops", "loss")  # what loss_vs_flops draws of each run's metrics


def curve_rows(
    runs: Mapping[tuple[str, int], Path], labels: Sequence[str], seeds: Sequence[int]
) -> list[dict]:
    """Each run's training records (`CURVE_COLUMNS` of its metrics.jsonl) as rows with its ``model`` and
    ``seed``: the table ``loss_vs_flops`` is drawn from, committed beside it so that it redraws."""
    from lime_probe.output.results import read_metrics

    rows = []
    for label in labels:
        for s in seeds:
            m = read_metrics(runs[label, s])
            rows += [
                {"model": label, "seed": s, **{k: float(m[k][i]) for k in CURVE_COLUMNS}}
                for i in range(len(m["loss"]))
            ]
    return rows


def curves_figure(rows: Sequence[Mapping], labels: Sequence[str], seeds: Sequence[int]):
    """Training loss vs FLOPs and tokens from per-run rows (`curve_rows`, or a committed table of them):
    each model's mean over ``seeds``, band min-max over them."""
    from lime_probe.output import charts as C

    per_run: dict[tuple[str, int], list[Mapping]] = {}
    for r in rows:
        per_run.setdefault((r["model"], int(r["seed"])), []).append(r)
    curves = {
        label: mean_curve(
            [{k: np.array([float(r[k]) for r in per_run[label, s]]) for k in CURVE_COLUMNS} for s in seeds]
        )
        for label in labels
    }
    band = f"mean over {len(seeds)} seeds, band: min-max over {len(seeds)} seeds"
    return C.plot_training_curves(curves, band=band)


def table_figures(study: Study, measured: Measured, diff: Sequence[dict], seeds) -> dict[str, Any]:
    """``{file stem: Figure}`` of the figures drawn from the measured tables and their comparisons: one
    per-layer figure per endpoint read per layer, the endpoints' intervals, arithmetic accuracy per tier."""
    families: dict[tuple[str, str], list[Claim]] = {}
    for c in study.claims:
        if c.per is not None:
            families.setdefault((c.label(), c.per), []).append(c)
    figures = {}
    for (label, per), claims in families.items():
        stem = "_".join("".join(ch if ch.isalnum() else " " for ch in f"{label} per {per}").split())
        figures[stem] = per_layer_figure(study, measured, diff, claims, seeds)
    if any(r["role"] != "exploratory" for r in diff):
        figures["endpoints"] = endpoints_figure(diff, seeds)
    for name, m in study.measures.items():
        if m.analysis == "arithmetic-accuracy":
            figures[name] = tier_figure(list(study.models), measured, seeds, name)
    return figures


def draw(
    study: Study, results: Path, measured: Measured, diff, seeds, curves: Sequence[dict], out: Path
) -> None:
    from lime_probe.output import plots as F

    for stem, fig in table_figures(study, measured, diff, seeds).items():
        F.save_figure(fig, results / stem)
    F.save_figure(curves_figure(curves, list(study.models), seeds), results / "loss_vs_flops")
    # the per-seed figures (t-SNE, routers) as measured, with the tables they are drawn from
    for name, m in study.measures.items():
        if m.per != "seed":
            continue
        for seed in seeds:
            for folder in sorted((out / "measure" / name).glob(f"s{seed}-*")):
                for suffix in ("png", "pdf", "csv"):
                    for f in sorted(folder.glob(f"*.{suffix}")):
                        shutil.copyfile(f, results / f"{f.stem}_s{seed}{f.suffix}")


# --------------------------------------------------------------------------- findings.md


def format_p(p: float) -> str:
    """A p-value for a table: three significant digits, "<0.001" below that."""
    return "<0.001" if p < 0.001 else f"{p:.3g}"


def statistics_note(n: int) -> str:
    return (
        f"Beside each interval: the t-test's p, the exact sign-flip permutation p (two-sided, all 2^{n} sign "
        f"patterns; its smallest possible value at {n} seeds is {format_p(2 / 2**n)}) and the minimum detectable "
        f"effect (MDE: the true difference a paired t-test at {n} seeds detects with 80 % power at 5 %, given the "
        "observed paired std). A 'not resolved' difference smaller than its MDE says little either way."
    )


def _number(x: float, scale: float) -> str:
    return f"{scale * x:.4g}"


def claim_table(rows: Sequence[dict], holm_column: bool) -> list[str]:
    head = "| claim | model - reference | model | reference | difference [95 % paired t-interval] | p (t) |"
    head += " p (Holm over the role) |" if holm_column else ""
    lines = [head + " p (sign-flip) | MDE | verdict |", "|" + "---|" * (head.count("|") + 2)]
    for r in rows:
        s = r["scale"]
        what = f"{r['claim']}: {r['endpoint']}" if r["claim"] else r["endpoint"]
        what += f" ({r['unit']})" if r["unit"] else ""
        cells = [
            what,
            f"{r['model']} - {r['reference']}",
            _number(r["model_mean"], s),
            _number(r["reference_mean"], s),
            f"{s * r['diff_mean']:+.4g} [{s * r['ci_low']:+.4g}, {s * r['ci_high']:+.4g}]",
            format_p(r["p_t"]),
            *([format_p(r["p_holm"])] if holm_column else []),
            format_p(r["p_sign_flip"]),
            _number(r["mde"], s),
            r["verdict"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def exploratory_table(diff: Sequence[dict], alpha: float = 0.05) -> list[str]:
    """Per exploratory family: the layers with p < ``alpha`` unadjusted, after Holm and after BH, by sign."""

    def hits(rows: list[dict], key: str, per: str) -> str:
        hit = [r for r in rows if r[key] < alpha]
        parts = [
            f"{name}: {', '.join(str(r[per]) for r in hit if (r['diff_mean'] > 0) == up)}"
            for name, up in (("higher", True), ("lower", False))
            if any((r["diff_mean"] > 0) == up for r in hit)
        ]
        return "; ".join(parts) or "none"

    lines = [
        f"| endpoint | model - reference | tests | p < {alpha:g} | Holm p < {alpha:g} | BH q < {alpha:g} |",
        "|---|---|---|---|---|---|",
    ]
    families: dict[tuple, list[dict]] = {}
    for r in diff:
        if r["role"] == "exploratory" and "q_bh" in r:  # a family read per layer (or tier)
            families.setdefault((r["endpoint"], r["model"], r["reference"]), []).append(r)
    for (endpoint, model, ref), rows in families.items():
        per = next(k for k in ("layer", "n_operators") if k in rows[0])
        lines.append(
            f"| {endpoint} per {per} | {model} - {ref} | {len(rows)} | {hits(rows, 'p_t', per)} | "
            f"{hits(rows, 'p_holm', per)} | {hits(rows, 'q_bh', per)} |"
        )
    return lines


def selection_section(study: Study, selection: Sequence[dict], n: int) -> list[str]:
    """The candidates of each family, their mean and std over ``n`` seeds, and the one the rule chose."""
    assert study.select is not None  # a selection is made only for a study that declares its rule
    e = study.select.endpoint
    lines = [
        "## Selection",
        "",
        f"Rule (declared before the runs): in each family, the setting with the lowest mean {e.label()} over "
        f"the {n} seeds; std: the sample std over seeds.",
        "",
        f"| family | setting | overrides | mean {e.name} | std | per seed | chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in selection:
        overrides = ", ".join(f"`{k}={v}`" for k, v in r["overrides"].items())
        per_seed = ", ".join(f"{v:.4f}" for v in r["per_seed"])
        lines.append(
            f"| {r['family']} | {r['model']} | {overrides} | {r['mean']:.4f} | {r['std']:.4f} | {per_seed} | "
            f"{'**chosen**' if r['chosen'] else ''} |"
        )
    return [*lines, ""]


def findings(study: Study, diff: Sequence[dict], seeds: Sequence[int], selection: Sequence[dict] = ()) -> str:
    """findings.md: the question, the primary endpoints with every statistic, the secondary ones, then
    the exploratory per-layer families with their adjusted results; a selection study, its candidates and
    the chosen ones. Sections with nothing in them are left out. A study reported at fewer seeds
    than declared says so first and gives no verdict on its claims."""
    n = len(seeds)
    interim = len(seeds) < len(study.seeds)
    lines = [f"# {study.name}: {study.question}", ""]
    if interim:
        lines += [
            f"**Interim, {n} of {len(study.seeds)} seeds** ({', '.join(map(str, seeds))}): the protocol's analysis "
            f"is at {len(study.seeds)} seeds. The verdict columns below are printed as computed but decide "
            "no claim.",
            "",
        ]
    lines += [
        f"Models trained with recipe `{study.recipe}`, seeds {', '.join(map(str, seeds))}"
        + (f". Protocol: `{study.protocol}`." if study.protocol else "."),
        "",
    ]
    if selection:
        lines += selection_section(study, selection, len(seeds))
    if diff:
        lines += [
            "Every difference is model minus reference, paired by seed. Verdict from the 95 % paired "
            "t-interval: with a sign stated in advance 'holds' (excludes 0 that way) or 'reversed', without one "
            f"'higher' or 'lower', else 'not resolved'. {statistics_note(n)} Holm's adjusted p is computed over "
            "the primary endpoints and, separately, over the secondary ones.",
            "",
        ]
    for role in ("primary", "secondary"):
        rows = [r for r in diff if r["role"] == role]
        if rows:
            lines += [f"## {role.capitalize()} endpoints", "", *claim_table(rows, holm_column=True), ""]
    alone = [r for r in diff if r["role"] == "exploratory" and "q_bh" not in r]
    if alone:
        lines += [
            "## Exploratory endpoints",
            "",
            "Each read alone, outside the Holm families and without a verdict: the interval is the reading.",
            "",
            *claim_table(alone, holm_column=False),
            "",
        ]
    if any(r["role"] == "exploratory" and "q_bh" in r for r in diff):
        lines += [
            "## Per layer (exploratory)",
            "",
            "Not pre-registered endpoints: one paired t-test per layer, adjusted over each family's layers with "
            "Holm (family-wise error 5 %) and Benjamini-Hochberg (false discovery rate 5 %); no verdict. Every "
            "value: differences.csv; the intervals: the per-layer figures.",
            "",
            *exploratory_table(diff),
        ]
    return "\n".join(lines) + "\n"


def write_findings(study: Study, results: Path, seeds, runs, measured: Measured, out: Path) -> None:
    """Tables (CSV + JSON with provenance), figures, findings.md and summary.json into ``results``."""
    import torch

    from lime_model import reproducible
    from lime_probe.output.results import atomic_write_text, run_metadata, write_results

    measured = {k: {ls: v for ls, v in per.items() if ls[1] in seeds} for k, per in measured.items()}
    meta = run_metadata(
        "reproduce",
        settings={
            "study": study.name,
            "seeds": list(seeds),
            "recipe": study.recipe,
            "models": dict(study.models),
        },
        checkpoints={f"{label}-s{s}": str(p) for (label, s), p in runs.items() if s in seeds},
    )
    meta["threads"] = {
        "torch_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    meta["reproducible"] = reproducible.settings()  # the mode and its pinned settings, as the runs had them
    diff = compare(study, measured, seeds)
    selection = selection_table(study, measured, seeds)
    if selection:
        write_results(results / "selection", selection, meta=meta)
    write_results(results / "differences", diff, meta=meta)
    write_results(results / "endpoint_values", endpoint_table(study, measured, seeds), meta=meta)
    for name, rows in per_run_tables(measured).items():
        write_results(results / name, rows, meta=meta)
    curves = curve_rows(runs, list(study.models), seeds)
    write_results(results / "loss_vs_flops", curves, meta=meta)
    draw(study, results, measured, diff, seeds, curves, out)
    atomic_write_text(results / "findings.md", findings(study, diff, seeds, selection))
    atomic_write_text(
        results / "summary.json", json.dumps({"meta": meta, "differences": diff}, indent=1, default=str)
    )
