"""The analyses, one `Spec` each, by command name: the single list the CLI, ``report``, the demo, the
notebooks and the tests read.

    from lime_probe.specs import ANALYSES, Extraction, Loading, load_checkpoints
    spec = ANALYSES["entropy"]
    cks = load_checkpoints(["runs/lime", "runs/llama"], ["LIMe", "LLaMA"], Loading(device="cpu"))
    result = spec.run(cks, texts, Extraction(max_length=256), site="values")   # numbers only
    result.rows, result.table()                      # tidy rows, the compact table
    figures = spec.plot(result)                      # {file stem: matplotlib Figure}

Adding an analysis: a module here with its parameter dataclass, ``compute``, ``plot`` and ``SPEC``, one
line below, a test and a notebook in analyses/. Importing this package imports no probe, model or
plotting library.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from . import (
    ablate_routes,
    blimp,
    cka,
    entropy,
    logit_lens,
    metrics,
    patch,
    perplexity,
    router,
    separability,
    training,
    tsne,
)
from .base import (
    Checkpoint,
    Extraction,
    Loading,
    Result,
    Spec,
    labels_for,
    load_checkpoints,
    named_checkpoints,
)

ANALYSES: dict[str, Spec] = {
    s.name: s
    for s in (
        entropy.SPEC,
        separability.SPEC,
        tsne.SPEC,
        blimp.SPEC,
        cka.SPEC,
        metrics.SPEC,
        logit_lens.SPEC,
        perplexity.SPEC,
        router.SPEC,
        training.CURVES,
        training.ACCURACY,
        patch.SPEC,
        ablate_routes.SPEC,
    )
}

if TYPE_CHECKING:
    from lime_probe.output.report import Section


def write_analysis(result: Result, out: Path, meta: Mapping) -> Section:
    """Draw ``result`` (a ``lime_probe.specs.Result``) with its spec's ``plot``; write its results (JSON +
    CSV, ``meta`` as their header) and figures (PNG + PDF) into ``out``; return its report section."""
    from lime_probe.output.plots import save_figure
    from lime_probe.output.report import Section, Table
    from lime_probe.output.results import write_results

    figures = ANALYSES[result.analysis].plot(result)
    write_results(out / result.name, result.rows, meta=meta, extra=result.extra)
    for stem, rows in result.tables.items():
        write_results(out / stem, rows, meta=meta)
    for stem, fig in figures.items():
        save_figure(fig, out / stem)
    return Section(
        result.title,
        text=result.text,
        figures=list(figures.values()),
        tables=[Table(result.title, result.table())]
        + [Table(stem, rows) for stem, rows in result.tables.items()],
    )


__all__ = [
    "ANALYSES",
    "write_analysis",
    "Checkpoint",
    "Extraction",
    "Loading",
    "Result",
    "Spec",
    "labels_for",
    "load_checkpoints",
    "named_checkpoints",
]
