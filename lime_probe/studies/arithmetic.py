"""``lime-probe reproduce --study arithmetic``: LIMe vs LLaMA on the Arithmetic Expression Task over seeds.

The demo trains one LIMe/LLaMA pair on ``arithmetic-cpu`` with one seed; a one-seed gap moves by several
points across machines. This study trains the pair for every seed (same recipe, the models differ only
in ``routing``), measures each run on the task's held-out test expressions and reports LIMe - LLaMA
paired by seed with a 95 % paired t-interval, the t-test's and the exact sign-flip p and the minimum
detectable effect, whatever its sign. The primary endpoint is the accuracy at the hardest tier (the most
operators); the other tiers and the mean value entropy are secondary, the per-layer entropies exploratory
(Holm and BH over layers):

==============  ==========================================================================  ==========
measurement     what                                                                        paper
==============  ==========================================================================  ==========
accuracy        exact final answer by greedy generation, per operator count (tier)          Fig. 4b
value entropy   per layer, ``values`` site, one test expression per sequence (``lime``)      Fig. 4a
loss vs FLOPs   training loss, mean over seeds, band: min-max over seeds                    Fig. 1
==============  ==========================================================================  ==========

With ``baselines`` = the two k/v-init cells (:data:`KV_INIT_2X2`) it is a 2 x 2 study, k/v init x
routing (protocol: ``figures/arithmetic-kv-init/PROTOCOL.md``): each contrast changes one factor against
the cell that differs from it only there (:data:`CONTRASTS_2X2`), plus the interaction (the routing
effect at PyTorch's init minus the one at LLaMA's). The primary endpoints are then the hardest tier of
routing at LLaMA's init and of PyTorch's init without routing; everything else is secondary or
exploratory.

It shares ``lime_probe.studies.lm``'s machinery and layout (``train/``, ``measure/{kind}/{run}.json``,
``results/``): finished runs are reused, interrupted ones resumed, each measurement is cached per run.
Training is seed-major (every model of seed 0, then seed 1, ...) and each seed's runs are measured as
soon as they are trained, so a study stopped early holds whole seeds, measured.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lime_probe.studies.lm import (
    BASELINES,
    ENTROPY_PRESET,
    MODELS,
    Progress,
    _by_model,
    _mean_curve,
    _threads,
    adjust_exploratory,
    cached,
    curve_band,
    difference_series,
    differences,
    entropy_figure,
    entropy_rows,
    exploratory_table,
    format_p,
    interval_label,
    run_name,
    statistics_note,
    train_runs,
)

# --baselines of the k/v-init 2 x 2: LIMe with LLaMA's k/v init, LLaMA with LIMe's (PyTorch's default)
KV_INIT_2X2 = ("lime-llama-kv-init", "llama-torch-kv-init")
# (model, reference, endpoint of the hardest tier): each contrast changes one factor (or both, the last)
CONTRASTS_2X2 = (
    ("LIMe-LLaMA-kv-init", "LLaMA", "primary"),  # routing, at LLaMA's k/v init
    ("LLaMA-torch-kv-init", "LLaMA", "primary"),  # PyTorch's k/v init, without routing
    ("LIMe", "LLaMA-torch-kv-init", "secondary"),  # routing, at PyTorch's k/v init
    ("LIMe", "LIMe-LLaMA-kv-init", "secondary"),  # PyTorch's k/v init, with routing
    ("LIMe", "LLaMA", "secondary"),  # both: the LIMe vs LLaMA study's contrast
)
# the interaction's two sides: the routing effect at each init, (model, reference) of each
INTERACTION = {
    "routing at torch init": ("LIMe", "LLaMA-torch-kv-init"),
    "routing at LLaMA init": ("LIMe-LLaMA-kv-init", "LLaMA"),
}


def contrasts(labels: Sequence[str]) -> tuple[tuple[str, str, str], ...]:
    """The study's (model, reference, endpoint of the hardest tier): LIMe - LLaMA, primary, or the 2 x 2."""
    return CONTRASTS_2X2 if len(labels) > len(MODELS) else (("LIMe", "LLaMA", "primary"),)


@dataclass(frozen=True)
class ArithmeticSize:
    """How big the study is: the recipe (plus overrides), the seeds and the entropy sample."""

    recipe: str = "arithmetic-cpu"
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    overrides: Mapping[str, Any] = field(default_factory=dict)
    entropy_texts: int = 128  # test expressions whose value entropy is measured (the demo's number)


SIZES = {
    "cpu": ArithmeticSize(),
    # A smoke run for the tests: a 2-layer model on the 1- and 2-operator tiers, ~8 s per training.
    "tiny": ArithmeticSize(
        seeds=(0, 1, 2),
        overrides={
            "steps": 150,
            "warmup_steps": 5,
            "log_every": 10,
            "arithmetic.operators": [1, 2],
            "arithmetic.train_per_tier": 150,
            "arithmetic.test_per_tier": 30,
            "model.hidden_size": 32,
            "model.intermediate_size": 64,
            "model.num_hidden_layers": 2,
            "model.num_attention_heads": 2,
            "model.num_key_value_heads": 2,
            "seq_len": 24,
        },
        entropy_texts=16,
    ),
}


# --------------------------------------------------------------------------- measurements of one run


def open_run(run: Path, device: str = "cpu") -> tuple[Any, Any, Any, list]:
    """(nnsight model, tokenizer, recipe, the test expressions) of a finished arithmetic run."""
    from lime_model.recipes import load_recipe
    from lime_model.tasks.arithmetic import recipe_splits
    from lime_probe.extraction.loading import load

    recipe = load_recipe(str(run / "recipe.json"))
    _, test = recipe_splits(recipe, with_train=False)
    model, tok = load(run, device=device)
    return model, tok, recipe, test


def measure_accuracy(model, tokenizer, recipe, test) -> dict:
    """Exact-answer accuracy per operator count on the run's test expressions (greedy generation):
    {"accuracy": {tier: fraction}, "n_test_per_tier": n}."""
    from lime_model.tasks.arithmetic import evaluate

    hf = getattr(model, "_module", model)
    acc = evaluate(hf, tokenizer, test, batch_size=recipe.arithmetic.eval_batch_size)
    return {
        "accuracy": {str(n): a for n, a in acc.items()},
        "n_test_per_tier": recipe.arithmetic.test_per_tier,
    }


def measure_entropy(model, tokenizer, recipe, test, n_texts: int) -> dict:
    """Value entropy per layer of the first ``n_texts`` test expressions, one expression (bos, prompt,
    solution, eos: as in training) per sequence: {"layers": [...], "values": (layers, texts)}."""
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.entropy import layer_entropy
    from lime_probe.studies.demo import sample_text

    texts = [sample_text(s, tokenizer) for s in test[:n_texts]]
    acts = extract(model, tokenizer, texts, sites=["values"], max_length=recipe.seq_len, progress=False)
    layers = acts.layers("values")
    values = [layer_entropy(acts.sequences("values", la), ENTROPY_PRESET).values.tolist() for la in layers]
    return {"layers": layers, "values": values, "n_texts": len(texts)}


# --------------------------------------------------------------------------- comparisons over seeds


def compare(
    m: dict, seeds: Sequence[int], pairs: Sequence[tuple[str, str, str]] = contrasts(MODELS)
) -> list[dict]:
    """Each (model, reference, endpoint) of ``pairs``: model - reference per tier (accuracy) and per
    layer and mean (value entropy), one row each, paired by seed.

    The hardest tier's accuracy has the pair's ``endpoint`` (primary for a claim); the other tiers and
    the mean value entropy are secondary; the per-layer entropies exploratory (Holm and BH over the
    layers of each pair). With the 2 x 2's pairs, a secondary row adds the interaction at the hardest
    tier: the routing effect at PyTorch's k/v init minus the one at LLaMA's (`INTERACTION`)."""
    acc, ent = m["accuracy"], m["entropy"]
    tiers = sorted(acc["LIMe", seeds[0]]["accuracy"], key=int)
    rows = []
    for model, ref, endpoint in pairs:
        for tier in tiers:
            rows.append(
                differences(
                    _by_model(acc, seeds, lambda r, t=tier: r["accuracy"][t], (model, ref)),
                    "accuracy",
                    +1,
                    endpoint=endpoint if tier == tiers[-1] else "secondary",
                    reference=ref,
                    operators=int(tier),
                )
            )
        for i, layer in enumerate(ent[model, seeds[0]]["layers"]):
            per = _by_model(ent, seeds, lambda r, i=i: float(np.mean(r["values"][i])), (model, ref))
            rows.append(
                differences(per, "value entropy", +1, endpoint="exploratory", reference=ref, layer=layer)
            )
        per = _by_model(ent, seeds, lambda r: float(np.mean(r["values"])), (model, ref))
        rows.append(differences(per, "value entropy", +1, endpoint="secondary", reference=ref, layer="mean"))
    if pairs == CONTRASTS_2X2:
        effect = {}
        for side, (model, ref) in INTERACTION.items():
            per = _by_model(acc, seeds, lambda r: r["accuracy"][tiers[-1]], (model, ref))
            effect[side] = np.subtract(per[model], per[ref]).tolist()
        sides = list(INTERACTION)
        rows.append(
            differences(
                effect, "accuracy", +1, endpoint="secondary", reference=sides[1], operators=int(tiers[-1])
            )
        )
    return adjust_exploratory(rows)


def per_run_rows(m: dict) -> dict[str, list[dict]]:
    """Per-run tables: accuracy per tier, value entropy per layer (mean and std over the expressions)."""
    out: dict[str, list[dict]] = {"accuracy": [], "entropy": []}
    for (label, seed), r in m["accuracy"].items():
        for tier, a in r["accuracy"].items():
            out["accuracy"].append(
                {
                    "model": label,
                    "seed": seed,
                    "operators": int(tier),
                    "accuracy": a,
                    "n": r["n_test_per_tier"],
                }
            )
    out["entropy"] = entropy_rows(m["entropy"], unit="texts")
    return out


def findings(
    diff: Sequence[dict], seeds: Sequence[int], recipe: str, size: str, protocol: str | None = None
) -> str:
    """findings.md: the primary endpoints (accuracy at the hardest tier), the secondary ones (the other
    tiers, the mean value entropy, the 2 x 2's other contrasts) with intervals, p-values, MDEs and
    per-seed values; then the per-layer value entropy as exploratory results. ``protocol`` names where
    the study's protocol is written."""
    two_by_two = any(r["reference"] != "LLaMA" for r in diff)
    title = "k/v init x routing (2 x 2)" if two_by_two else "LIMe vs LLaMA"
    what = (
        "Each model minus its reference (the cell that differs from it in one factor; the interaction: "
        "the routing effect at PyTorch's k/v init minus the one at LLaMA's), paired by seed"
        if two_by_two
        else "LIMe minus LLaMA, paired by seed"
    )
    lines = [
        f"# {title} on the Arithmetic Expression Task ({recipe}, size {size}), over seeds",
        "",
        f"{what}, over {len(seeds)} seeds ({', '.join(map(str, seeds))}). The primary endpoint of each claim "
        "is the accuracy at the hardest tier (the most operators); the other tiers and the mean value entropy "
        "are secondary. Verdict from the 95 % paired t-interval over seeds: 'holds' when it excludes 0 with "
        "the model higher, 'reversed' when it excludes 0 with the other sign, else 'not resolved'. "
        f"{statistics_note(seeds)}" + (f" Protocol: {protocol}." if protocol else ""),
        "",
        "| endpoint | measure | model - reference | model | reference | difference [95 % paired t-interval] "
        "| per seed | p (t) | p (sign-flip) | MDE | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(
        (r for r in diff if r["endpoint"] != "exploratory"), key=lambda r: r["endpoint"] != "primary"
    )
    for r in ordered:
        if r["measure"] == "accuracy":
            what, scale, fmt = f"accuracy, {r['operators']} operators (points)", 100, "+.1f"
        else:
            what, scale, fmt = "value entropy, mean over layers (nats)", 1, "+.3f"
        per_seed = ", ".join(f"{scale * d:{fmt}}" for d in r["per_seed_diff"])
        mean, low, high = (scale * r[k] for k in ("diff_mean", "ci_low", "ci_high"))
        lines.append(
            f"| {r['endpoint']} | {what} | {r['model']} - {r['reference']} | {scale * r[r['model']]:{fmt[1:]}} | "
            f"{scale * r[r['reference']]:{fmt[1:]}} | "
            f"{mean:{fmt}} [{low:{fmt}}, {high:{fmt}}] | {per_seed} | {format_p(r['p_t'])} | "
            f"{format_p(r['p_sign_flip'])} | {scale * r['mde']:{fmt[1:]}} | {r['verdict']} |"
        )
    lines += [
        "",
        "## Value entropy per layer (exploratory)",
        "",
        "One t-test per layer, adjusted over the layers with Holm (family-wise error 5 %) and "
        "Benjamini-Hochberg (false discovery rate 5 %); no verdict. Every value: differences.csv; the "
        "intervals: entropy_values.png, entropy_difference.png.",
        "",
        *exploratory_table(diff, ("value entropy",)),
    ]
    return "\n".join(lines) + "\n"


def draw_tables(
    results: Path, m: dict, diff: Sequence[dict], seeds: Sequence[int], labels: Sequence[str] = tuple(MODELS)
) -> None:
    """The interval figures, drawn from the per-run numbers alone: the accuracy difference per tier and
    the value-entropy difference per layer (95 % paired t-intervals), value entropy per layer (min-max
    band over seeds) beside its paired difference."""
    from lime_probe.output import plots as F

    minus = "LIMe - LLaMA" if len(labels) == len(MODELS) else "model - reference"
    for what, key, stem, xlabel, ylabel in (
        ("accuracy", "operators", "accuracy_difference", "operators", "accuracy difference (fraction)"),
        ("value entropy", "layer", "entropy_difference", "layer", "entropy difference (nats)"),
    ):
        fig = F.plot_layer_curves(
            difference_series(diff, what, key),
            xlabel=xlabel,
            ylabel=ylabel,
            baseline=0.0,
            baseline_label="no difference",
            title=f"{what.capitalize()}, {minus}\n(mean, {interval_label(len(seeds))})",
        )
        F.save_figure(fig, results / stem)
    fig = entropy_figure(m, diff, seeds, labels)
    if minus != "LIMe - LLaMA":  # the 2 x 2's references are not all LLaMA
        fig.axes[1].set_title(f"Paired difference per layer\n(mean, {interval_label(len(seeds))})")
    F.save_figure(fig, results / "entropy_values")


def accuracy_intervals(m: dict, seeds: Sequence[int], labels: Sequence[str]) -> tuple[dict, dict]:
    """Per model and tier: the accuracy's mean over seeds and its 95 % t-interval over seeds
    (mean +- t_{0.975, n-1} * std / sqrt(n)), ``({label: {tier: mean}}, {label: {tier: (low, high)}})``."""
    from lime_probe.probes.stats import paired_difference

    means, intervals = {}, {}
    for label in labels:
        means[label], intervals[label] = {}, {}
        for t in m["accuracy"][label, seeds[0]]["accuracy"]:
            per_seed = [m["accuracy"][label, s]["accuracy"][t] for s in seeds]
            d = paired_difference(per_seed, np.zeros(len(seeds)))  # against 0: the one-sample t-interval
            means[label][int(t)], intervals[label][int(t)] = d.mean, (d.ci_low, d.ci_high)
    return means, intervals


def draw_accuracy(
    results: Path, m: dict, seeds: Sequence[int], labels: Sequence[str] = tuple(MODELS)
) -> None:
    """Accuracy per tier: each model's mean over seeds, error bars its 95 % t-interval over seeds."""
    from lime_probe.output import plots as F

    means, intervals = accuracy_intervals(m, seeds, labels)
    fig = F.plot_accuracy_by_operators(
        means,
        title=f"Arithmetic expressions: accuracy by operator count, mean over {len(seeds)} seeds",
        intervals=intervals,
        interval_label=f"error bars: 95 % t-interval of the mean over {len(seeds)} seeds",
    )
    F.save_figure(fig, results / "accuracy")


def draw(
    results: Path,
    m: dict,
    diff: list[dict],
    seeds: Sequence[int],
    curves: dict,
    labels: Sequence[str] = tuple(MODELS),
) -> None:
    """Accuracy per tier (`draw_accuracy`), `draw_tables`' figures and loss vs FLOPs (mean over seeds,
    min-max band)."""
    from lime_probe.output import plots as F

    draw_accuracy(results, m, seeds, labels)
    draw_tables(results, m, diff, seeds, labels)
    F.save_figure(F.plot_training_curves(curves, band=curve_band(len(seeds))), results / "loss_vs_flops")


# --------------------------------------------------------------------------- the command


def run_arithmetic_study(
    out: str | os.PathLike,
    *,
    size: str = "cpu",
    seeds: Sequence[int] | None = None,
    results: str | os.PathLike | None = None,
    device: str = "cpu",
    baselines: Sequence[str] = (),
) -> Path:
    """Train or reuse the runs, measure them, compare, and write ``results`` (default ``out/results``).

    ``seeds`` replaces the size's seeds (at least two: the interval needs a spread). ``baselines``:
    none (LIMe vs LLaMA) or the two k/v-init cells (`KV_INIT_2X2`, the 2 x 2). Seed-major: each seed's
    runs are trained, then measured, before the next seed's. Returns the results folder.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    cfg = SIZES[size]
    seeds = tuple(cfg.seeds if seeds is None else seeds)
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be at least two distinct integers, got {list(seeds)}")
    if set(baselines) not in (set(), set(KV_INIT_2X2)):
        raise ValueError(
            f"--study arithmetic takes --baselines {','.join(KV_INIT_2X2)} (the k/v-init 2 x 2) or none, "
            f"got {','.join(baselines)}"
        )
    from lime_model.train import SecondEpochWarning

    out = Path(out)
    results = Path(results) if results is not None else out / "results"
    models = {**MODELS, **dict(BASELINES[b] for b in KV_INIT_2X2 if b in baselines)}
    progress = Progress(2 * len(seeds) * len(models) + 1)
    runs: dict[tuple[str, int], Path] = {}
    m: dict[str, dict] = {"accuracy": {}, "entropy": {}}
    for seed in seeds:
        with warnings.catch_warnings():  # arithmetic-cpu repeats its 10,000 expressions by design
            warnings.simplefilter("ignore", SecondEpochWarning)
            trained = train_runs(out, cfg.recipe, [seed], cfg.overrides, progress, models=models)
        runs.update(trained)
        for (label, _), run in trained.items():
            paths = {kind: out / "measure" / kind / f"{run_name(label, seed)}.json" for kind in m}
            progress.step(
                f"measuring {label} seed {seed}: accuracy, value entropy",
                reused=all(p.is_file() for p in paths.values()),
            )
            opened = functools.cache(lambda run=run: open_run(run, device))  # loaded only if one is missing
            m["accuracy"][label, seed] = cached(paths["accuracy"], lambda o=opened: measure_accuracy(*o()))
            m["entropy"][label, seed] = cached(
                paths["entropy"], lambda o=opened: measure_entropy(*o(), cfg.entropy_texts)
            )
    progress.step("comparing and writing the results")
    write_results_folder(results, m, seeds, cfg, runs, size, list(models))
    return results


def write_results_folder(
    results: Path,
    m: dict,
    seeds,
    cfg: ArithmeticSize,
    runs,
    size: str,
    labels: Sequence[str] = tuple(MODELS),
) -> None:
    """differences, accuracy and entropy tables (CSV, JSON), the figures, findings.md and summary.json
    for the ``labels`` models (LIMe and LLaMA, or the 2 x 2's four)."""
    from lime_probe.output.results import (
        atomic_write_text,
        read_metrics,
        rows_to_csv,
        run_metadata,
        write_results,
    )

    meta = run_metadata(
        "reproduce --study arithmetic",
        settings={"size": size, **asdict(cfg), "seeds": list(seeds), "models": list(labels)},
        checkpoints={run_name(label, s): str(p) for (label, s), p in runs.items()},
    )
    meta["threads"] = _threads()
    diff = compare(m, seeds, contrasts(labels))
    write_results(results / "differences", diff, meta=meta)
    for kind, rows in per_run_rows(m).items():
        write_results(results / kind, rows, meta=meta)
    curves = {label: _mean_curve([read_metrics(runs[label, s]) for s in seeds]) for label in labels}
    draw(results, m, diff, seeds, curves, labels)
    protocol = "PROTOCOL.md in this folder" if (results / "PROTOCOL.md").is_file() else None
    atomic_write_text(results / "findings.md", findings(diff, seeds, cfg.recipe, size, protocol))
    atomic_write_text(
        results / "summary.json", json.dumps({"meta": meta, "differences": diff}, indent=1, default=str)
    )
    print(
        rows_to_csv(
            [
                {
                    k: r[k]
                    for k in ("measure", "model", "reference", "diff_mean", "ci_low", "ci_high", "verdict")
                }
                | {"where": r.get("operators", r.get("layer", ""))}
                for r in diff
            ]
        ),
        file=sys.stderr,
    )
