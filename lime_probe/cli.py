"""``lime-probe``: the paper's analyses from the command line.

    lime-probe entropy --ckpt runs/lime --ckpt runs/llama --data valid.txt --site values --out out/

Every command compares one or more ``--ckpt`` side by side (named by ``--label``), writes
results as JSON and CSV (settings, checkpoint identity and versions recorded; see
``lime_probe.output.results``) and figures as PNG and PDF into ``--out``, and prints a compact table.

Output is staged in a hidden temporary folder beside ``--out`` and moved in only when the
command succeeds (`lime_probe.output.staging`), so a failure or Ctrl-C never leaves half-written files there. Exit codes:
0 done, 2 bad usage or input (one line on stderr), 3 written but incomplete (``report`` skipped a
section for its input, one line naming them; ``--allow-skips`` makes that 0), 1 an unexpected failure,
130 interrupted.

Every subcommand is a ``lime_model.command_line.Command`` in `COMMANDS`, and ``build_parser`` is one loop
over them: one per analysis of the registry ``lime_probe.specs.ANALYSES`` (its options generated from the
analysis's parameter dataclass and the settings dataclasses ``Loading`` and ``Extraction`` by
``lime_probe.cli_options``, its ``--data`` from ``lime_probe.specs.data.DATA_KINDS`` by its data kind), then report, demo, reproduce (a study of
``lime_probe.studies.STUDIES``) and cache. ``lime-model`` declares its commands the same way; options that
both programs take have the same names and meanings (``--out``: the folder a command writes into), and both
map how a command ends to an exit code with ``lime_model.command_line.run_command``. This module parses arguments
and translates them into the settings dataclasses and calls below it. It imports nothing heavy (torch, transformers, matplotlib) before the
arguments are parsed and every input that needs no model is checked (`check_inputs`), so ``--help``,
usage errors and a bad path, number or output folder are named within a second; Ctrl-C at any point, imports
included, prints one line and exits 130.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from lime_model import command_line
from lime_model.checks import check_device
from lime_model.command_line import Command, print_error, run_command, run_program
from lime_probe import cli_options
from lime_probe.cli_options import dest
from lime_probe.extraction.settings import Extraction, Loading, from_options
from lime_probe.output.console import format_table, one_line_warnings
from lime_probe.output.staging import staged_output
from lime_probe.specs import ANALYSES, Checkpoint, Spec, load_checkpoints, named_checkpoints
from lime_probe.specs.base import configure_threads
from lime_probe.specs.data import DATA_KINDS, load_data
from lime_probe.specs.inputs import check_request
from lime_probe.specs.reporting import REPORT_JOINED, analyse, report_texts, results_meta, run_report
from lime_probe.specs.reporting import own_layers as _own_layers
from lime_probe.studies import STUDIES  # declarations only: no model code

PROG = "lime-probe"


# --------------------------------------------------------------------------- settings of the parsed arguments


def extraction_of(args: argparse.Namespace, own_layers: bool = False) -> Extraction:
    """The extraction settings of a parsed command line; with ``own_layers`` (the analysis reads ``--layers``
    itself) every layer."""
    return from_options(Extraction, vars(args), skip=("layers",) if own_layers else ())


def loading_of(args: argparse.Namespace) -> Loading:
    """How a parsed command line loads its checkpoints: ``--device`` or ``--device-map`` (ValueError for
    both), ``--dtype``, ``--revision``, ``--verbose``."""
    return from_options(Loading, vars(args))


# --------------------------------------------------------------------------- commands


def params_of(spec: Spec, args: argparse.Namespace):
    """The parameter dataclass of ``spec`` filled from the options generated from its fields; a field
    without its option in ``args`` (``report``'s options left out) keeps the analysis's default."""
    return from_options(spec.params, vars(args))


def _settings(args: argparse.Namespace) -> dict:
    """The command line's settings, as the results' header records them."""
    return {k: v for k, v in vars(args).items() if k != "debug"}


def _checkpoints(spec: Spec, args) -> list[Checkpoint]:
    """The checkpoints of ``args``: loaded, or only named for analyses that read their run folders."""
    if spec.data_kind == "none":
        return named_checkpoints(args.ckpt, args.label)
    return load_checkpoints(args.ckpt, args.label, loading_of(args))


def _analysis_command(spec: Spec) -> Callable:
    def handler(args, out: Path) -> None:
        from lime_probe.specs import write_analysis

        params = params_of(spec, args)
        source = getattr(args, dest(DATA_KINDS[spec.data_kind].flag), None)
        lazy = spec.streams(params)  # an analysis that reads its texts in one pass never holds them whole
        data = load_data(
            spec.data_kind, source, getattr(args, "max_sequences", None), params=params, lazy=lazy
        )
        cks = _checkpoints(spec, args)
        result = analyse(spec, cks, data, params, extraction_of(args, _own_layers(spec)))
        write_analysis(result, out, results_meta(spec.name, _settings(args), cks))
        print(format_table(result.table()))

    return handler


def cmd_report(args, out: Path) -> str | None:
    """Run the chosen analyses on the checkpoints each applies to and write one self-contained HTML report
    (`lime_probe.specs.reporting.run_report`, with the command line's options).

    Each analysis runs with its own command's defaults (``--max-sequences`` its ``Spec.max_sequences``, every
    option left out its own default), so a section equals the command's result. A section that fails on
    its input is skipped and named on stderr; the command returns a one-line summary of them (exit 3)
    unless ``--allow-skips``. With ``--blimp DIR`` the BLiMP analysis joins (an analysis of
    `REPORT_JOINED` reads its data from an option of report's own)."""
    names = _analyses_of(args)
    joined = {n: getattr(args, dest(flag)) for n, flag in REPORT_JOINED.items() if n in names}
    texts = report_texts(names, args.data, args.max_sequences)  # before the models: a bad --data fails fast
    cks = load_checkpoints(args.ckpt, args.label, loading_of(args))
    report = run_report(
        cks,
        list(args.analyses),
        out,
        data=texts,
        joined=joined,
        params={name: params_of(ANALYSES[name], args) for name in names},
        max_sequences=args.max_sequences,
        extraction=extraction_of(args),
        settings=_settings(args),
        on_result=lambda result: print(f"\n{result.title}\n{format_table(result.table())}"),
        on_skip=lambda name, reason: print_error(f"{PROG} report: skipped {name}: {reason}"),
    )
    if report.skipped and not args.allow_skips:
        return (
            f"{len(report.skipped)} of {len(report.skipped) + len(report.results)} sections skipped ("
            + "; ".join(f"{s['analysis']}: {s['reason']}" for s in report.skipped)
            + "); the report lists them; --allow-skips accepts a partial report"
        )
    return None


def cmd_demo(args, out: Path) -> None:
    """Train tiny LIMe and LLaMA models on arithmetic, run every analysis (``lime_probe.studies.demo``) and print
    what it measured and where it is."""
    from lime_probe.studies.demo import run_demo

    runs = args.runs or os.path.join(args.out, "runs")
    _, headline = run_demo(out, quick=args.quick, seed=args.seed, device=args.device, runs=runs)
    print(format_table(headline))
    print(f"report: {os.path.join(args.out, 'report.html')}; figures (PNG, PDF), JSON and CSV: {args.out}")
    print(f"checkpoints: {runs} (a rerun reuses them)")


def _reproducible(args: argparse.Namespace) -> bool | None:
    """The mode a command runs in: its --reproducible flag, else the demo's (on) or the study's; None for
    a command without the flag."""
    if not hasattr(args, "reproducible"):
        return None
    if args.reproducible is not None:
        return args.reproducible
    return STUDIES[args.study].reproducible if args.command == "reproduce" else True


def cmd_reproduce(args) -> None:
    """Train or reuse the runs of a study, measure, compare (``lime_probe.studies.run_study``); writes in
    place, resumable."""
    from lime_probe.studies import run_study

    results = run_study(
        args.study,
        data=args.data,
        out=args.out,
        results=args.results,
        seeds=args.seeds,
        size=args.size,
        device=args.device,
        reproducible=_reproducible(args),
    )
    print(f"results in {results} (findings.md)", file=sys.stderr)


def cmd_cache(args) -> None:
    """List or clear the activation cache (``lime_probe.extraction.cachedir.cache_report``)."""
    from lime_probe.extraction.cachedir import cache_report

    print(
        cache_report(
            args.cache_dir,
            clear=args.clear,
            older_than_days=args.older_than,
            checkpoint=args.ckpt,
            yes=args.yes,
        )
    )


def _staged(handler: Callable[[argparse.Namespace, Path], str | None]) -> Callable:
    """``handler(args, folder)`` run on a staged folder that becomes ``--out`` when it succeeds
    (`staged_output`): a command that fails or is interrupted leaves ``--out`` as it was."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> str | None:
        with staged_output(args.out) as folder:
            incomplete = handler(args, folder)
        print(f"results in {args.out}", file=sys.stderr)
        return incomplete

    return run


STAGED = "nothing was written to {out}"


def _analysis(spec: Spec) -> Command:
    return Command(
        spec.name,
        spec.help,
        spec.example,
        _staged(_analysis_command(spec)),
        cli_options.analysis_options(spec),
        interrupted=STAGED,
    )


# Every subcommand; their examples are run as written by tests/test_docs_examples.py.
COMMANDS: dict[str, Command] = {
    c.name: c
    for c in [
        *map(_analysis, ANALYSES.values()),
        Command(
            "report",
            "run several analyses and write one self-contained HTML report",
            "lime-probe report --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
            "    --data data/wikitext-2/valid.txt --blimp data/blimp --allow-skips \\\n"
            "    --out out/report   # then open out/report/report.html (--allow-skips: the cpu-tiny runs' "
            "64-token documents hold too few ' are' for separability)",
            _staged(cmd_report),
            cli_options.report_options,
            interrupted=STAGED,
        ),
        Command(
            "demo",
            "train tiny LIMe and LLaMA models on arithmetic, offline, and run every analysis",
            "lime-probe demo                 # a few minutes on 2 CPU cores (README: measured time), writes "
            "lime-probe-out/demo/\n"
            "lime-probe demo --quick --out /tmp/demo   # a 1-minute smoke run",
            _staged(cmd_demo),
            cli_options.demo_options,
            interrupted=STAGED,
        ),
        Command(
            "reproduce",
            "train a study's models over seeds, measure them and test its pre-registered claims (resumable)",
            "lime-probe reproduce --study lm-cpu --data data --size tiny --out /tmp/repro"
            "   # a 2-minute smoke run\n"
            "lime-probe reproduce --study lm-cpu --data data --results figures/lm-cpu"
            "   # not run in tests: about an hour\n"
            "lime-probe reproduce --study arithmetic-seeds --results figures/arithmetic-seeds"
            "   # not run in tests: about 30 min at one thread",
            cmd_reproduce,
            cli_options.reproduce_options,
            description="Train a study's models over its seeds (or reuse finished runs), measure them and test "
            "its pre-registered\nclaims; a rerun continues where the last one stopped. The studies:\n",
            interrupted="run the same command again to continue (finished runs and measurements are reused)",
        ),
        Command(
            "cache",
            "list the activation cache's entries by checkpoint and analysis with their sizes, or clear them",
            "lime-probe cache                        # size per entry and the total\n"
            "lime-probe cache --clear --older-than 30 --yes   # remove entries last used over 30 days ago\n"
            "lime-probe cache --clear --ckpt runs/lime --yes   # remove one checkpoint's entries",
            cmd_cache,
            cli_options.cache_options,
            interrupted="",
        ),
    ]
}


def build_parser() -> argparse.ArgumentParser:
    """The ``lime-probe`` argument parser: one subcommand per entry of `COMMANDS`."""
    return command_line.build_parser(
        PROG, "The LIMe paper's analyses of representation collapse.", COMMANDS.values()
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command, map errors to exit codes (see module doc)."""
    return run_program(PROG, argv, build_parser, _run)


def _analyses_of(args: argparse.Namespace) -> list[str]:
    """The analyses a parsed command line runs: its own, or report's chosen ones."""
    if args.command in ANALYSES:
        return [args.command]
    if args.command == "report":
        return list(args.analyses) + [n for n, flag in REPORT_JOINED.items() if getattr(args, dest(flag))]
    return []


def _loads_models(args: argparse.Namespace) -> bool:
    """Whether the command loads its ``--ckpt`` as models (not only reading run folders, as router does)."""
    return args.command == "report" or getattr(ANALYSES.get(args.command), "data_kind", "none") != "none"


def _text_data(args: argparse.Namespace) -> str | None:
    """The ``--data`` of a parsed command line when it holds texts (not BLiMP, not reproduce's folder)."""
    kind = "texts" if args.command == "report" else getattr(ANALYSES.get(args.command), "data_kind", "none")
    return getattr(args, "data", None) if DATA_KINDS[kind].texts else None


def check_inputs(args: argparse.Namespace) -> None:
    """Every check of a parsed command line that needs no model, run before torch is imported (it and a
    model take half a minute to load on a busy machine, a mistyped option a second to name): those of
    `lime_probe.specs.inputs.check_request` on its options (the labels, the analyses' parameters, --max-length,
    --layers, the folders written: --out, the activation --cache, the demo's --runs, a local --data, --pairs,
    a BLiMP source and a local --ckpt), then the files of a study's --data."""
    own = args.command in ANALYSES and _own_layers(ANALYSES[args.command])  # --layers: its parameter
    params = ((name, params_of(ANALYSES[name], args)) for name in _analyses_of(args))  # built as checked
    check_request(
        params,
        checkpoints=getattr(args, "ckpt", None) or (),
        labels=getattr(args, "label", None),
        load=_loads_models(args),
        max_length=getattr(args, "max_length", None),
        layers=None if own else getattr(args, "layers", None),
        folders={
            f"--{o}": getattr(args, o) for o in ("out", "cache", "runs") if getattr(args, o, None) is not None
        },
        texts=_text_data(args),
        pairs=getattr(args, "pairs", None),
        blimp=_blimp_sources(args),
    )
    layout = STUDIES[args.study].data if args.command == "reproduce" else None
    if layout is not None and args.data is not None:
        from lime_probe.studies.runner import Data

        Data.under(args.data, layout)  # the study's files, named before any training


def _blimp_sources(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(option, value) of every BLiMP source a parsed command line reads: a BLiMP analysis's --data, report's
    --blimp."""
    if args.command == "report":
        return [] if getattr(args, "blimp", None) is None else [("--blimp", args.blimp)]
    kind = getattr(ANALYSES.get(args.command), "data_kind", None)
    return [("--data", args.data)] if kind == "blimp" else []


def _run(args: argparse.Namespace) -> int:
    command, where = COMMANDS[args.command], f"{PROG} {args.command}"

    def work() -> int:
        if _reproducible(args):  # the checks may load NumPy, which reads the mode's pins as it loads
            from lime_model.reproducible import pin

            pin()
        check_inputs(args)
        if _reproducible(args):  # before anything imports torch: the mode's variables are read as it loads
            from lime_model import reproducible

            if args.threads not in (None, 1):
                raise ValueError(f"--reproducible runs on one thread; leave out --threads {args.threads}")
            reproducible.enable()
            args.threads = 1
        if hasattr(args, "threads"):  # a torch command: set before any work, record the effective count
            args.threads = configure_threads(args.threads)  # first: before anything imports torch
            import lime_model

            lime_model.register_models()  # what `import lime_model` does for a library user (see there)
        if getattr(args, "device", None) is not None:  # a device this machine lacks fails before any work
            check_device(args.device)
        from lime_probe.extraction.cachedir import report_growth

        growth = report_growth(getattr(args, "cache", None), getattr(args, "cache_limit", None))
        with growth, one_line_warnings(where):
            incomplete = command.run(args)
        if incomplete:  # written, but without part of what was asked
            print(f"{where}: incomplete: {incomplete}", file=sys.stderr)
            return 3
        return 0

    return run_command(where, work, debug=args.debug, interrupted=command.interrupted.format(**vars(args)))


if __name__ == "__main__":
    sys.exit(main())
