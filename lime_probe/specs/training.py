"""What a ``lime-model train`` run logged: the loss curves and the arithmetic accuracy (paper Figures 1, 10,
4b). Both read the run folders (``metrics.jsonl``, ``arithmetic_eval.json``); no model is loaded."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lime_probe.extraction.settings import Extraction

from .base import Checkpoint, Result, Spec, group, option

EVAL_FILE = "arithmetic_eval.json"  # written by the trainer for arithmetic recipes


@dataclass(frozen=True)
class CurveParams:
    smooth: int = option(
        1, "trailing moving average over this many logged records", metavar="N", positive=True
    )


@dataclass(frozen=True)
class AccuracyParams:
    """No options: the accuracy is the one the trainer measured."""


def compute_curves(cks: Sequence[Checkpoint], _data: None, p: CurveParams, _extraction: Extraction) -> Result:
    """Training loss against FLOPs and tokens, one row per logged record of each run's metrics.jsonl."""
    from lime_probe.output.results import read_metrics

    metrics = {c.label: read_metrics(c.source) for c in cks}
    rows = [
        {"model": m, **dict(zip(cols, record, strict=True))}
        for m, cols in metrics.items()
        for record in zip(*cols.values(), strict=True)
    ]
    summary = [
        {
            "model": m,
            "steps": int(cols["step"][-1]),
            "tokens": int(cols["tokens"][-1]),
            "flops": float(cols["flops"][-1]),
            "final_loss": float(cols["loss"][-1]),
        }
        for m, cols in metrics.items()
    ]
    return Result(
        "training-curves",
        "training_curves",
        "Training curves",
        rows,
        text="Training loss (nats per target token) logged by the trainer, against cumulative training "
        "FLOPs (3 x forward) and tokens.",
        context={"smooth": p.smooth},
        summary=summary,
    )


def plot_curves(result: Result) -> dict:
    from lime_probe.output import charts as F

    runs = {
        m: {k: [r[k] for r in rs] for k in ("flops", "tokens", "loss")}
        for m, rs in group(result.rows, "model").items()
    }
    return {result.name: F.plot_training_curves(runs, smooth=result.context.get("smooth", 1))}


def has_metrics(ck: Checkpoint) -> bool:
    return (Path(ck.source) / "metrics.jsonl").is_file()


def compute_accuracy(
    cks: Sequence[Checkpoint], _data: None, p: AccuracyParams, _extraction: Extraction
) -> Result:
    """Exact-answer accuracy by operator count, as each run's trainer measured it (arithmetic_eval.json)."""
    rows = []
    for c in cks:
        path = Path(c.source) / EVAL_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{c.label}: no {EVAL_FILE} in {c.source} (written by arithmetic recipes only)"
            )
        measured = json.loads(path.read_text())["accuracy"]
        rows += [{"model": c.label, "n_operators": int(k), "accuracy": v} for k, v in measured.items()]
    return Result(
        "arithmetic-accuracy",
        "arithmetic_accuracy",
        "Arithmetic accuracy by operator count",
        rows,
        text=(
            "Exact final answer by greedy generation on the held-out expressions, per operator count "
            "(paper Figure 4b)."
        ),
    )


def plot_accuracy(result: Result) -> dict:
    from lime_probe.output import charts as F

    acc = {m: {r["n_operators"]: r["accuracy"] for r in rs} for m, rs in group(result.rows, "model").items()}
    return {result.name: F.plot_accuracy_by_operators(acc)}


def has_accuracy(ck: Checkpoint) -> bool:
    return (Path(ck.source) / EVAL_FILE).is_file()


CURVES = Spec(
    name="training-curves",
    help="training loss vs FLOPs and tokens of lime-model train runs (paper Figures 1/10)",
    example="lime-probe training-curves --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA "
    "--out out/curves",
    params=CurveParams,
    compute=compute_curves,
    plot=plot_curves,
    data_kind="none",
    notebook="training_curves",
    applies=has_metrics,
    applies_to="lime-model train runs with their metrics.jsonl",
)

ACCURACY = Spec(
    name="arithmetic-accuracy",
    help="arithmetic-task accuracy by operator count, as the trainer measured it (paper Figure 4b)",
    example="lime-probe arithmetic-accuracy --ckpt runs/aet --label LIMe --out out/accuracy"
    "   # runs/aet: lime-model train --recipe arithmetic-cpu --out runs/aet",
    params=AccuracyParams,
    compute=compute_accuracy,
    plot=plot_accuracy,
    data_kind="none",
    notebook="training_curves",
    applies=has_accuracy,
    applies_to="arithmetic runs with their arithmetic_eval.json",
)
