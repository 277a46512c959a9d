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
loss vs FLOPs   training loss, mean over seeds                                              Fig. 1
==============  ==========================================================================  ==========

It shares ``lime_probe.reproduce``'s machinery and layout (``train/``, ``measure/{kind}/{run}.json``,
``results/``): finished runs are reused, interrupted ones resumed, each measurement is cached per run.
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

from lime_probe.reproduce import (
    ENTROPY_PRESET,
    MODELS,
    Progress,
    _by_model,
    _mean_curve,
    _threads,
    adjust_exploratory,
    cached,
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
    from lime_probe.loading import load

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
    from lime_probe.demo import sample_text
    from lime_probe.entropy import layer_entropy
    from lime_probe.extraction import extract

    texts = [sample_text(s, tokenizer) for s in test[:n_texts]]
    acts = extract(model, tokenizer, texts, sites=["values"], max_length=recipe.seq_len, progress=False)
    layers = acts.layers("values")
    values = [layer_entropy(acts.sequences("values", la), ENTROPY_PRESET).values.tolist() for la in layers]
    return {"layers": layers, "values": values, "n_texts": len(texts)}


# --------------------------------------------------------------------------- comparisons over seeds


def compare(m: dict, seeds: Sequence[int]) -> list[dict]:
    """LIMe - LLaMA per tier (accuracy) and per layer and mean (value entropy), one row each.

    The hardest tier's accuracy is the primary endpoint; the other tiers and the mean value entropy
    are secondary; the per-layer entropies exploratory (Holm and BH over the layers)."""
    acc = m["accuracy"]
    tiers = sorted(acc["LIMe", seeds[0]]["accuracy"], key=int)
    rows = [
        differences(
            _by_model(acc, seeds, lambda r, t=tier: r["accuracy"][t]),
            "accuracy",
            +1,
            endpoint="primary" if tier == tiers[-1] else "secondary",
            operators=int(tier),
        )
        for tier in tiers
    ]
    ent = m["entropy"]
    for i, layer in enumerate(ent["LIMe", seeds[0]]["layers"]):
        per = _by_model(ent, seeds, lambda r, i=i: float(np.mean(r["values"][i])))
        rows.append(differences(per, "value entropy", +1, endpoint="exploratory", layer=layer))
    per = _by_model(ent, seeds, lambda r: float(np.mean(r["values"])))
    rows.append(differences(per, "value entropy", +1, endpoint="secondary", layer="mean"))
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


def findings(diff: Sequence[dict], seeds: Sequence[int], recipe: str, size: str) -> str:
    """findings.md: the primary endpoint (accuracy at the hardest tier), the secondary ones (the other
    tiers, the mean value entropy) with intervals, p-values, MDEs and per-seed values; then the
    per-layer value entropy as exploratory results."""
    lines = [
        f"# LIMe vs LLaMA on the Arithmetic Expression Task ({recipe}, size {size}), over seeds",
        "",
        f"LIMe minus LLaMA, paired by seed over {len(seeds)} seeds ({', '.join(map(str, seeds))}). The primary "
        "endpoint is the accuracy at the hardest tier (the most operators); the other tiers and the mean value "
        "entropy are secondary. Verdict from the 95 % paired t-interval over seeds: 'holds' when it excludes 0 "
        "with the paper's sign (LIMe higher), 'reversed' when it excludes 0 with the other sign, else 'not "
        f"resolved'. {statistics_note(seeds)}",
        "",
        "| endpoint | measure | LIMe | LLaMA | difference [95 % paired t-interval] | per seed | p (t) "
        "| p (sign-flip) | MDE | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
            f"| {r['endpoint']} | {what} | {scale * r['LIMe']:{fmt[1:]}} | {scale * r['LLaMA']:{fmt[1:]}} | "
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


def draw_tables(results: Path, m: dict, diff: Sequence[dict], seeds: Sequence[int]) -> None:
    """The interval figures, drawn from the per-run numbers alone: the accuracy difference per tier and
    the value-entropy difference per layer (95 % paired t-intervals), value entropy per layer (min-max
    band over seeds) beside its paired difference."""
    from lime_probe import figures as F

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
            title=f"{what.capitalize()}, LIMe - LLaMA\n(mean, {interval_label(len(seeds))})",
        )
        F.save_figure(fig, results / stem)
    F.save_figure(entropy_figure(m, diff, seeds, tuple(MODELS)), results / "entropy_values")


def draw(results: Path, m: dict, diff: list[dict], seeds: Sequence[int], curves: dict) -> None:
    """Accuracy per tier (mean over seeds), `draw_tables`' figures and loss vs FLOPs."""
    from lime_probe import figures as F

    acc = {
        label: {
            int(t): float(np.mean([m["accuracy"][label, s]["accuracy"][t] for s in seeds]))
            for t in m["accuracy"][label, seeds[0]]["accuracy"]
        }
        for label in MODELS
    }
    title = f"mean over {len(seeds)} seeds"
    F.save_figure(F.plot_accuracy_by_operators(acc, title=title), results / "accuracy")
    draw_tables(results, m, diff, seeds)
    F.save_figure(F.plot_training_curves(curves), results / "loss_vs_flops")


# --------------------------------------------------------------------------- the command


def run_arithmetic_study(
    out: str | os.PathLike,
    *,
    size: str = "cpu",
    seeds: Sequence[int] | None = None,
    results: str | os.PathLike | None = None,
    device: str = "cpu",
) -> Path:
    """Train or reuse the runs, measure them, compare, and write ``results`` (default ``out/results``).

    ``seeds`` replaces the size's seeds (at least two: the interval needs a spread). Returns the
    results folder.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    cfg = SIZES[size]
    seeds = tuple(cfg.seeds if seeds is None else seeds)
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be at least two distinct integers, got {list(seeds)}")
    from lime_model.train import SecondEpochWarning

    out = Path(out)
    results = Path(results) if results is not None else out / "results"
    progress = Progress(2 * len(seeds) * len(MODELS) + 1)
    with warnings.catch_warnings():  # arithmetic-cpu repeats its 10,000 expressions by design
        warnings.simplefilter("ignore", SecondEpochWarning)
        runs = train_runs(out, cfg.recipe, seeds, cfg.overrides, progress)

    m: dict[str, dict] = {"accuracy": {}, "entropy": {}}
    for (label, seed), run in runs.items():
        paths = {kind: out / "measure" / kind / f"{run_name(label, seed)}.json" for kind in m}
        progress.step(
            f"measuring {label} seed {seed}: accuracy, value entropy",
            reused=all(p.is_file() for p in paths.values()),
        )
        opened = functools.cache(lambda run=run: open_run(run, device))  # loaded only if something is missing
        m["accuracy"][label, seed] = cached(paths["accuracy"], lambda o=opened: measure_accuracy(*o()))
        m["entropy"][label, seed] = cached(
            paths["entropy"], lambda o=opened: measure_entropy(*o(), cfg.entropy_texts)
        )
    progress.step("comparing and writing the results")
    write_results_folder(results, m, seeds, cfg, runs, size)
    return results


def write_results_folder(results: Path, m: dict, seeds, cfg: ArithmeticSize, runs, size: str) -> None:
    """differences, accuracy and entropy tables (CSV, JSON), the figures, findings.md and summary.json."""
    from lime_probe.results import atomic_write_text, read_metrics, rows_to_csv, run_metadata, write_results

    meta = run_metadata(
        "reproduce --study arithmetic",
        settings={"size": size, **asdict(cfg), "seeds": list(seeds)},
        checkpoints={run_name(label, s): str(p) for (label, s), p in runs.items()},
    )
    meta["threads"] = _threads()
    diff = compare(m, seeds)
    write_results(results / "differences", diff, meta=meta)
    for kind, rows in per_run_rows(m).items():
        write_results(results / kind, rows, meta=meta)
    curves = {label: _mean_curve([read_metrics(runs[label, s]) for s in seeds]) for label in MODELS}
    draw(results, m, diff, seeds, curves)
    atomic_write_text(results / "findings.md", findings(diff, seeds, cfg.recipe, size))
    atomic_write_text(
        results / "summary.json", json.dumps({"meta": meta, "differences": diff}, indent=1, default=str)
    )
    print(
        rows_to_csv(
            [
                {k: r[k] for k in ("measure", "LIMe", "LLaMA", "diff_mean", "ci_low", "ci_high", "verdict")}
                | {"where": r.get("operators", r.get("layer", ""))}
                for r in diff
            ]
        ),
        file=sys.stderr,
    )
