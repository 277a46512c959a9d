"""The report: several analyses run in sequence on the checkpoints each applies to, their results and
figures written into one folder with a self-contained HTML page. ``lime-probe report`` is `run_report`
with its options translated; a script calls it the same way.

    from lime_probe.specs import load_checkpoints
    from lime_probe.specs.reporting import run_report
    cks = load_checkpoints(["runs/lime", "runs/llama"], ["LIMe", "LLaMA"], "cpu")
    report = run_report(cks, ["entropy", "cka"], "out/report", data="valid.txt", joined={"blimp": "data/blimp"})
    report.results["entropy"].rows, report.skipped      # out/report/report.html, JSON, CSV and figures
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lime_model.checks import BAD_INPUT, one_line

from . import ANALYSES, write_analysis
from .base import Checkpoint, Extraction, Result, Spec
from .data import DATA_KINDS, load_data

if TYPE_CHECKING:
    from lime_probe.output.report import Section

# The analyses a report's texts serve (those that read texts or the run folders), those it runs by default,
# and those that join through data of their own, {analysis: its command-line option} (BLiMP: --blimp).
REPORTABLE = [n for n, s in ANALYSES.items() if s.in_report and DATA_KINDS[s.data_kind].report is None]
REPORT_DEFAULT = [n for n, s in ANALYSES.items() if s.in_report and DATA_KINDS[s.data_kind].texts]
REPORT_JOINED = {
    n: report[0] for n, s in ANALYSES.items() if (report := DATA_KINDS[s.data_kind].report) is not None
}


@dataclass
class Report:
    """What `run_report` wrote: each analysis's `Result`, the page's sections (a "Skipped sections" one
    last when any was), and the analyses skipped, each ``{"analysis", "reason"}``: ``skipped`` failed on
    their input, ``left_out`` apply to none of the checkpoints."""

    results: dict[str, Result] = field(default_factory=dict)
    sections: list[Section] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    left_out: list[dict] = field(default_factory=list)


def own_layers(spec: Spec) -> bool:
    """Whether the analysis reads ``layers`` itself (a parameter of its own, e.g. BLiMP's 'paper')."""
    return "layers" in {f.name for f in dataclasses.fields(spec.params)}


def differing_defaults() -> dict[str, str]:
    """The parameters whose default differs between the analyses a report runs (their parameter
    dataclasses): ``{field: "values (entropy, separability); hidden (cka)"}``."""
    by_field: dict[str, dict[str, list[str]]] = {}
    for name in [*REPORTABLE, *REPORT_JOINED]:
        for f in dataclasses.fields(ANALYSES[name].params):
            shown = " ".join(map(repr, f.default)) if isinstance(f.default, tuple) else str(f.default)
            by_field.setdefault(f.name, {}).setdefault(shown, []).append(name)
    return {
        k: "; ".join(f"{v} ({', '.join(ns)})" for v, ns in d.items())
        for k, d in by_field.items()
        if len(d) > 1
    }


def text_sizes(analyses: Sequence[str], max_sequences: int | None) -> dict[str, int]:
    """How many documents each of ``analyses`` that reads texts takes: ``max_sequences``, else its own
    `Spec.max_sequences` (what its command takes by default)."""
    return {
        n: max_sequences or ANALYSES[n].max_sequences
        for n in analyses
        if DATA_KINDS[ANALYSES[n].data_kind].texts
    }


def report_texts(analyses: Sequence[str], source: str | None, max_sequences: int | None) -> list[str] | None:
    """The documents of ``source`` that ``analyses`` read, read once: as many as the largest of
    `text_sizes` (None: none of them reads texts, or no source)."""
    sizes = text_sizes(analyses, max_sequences)
    return load_data("texts", source, max(sizes.values())) if sizes else None


def results_meta(command: str, settings: Mapping[str, Any], cks: Sequence[Checkpoint]) -> dict:
    """The header of results written by ``command``: its ``settings`` and the checkpoints' identities."""
    from lime_probe.output.results import run_metadata

    return run_metadata(
        command,
        settings=settings,
        checkpoints={c.label: c.source for c in cks},
        revisions={c.label: c.revision for c in cks},
    )


def analyse(spec: Spec, cks: Sequence[Checkpoint], data: Any, params: Any, extraction: Extraction) -> Result:
    """``spec.compute`` under ``extraction``, over every layer for an analysis that reads ``layers`` itself;
    its cache entries are listed under its name."""
    from lime_probe.extraction.cachedir import cache_use

    if own_layers(spec):
        extraction = dataclasses.replace(extraction, layers=None)
    with cache_use(spec.name):
        return spec.compute(cks, data, params, extraction)


def run_report(
    checkpoints: Sequence[Checkpoint],
    analyses: Sequence[str],
    out: str | Path,
    *,
    data: str | Sequence[str] | None = None,
    joined: Mapping[str, str] | None = None,
    params: Mapping[str, Any] | None = None,
    max_sequences: int | None = None,
    extraction: Extraction | None = None,
    settings: Mapping[str, Any] | None = None,
    on_result: Callable[[Result], None] | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> Report:
    """Run ``analyses`` in order on the checkpoints each applies to and write one self-contained HTML
    report, ``out/report.html``, beside each analysis's results (JSON, CSV) and figures (PNG, PDF).

    A section that fails on its input (e.g. a word too rare in the data) is skipped, not fatal: the
    report keeps the sections that worked and lists the skipped ones with the reason.

    Args:
        checkpoints: loaded checkpoints (`load_checkpoints`), side by side in every section.
        analyses: names of `REPORTABLE` analyses, run in this order.
        out: the folder written into (created if missing).
        data: the texts: a source `load_data` reads (as many documents as the analyses take, once), or the
            documents themselves; each analysis takes its first `text_sizes`.
        joined: ``{analysis: its data source}`` for analyses of `REPORT_JOINED` (BLiMP), run after
            ``analyses``; their errors name the option of `REPORT_JOINED`.
        params: ``{analysis: its parameter dataclass}``; one left out runs with its defaults.
        max_sequences: documents per analysis that reads texts (None: each analysis's own).
        extraction: the extraction settings (layers, size limits, cache; None: `Extraction`'s defaults).
        settings: recorded in every result's header (the command line's options).
        on_result: called with each result as it is written (the command prints its table).
        on_skip: called with each skipped analysis and the reason, as it is skipped.

    Returns:
        The `Report`: results, sections and the analyses skipped.

    Raises:
        ValueError: when every section failed or was left out, naming each reason.
    """
    joined = dict(joined or {})
    names = _checked_names(analyses, joined)
    chosen_params = {n: (params or {}).get(n, ANALYSES[n].params()) for n in names}
    sizes = text_sizes(names, max_sequences)
    texts = report_texts(names, data, max_sequences) if isinstance(data, str) else data
    settings = dict(settings or {})
    meta = results_meta("report", settings, checkpoints)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report()

    def skip(into: list[dict], name: str, reason: str) -> None:
        into.append({"analysis": name, "reason": reason})
        if on_skip is not None:
            on_skip(name, reason)

    for name in names:
        spec = ANALYSES[name]
        chosen = [c for c in checkpoints if spec.applies(c)]
        if not chosen:
            reason = f"it applies to {spec.applies_to or 'other checkpoints'}, and none of these is one"
            skip(report.left_out, name, reason)
            continue
        size = {"max_sequences": sizes[name]} if name in sizes else {}
        used = dataclasses.asdict(chosen_params[name]) | size
        try:
            section_data = _section_data(spec, joined, texts, sizes, chosen_params[name])
            result = analyse(spec, chosen, section_data, chosen_params[name], extraction or Extraction())
        except BAD_INPUT as e:
            skip(report.skipped, name, one_line(e))
            continue
        report.results[name] = result
        report.sections.append(
            write_analysis(result, out, results_meta("report", settings | used, checkpoints))
        )
        if on_result is not None:
            on_result(result)
    _write_page(report, checkpoints, out / "report.html", meta)
    return report


def _checked_names(analyses: Sequence[str], joined: Mapping[str, str]) -> list[str]:
    """The analyses a report runs, in order: ``analyses`` then the ``joined``; ValueError naming any that
    is not one a report runs."""
    unknown = [n for n in analyses if n not in REPORTABLE] + [n for n in joined if n not in REPORT_JOINED]
    if unknown:
        raise ValueError(
            f"not an analysis a report runs: {', '.join(unknown)} (analyses: {', '.join(REPORTABLE)}; "
            f"joined: {', '.join(REPORT_JOINED)})"
        )
    return [*analyses, *joined]


def _section_data(
    spec: Spec,
    joined: Mapping[str, str],
    texts: Sequence[str] | None,
    sizes: Mapping[str, int],
    params: Any,
) -> Any:
    """The data of one section: a joined analysis's own source, read now (a bad source skips its section
    only, its errors naming its option of `REPORT_JOINED`), else its `text_sizes` first documents of the
    report's ``texts`` (None: the analysis reads no texts)."""
    name = spec.name
    if name in joined:
        return load_data(spec.data_kind, joined[name], params=params, option=REPORT_JOINED[name])
    return texts[: sizes[name]] if name in sizes and texts is not None else None


def _write_page(report: Report, checkpoints: Sequence[Checkpoint], path: Path, meta: dict) -> None:
    """The report's HTML page at ``path``: its sections, then the skipped ones listed with their reasons;
    ValueError naming each reason when no section was written."""
    from lime_probe.output.report import Section, Table, write_report

    if not report.sections:
        raise ValueError(
            "every section failed: "
            + "; ".join(f"{s['analysis']}: {s['reason']}" for s in [*report.skipped, *report.left_out])
        )
    if report.skipped or report.left_out:
        text = (
            "These analyses were skipped because their input did not allow them or they apply to none of "
            "the checkpoints; the others are above."
        )
        skips = report.skipped + report.left_out
        report.sections.append(Section("Skipped sections", text=text, tables=[Table("skipped", skips)]))
    labels = " vs ".join(c.label for c in checkpoints)
    write_report(path, f"lime-probe report: {labels}", report.sections, meta=meta)
