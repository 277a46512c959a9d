"""``lime-probe``: the paper's analyses from the command line.

    lime-probe entropy --ckpt runs/lime --ckpt runs/llama --data valid.txt --site values --out out/

Every command compares one or more ``--ckpt`` side by side (named by ``--label``), writes
results as JSON and CSV (settings, checkpoint identity and versions recorded; see
``lime_probe.output.results``) and figures as PNG and PDF into ``--out``, and prints a compact table.

Output is staged in a hidden temporary folder beside ``--out`` and moved in only when the
command succeeds, so a failure or Ctrl-C never leaves half-written files there. Exit codes:
0 done, 2 bad usage or input (one line on stderr), 3 written but incomplete (``report`` skipped a
section for its input, one line naming them; ``--allow-skips`` makes that 0), 1 an unexpected failure,
130 interrupted.

The analyses are the registry ``lime_probe.specs.ANALYSES``: one subcommand per analysis, its options
generated from the analysis's parameter dataclass. This module parses arguments, stages the output, prints
tables and turns errors into exit codes. It imports nothing heavy (torch, transformers, matplotlib) before
the arguments are parsed, so ``--help`` and usage errors are instant; Ctrl-C at any point, imports
included, prints one line and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import typing
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from lime_model.checks import BAD_INPUT, OneLineParser, check_device, one_line
from lime_model.files import check_writable, umask
from lime_probe.specs import (
    ANALYSES,
    Checkpoint,
    Result,
    Spec,
    labels_for,
    load_checkpoints,
    named_checkpoints,
)
from lime_probe.specs.base import THREADS_HELP, configure_threads

PROG = "lime-probe"


# --------------------------------------------------------------------------- options


def _layer_list(spec: str | None) -> list[int] | None:
    if spec in (None, "", "all"):
        return None
    try:
        return [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be 'all' or comma-separated integers, got {spec!r}") from None


def extract_options(args, own_layers: bool = False) -> dict:
    """The extraction settings of a parsed command line, as ``extract`` keywords; with ``own_layers``
    (the analysis reads ``--layers`` itself) no layer selection."""
    return {
        "layers": None if own_layers else _layer_list(getattr(args, "layers", None)),
        "max_length": args.max_length,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "cache_dir": args.cache,
        "allow_unknown_tokens": args.allow_unknown_tokens,
    }


# --------------------------------------------------------------------------- output


@contextmanager
def staged_output(out: str | os.PathLike):
    """Yield a fresh temp folder beside ``out``; on success move its files into ``out``.

    Missing parent folders are created (as ``mkdir -p``) and removed again if the command fails.
    On any exception (including KeyboardInterrupt) the temp folder is removed and ``out`` is
    left as it was. A new ``out`` gets the mode a plain ``mkdir`` gives (0o777 & ~umask), not
    mkdtemp's private 0o700. ``out`` is checked first, creating nothing (``lime_model.files.check_writable``):
    NotADirectoryError if it or a folder on its way is a file, PermissionError if it cannot be written.
    """
    out = Path(out)
    check_writable(out, folder=True, option="--out")  # before any folder is made
    parent = out.resolve().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # innermost first
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"--out {out}: cannot create {parent} ({e.strerror})") from None
    published = False
    try:
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
        except OSError as e:
            raise PermissionError(f"--out {out} is not writable ({e.strerror})") from None
        try:
            yield tmp
            os.chmod(tmp, 0o777 & ~umask())
            if not out.exists():
                os.replace(tmp, out)
            else:
                for item in sorted(tmp.rglob("*")):
                    target = out / item.relative_to(tmp)
                    if item.is_dir():
                        target.mkdir(exist_ok=True)
                    else:
                        os.replace(item, target)
            published = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if not published:
            for folder in created:
                with contextlib.suppress(OSError):
                    folder.rmdir()


@contextmanager
def one_line_warnings(where: str):
    """Inside the block a ``lime_probe.extraction.windows.DataWarning`` (the data weakens the result) prints as one
    line, ``WHERE: warning: MESSAGE``, on stderr, each message once; other warnings as Python shows them."""
    import warnings

    from lime_probe.extraction.windows import DataWarning

    shown: set[str] = set()
    with warnings.catch_warnings():
        default = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, DataWarning):
                if str(message) not in shown:
                    shown.add(str(message))
                    print(f"{where}: warning: {message}", file=sys.stderr)
            else:
                default(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def format_table(rows: Sequence[dict], columns: Sequence[str] = ()) -> str:
    """A compact fixed-width text table of ``rows`` (floats to 4 significant digits)."""
    import numpy as np

    if not rows:
        return "(no rows)"
    cols = list(columns) or list(dict.fromkeys(k for r in rows for k in r))

    def cell(v):
        if isinstance(v, float | np.floating):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    # numbers right-aligned, text left-aligned
    numeric = [
        all(isinstance(r.get(c), int | float | np.number) or r.get(c) is None for r in rows) for c in cols
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric, strict=True))
        for row in cells
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- commands


def params_of(spec: Spec, args: argparse.Namespace):
    """The parameter dataclass of ``spec`` filled from the options generated from its fields; a field
    without its option in ``args`` (``report``'s options left out) keeps the analysis's default."""
    return spec.params(
        **{
            f.name: _field_value(getattr(args, f.name))
            for f in dataclasses.fields(spec.params)
            if hasattr(args, f.name)
        }
    )


def _field_value(v):
    return tuple(v) if isinstance(v, list) else v  # nargs="+" options hold lists, the dataclasses tuples


def run_analysis(spec: Spec, cks: Sequence[Checkpoint], data, args: argparse.Namespace) -> Result:
    """``spec.compute`` with the parameters and extraction settings of ``args``."""
    from lime_probe.extraction.cachedir import cache_use

    own_layers = "layers" in {f.name for f in dataclasses.fields(spec.params)}
    extract_kw = extract_options(args, own_layers) if spec.data_kind != "none" else None
    with cache_use(spec.name):  # its cache entries are listed under its name
        return spec.compute(cks, data, params_of(spec, args), extract_kw)


def _meta(command: str, args, cks: Sequence[Checkpoint], settings: dict | None = None) -> dict:
    """The results' header: the command line's settings (``settings`` added) and the checkpoints."""
    from lime_probe.output.results import run_metadata

    settings = {k: v for k, v in vars(args).items() if k not in ("handler", "debug")} | (settings or {})
    return run_metadata(command, settings=settings, checkpoints={c.label: c.source for c in cks})


def _checkpoints(spec: Spec, args) -> list[Checkpoint]:
    """The checkpoints of ``args``: loaded, or only named for analyses that read their run folders."""
    if spec.data_kind == "none":
        return named_checkpoints(args.ckpt, args.label)
    return load_checkpoints(args.ckpt, args.label, args.device, verbose=args.verbose)


def _texts(args, max_texts: int | None = None) -> list[str] | None:
    """The first ``max_texts`` (default ``--max-sequences``) documents of ``--data``; an ``hf:`` spec the hub
    cannot give fails at once in one line."""
    from lime_model.data import load_texts
    from lime_probe.extraction.loading import hub_dataset

    if args.data is None:
        return None
    n = max_texts or args.max_sequences
    name = args.data[len("hf:") :].split(":")[0] if args.data.startswith("hf:") else ""
    if not name:
        return load_texts(args.data, max_texts=n)
    with hub_dataset(name, f"--data {args.data}", "pass a local .txt/.jsonl/.parquet file or folder"):
        return load_texts(args.data, max_texts=n)


def _blimp(source: str, params, option: str):
    """The BLiMP data of ``source`` (``option``'s value) for ``params``; the hub id fails at once in one
    line when the hub cannot give it."""
    from lime_probe.extraction.loading import hub_dataset
    from lime_probe.probes.blimp import HUB_ID, load_blimp
    from lime_probe.specs.blimp import chosen_paradigms

    if str(source) != HUB_ID or Path(source).exists():
        return load_blimp(source, chosen_paradigms(params))
    fix = f"pass {option} DIR, a folder of BLiMP <paradigm>.jsonl files"
    with hub_dataset(HUB_ID, f"BLiMP data ({HUB_ID})", fix):
        return load_blimp(source, chosen_paradigms(params))


def _analysis_command(spec: Spec) -> Callable:
    def handler(args, out: Path) -> None:
        from lime_probe.specs import write_analysis

        params = params_of(spec, args)
        if spec.data_kind == "blimp":
            data = _blimp(args.data, params, "--data")
        else:
            data = _texts(args) if spec.data_kind != "none" else None
        cks = _checkpoints(spec, args)
        result = run_analysis(spec, cks, data, args)
        write_analysis(result, out, _meta(spec.name, args, cks))
        print(format_table(result.table()))

    return handler


def cmd_report(args, out: Path) -> str | None:
    """Run the chosen analyses on the checkpoints each applies to and write one self-contained HTML report.

    Each analysis runs with its own command's defaults (``--max-sequences`` its ``Spec.max_sequences``, every
    option left out its own default), so a section equals the command's result. A section that fails on
    its input (e.g. a word too rare in the data) is skipped, not fatal: the report keeps the sections that
    worked and lists the skipped ones with the reason (on stderr too), and the command returns a one-line
    summary of them (exit 3) unless ``--allow-skips``. With ``--blimp DIR`` the BLiMP analysis joins (its
    probe table; minimal-pair scores for causal LMs), over the paper's layer range unless ``--layers``."""
    from lime_probe.output.report import Section, Table, write_report
    from lime_probe.specs import write_analysis

    names = _analyses_of(args)
    params = {name: params_of(ANALYSES[name], args) for name in names}
    sizes = {
        n: args.max_sequences or ANALYSES[n].max_sequences
        for n in names
        if ANALYSES[n].data_kind in ("texts", "optional-texts")
    }
    texts = _texts(args, max(sizes.values())) if sizes else None
    cks = load_checkpoints(args.ckpt, args.label, args.device, verbose=args.verbose)
    meta = _meta("report", args, cks)
    sections, skipped = [], []
    for name in names:
        spec = ANALYSES[name]
        chosen = [c for c in cks if spec.applies(c)]
        if not chosen:
            continue
        try:
            if spec.data_kind == "blimp":
                result, used = _report_blimp(spec, chosen, args, params[name])
            else:
                used = {**dataclasses.asdict(params[name]), "max_sequences": sizes.get(name)}
                data = texts[: sizes[name]] if name in sizes else None
                result = run_analysis(spec, chosen, data, args)
        except BAD_INPUT as e:
            skipped.append({"analysis": name, "reason": one_line(e)})
            print(f"{PROG} report: skipped {name}: {one_line(e)}", file=sys.stderr)
            continue
        sections.append(write_analysis(result, out, _meta("report", args, cks, used)))
        print(f"\n{result.title}\n{format_table(result.table())}")
    if not sections:
        raise ValueError(
            "every section failed: " + "; ".join(f"{s['analysis']}: {s['reason']}" for s in skipped)
        )
    if skipped:
        text = "These analyses were skipped because their input did not allow them; the others are above."
        sections.append(Section("Skipped sections", text=text, tables=[Table("skipped", skipped)]))
    labels = " vs ".join(c.label for c in cks)
    write_report(out / "report.html", f"lime-probe report: {labels}", sections, meta=meta)
    if skipped and not args.allow_skips:
        return (
            f"{len(skipped)} of {len(skipped) + len(sections) - 1} sections skipped ("
            + "; ".join(f"{s['analysis']}: {s['reason']}" for s in skipped)
            + "); the report lists them; --allow-skips accepts a partial report"
        )
    return None


def _report_blimp(spec: Spec, cks: Sequence[Checkpoint], args, params) -> tuple[Result, dict]:
    """The BLiMP section of the report and its settings: ``--blimp`` data, the paper's layer range unless
    ``--layers``."""
    layers = "paper" if args.layers in (None, "all") else args.layers
    params = dataclasses.replace(params, layers=layers)
    data = _blimp(args.blimp, params, "--blimp")
    from lime_probe.extraction.cachedir import cache_use

    with cache_use(spec.name):
        result = spec.compute(cks, data, params, extract_options(args, own_layers=True))
    return result, dataclasses.asdict(params)


def cmd_demo(args, out: Path) -> None:
    """Train tiny LIMe and LLaMA models on arithmetic, run every analysis (``lime_probe.studies.demo``) and print
    what it measured and where it is."""
    from lime_probe.studies.demo import run_demo

    runs = args.runs or os.path.join(args.out, "runs")
    _, headline = run_demo(out, quick=args.quick, seed=args.seed, device=args.device, runs=runs)
    print(format_table(headline))
    print(f"report: {os.path.join(args.out, 'report.html')}; figures (PNG, PDF), JSON and CSV: {args.out}")
    print(f"checkpoints: {runs} (a rerun reuses them)")


# --------------------------------------------------------------------------- parser

# The analyses the report can run: those that read texts or the run folders (BLiMP reads its own data).
REPORTABLE = [n for n, s in ANALYSES.items() if s.data_kind != "blimp"]
REPORT_DEFAULT = [n for n, s in ANALYSES.items() if s.data_kind in ("texts", "optional-texts")]


def _differing_defaults() -> dict[str, str]:
    """The report options whose default differs between the analyses (the specs' parameter dataclasses):
    {field: "values (entropy, separability); hidden (cka)"}."""
    by_field: dict[str, dict[str, list[str]]] = {}
    for name in [*REPORTABLE, "blimp"]:
        for f in dataclasses.fields(ANALYSES[name].params):
            shown = " ".join(map(repr, f.default)) if isinstance(f.default, tuple) else str(f.default)
            by_field.setdefault(f.name, {}).setdefault(shown.replace("%", "%%"), []).append(name)
    return {
        k: "; ".join(f"{v} ({', '.join(ns)})" for v, ns in d.items())
        for k, d in by_field.items()
        if len(d) > 1
    }


COMMANDS = {
    "report": (
        "run several analyses and write one self-contained HTML report",
        "lime-probe report --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
        "    --data ../shared/data/wikitext-2/valid.txt --blimp ../shared/data/blimp --allow-skips \\\n"
        "    --out out/report   # then open out/report/report.html (--allow-skips: the cpu-tiny runs' 64-token "
        "documents hold too few ' are' for separability)",
    ),
    "demo": (
        "train tiny LIMe and LLaMA models on arithmetic, offline, and run every analysis",
        "lime-probe demo                 # a few minutes on 2 CPU cores (README: measured time), writes "
        "lime-probe-out/demo/\n"
        "lime-probe demo --quick --out /tmp/demo   # a 1-minute smoke run",
    ),
    "reproduce": (
        "train LIMe and LLaMA (optionally the cross-layer baselines) over seeds and measure the paper's "
        "findings (resumable)",
        "lime-probe reproduce --data ../shared/data --out runs/lm-cpu --results figures/lm-cpu"
        "   # not run in tests: about an hour\n"
        "lime-probe reproduce --data ../shared/data --size tiny --out /tmp/repro   # a 2-minute smoke run\n"
        "lime-probe reproduce --data ../shared/data --out runs/lm-cpu-baselines --results figures/lm-cpu-baselines"
        " --baselines denseformer,resformer,hyperconnections   # not run in tests: about an hour (15 trainings)\n"
        "lime-probe reproduce --study arithmetic --out runs/arithmetic-seeds --results figures/arithmetic-seeds"
        "   # not run in tests: about 30 min at one thread\n"
        "lime-probe reproduce --study arithmetic --baselines lime-llama-kv-init,llama-torch-kv-init --seeds "
        "0,1,2,3,4,5,6,7,8,9 --out runs/arithmetic-kv-init --results figures/arithmetic-kv-init"
        "   # the k/v init x routing 2 x 2; not run in tests: about 2 hours at one thread",
    ),
    "cache": (
        "list the activation cache's entries by checkpoint and analysis with their sizes, or clear them",
        "lime-probe cache                        # size per entry and the total\n"
        "lime-probe cache --clear --older-than 30 --yes   # remove entries last written over 30 days ago\n"
        "lime-probe cache --clear --ckpt runs/lime --yes   # remove one checkpoint's entries",
    ),
}


def _checkpoint_options(
    p: argparse.ArgumentParser, *, data: str, max_sequences: int | None = 64, layers: bool = True
) -> None:
    """--ckpt/--label and, unless ``data`` is "none", --data (as the analysis's ``data_kind``), the size limits
    and the cache; ``max_sequences`` None (``report``): each analysis's own."""
    g = p.add_argument_group("checkpoints and data")
    g.add_argument(
        "--ckpt",
        action="append",
        required=True,
        metavar="PATH|HUB_ID",
        help="checkpoint directory or hub id"
        + (" (a lime-model train run folder)" if data == "none" else "")
        + "; repeat to compare side by side",
    )
    g.add_argument(
        "--label",
        action="append",
        metavar="NAME",
        help="name per --ckpt in tables and legends (default: the folder name)",
    )
    if data == "none":
        return
    if data == "blimp":
        g.add_argument(
            "--data",
            default="nyu-mll/blimp",
            metavar="SPEC",
            help="a folder of BLiMP <paradigm>.jsonl files, one .jsonl file, or the hub id nyu-mll/blimp "
            "(default: %(default)s, needs a network)",
        )
    else:
        g.add_argument(
            "--data",
            required=data == "texts",
            metavar="SPEC",
            help="a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG][:SPLIT]"
            + ("" if data == "texts" else " (only for routing 'dynamic')"),
        )
        g.add_argument(
            "--max-sequences",
            type=_positive,
            default=max_sequences,
            metavar="N",
            help="use at most N sequences (default: %(default)s)"
            if max_sequences
            else "use at most N sequences in every analysis (default: each analysis's own: "
            + ", ".join(f"{n} {s.max_sequences}" for n, s in ANALYSES.items() if n in REPORT_DEFAULT)
            + ")",
        )
    if layers:
        g.add_argument(
            "--layers", default="all", help="'all' or comma-separated layer indices (default: all)"
        )
    g.add_argument(
        "--max-length",
        type=_positive,
        default=256,
        metavar="T",
        help="truncate each sequence to T tokens (default: %(default)s)",
    )
    g.add_argument(
        "--max-tokens",
        type=_positive,
        default=None,
        metavar="N",
        help="stop extracting after N tokens in all (default: no limit)",
    )
    g.add_argument(
        "--batch-size",
        type=_positive,
        default=None,
        metavar="B",
        help="sequences per forward pass (default: as many as fit 4096 tokens, padding included; either way "
        "sequences run sorted by length and results come back in order)",
    )
    g.add_argument(
        "--cache",
        default=_default_cache(),
        metavar="DIR",
        help="activation cache; a rerun or an interrupted run reuses it (default: %(default)s)",
    )
    g.add_argument(
        "--no-cache", dest="cache", action="store_const", const=None, help="extract without the on-disk cache"
    )
    g.add_argument(
        "--allow-unknown-tokens",
        action="store_true",
        help="measure data even when over 10%% of its tokens are the tokenizer's unknown token (default: "
        "refused, as the data does not fit the tokenizer; over 1%% warns)",
    )


def _run_options(p: argparse.ArgumentParser, out: str = "lime-probe-out") -> None:
    r = p.add_argument_group("run")
    r.add_argument(
        "--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: %(default)s)"
    )
    r.add_argument(
        "--out", default=out, metavar="DIR", help="folder for results and figures (default: %(default)s)"
    )
    r.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    r.add_argument("--threads", type=_positive, default=None, metavar="N", help=THREADS_HELP)
    r.add_argument(
        "--verbose", action="store_true", help="show the libraries' own loading messages and warnings"
    )


def _default_cache() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "lime-probe")


def _seed_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_param_options(
    group, params: type, skip: Sequence[str] = (), own_defaults: dict[str, str] | None = None
) -> list[str]:
    """One option per field of the dataclass ``params`` (``per_word`` -> ``--per-word``), typed from its
    annotation and documented from its ``option`` metadata; a boolean field that defaults to True becomes
    ``--no-NAME``. Fields named in ``skip`` are left out. Returns the names added.

    With ``own_defaults`` (``report``: {field: the differing defaults of the analyses, as text}) an option
    left out is left out of the parsed arguments, so each analysis keeps its own default (``params_of``)."""
    hints = typing.get_type_hints(params)
    added = []
    for f in dataclasses.fields(params):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        kw: dict = {"default": list(f.default) if isinstance(f.default, tuple) else f.default}
        help = meta.pop("help", "")
        if "default" not in help and f.default is not None:
            help += " (default: %(default)s)"
        if own_defaults is not None:
            help = help.replace("%(default)s", str(kw["default"]).replace("%", "%%"))
            if f.name in own_defaults:
                help += f"; each analysis its own: {own_defaults[f.name]}"
            kw["default"] = argparse.SUPPRESS
        kw["help"] = help
        positive = meta.pop("positive", False)
        flag = "--" + f.name.replace("_", "-")
        if base is bool and f.default is True:  # on by default: the option turns it off
            flag, kw["action"] = "--no-" + flag[2:], "store_false"
        elif base is bool:
            kw["action"] = "store_true"
        elif typing.get_origin(base) is tuple:
            kw["nargs"] = "+"
        else:
            kw["type"] = _positive if positive else base
        kw.update(meta)  # metavar, choices
        group.add_argument(flag, dest=f.name, **kw)
        added.append(f.name)
    return added


def build_parser() -> argparse.ArgumentParser:
    """The ``lime-probe`` argument parser: one subcommand per analysis of the registry, plus report and demo."""
    parser = OneLineParser(
        prog=PROG,
        description="The LIMe paper's analyses of representation collapse.",
        epilog="Run 'lime-probe COMMAND --help' for a command's options and an example.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    def add(name: str, help: str, example: str, handler: Callable) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog="example:\n" + textwrap.indent(example, "  "),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(handler=handler)
        return p

    for spec in ANALYSES.values():
        p = add(spec.name, spec.help, spec.example, _analysis_command(spec))
        _checkpoint_options(
            p,
            data=spec.data_kind,
            max_sequences=spec.max_sequences,
            layers=spec.data_kind == "texts",
        )
        _run_options(p)
        add_param_options(p.add_argument_group("analysis"), spec.params)

    p = add("report", *COMMANDS["report"], cmd_report)
    _checkpoint_options(p, data="texts", max_sequences=None)
    _run_options(p)
    g, seen, own = p.add_argument_group("analyses"), [], _differing_defaults()
    for name in REPORTABLE:  # each option once; left out, every analysis keeps its own default
        seen += add_param_options(g, ANALYSES[name].params, skip=seen, own_defaults=own)
    b = p.add_argument_group("BLiMP (with --blimp)")
    b.add_argument(
        "--blimp",
        default=None,
        metavar="SPEC",
        help="add the BLiMP section: a folder of BLiMP <paradigm>.jsonl files (or nyu-mll/blimp); its layers "
        "are the paper's range unless --layers is given (default: no BLiMP section)",
    )
    add_param_options(b, ANALYSES["blimp"].params, skip=[*seen, "layers"], own_defaults=own)
    p.add_argument(
        "--allow-skips",
        action="store_true",
        help="exit 0 when some sections were skipped for their input (default: the report is written and "
        "the command exits 3, naming them)",
    )
    g.add_argument(
        "--analyses",
        nargs="+",
        default=REPORT_DEFAULT,
        choices=REPORTABLE,
        metavar="NAME",
        help="analyses (from: %(choices)s) to include, each on the checkpoints it applies to (default: %(default)s)",
    )

    p = add("demo", *COMMANDS["demo"], cmd_demo)
    _run_options(p, out="lime-probe-out/demo")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of training, sampling and probes (default: %(default)s)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a tiny smoke run (about a minute) instead of the real demo"
    )
    p.add_argument(
        "--runs",
        default=None,
        metavar="DIR",
        help="keep the two training runs here and reuse finished ones (default: runs/ inside --out)",
    )

    p = add("reproduce", *COMMANDS["reproduce"], cmd_reproduce)
    p.add_argument(
        "--study",
        default="lm",
        choices=("lm", "arithmetic"),
        help="lm: the language-model findings (WikiText-2, BLiMP); arithmetic: accuracy per operator count "
        "and value entropy on the built-in arithmetic task (default: %(default)s)",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="folder holding wikitext-2/{valid,test}.txt and blimp/ (needed by --study lm)",
    )
    p.add_argument(
        "--out",
        dest="run_dir",
        default=None,
        metavar="DIR",
        help="training runs and measurements, reused on a rerun (default: runs/lm-cpu, runs/arithmetic-seeds)",
    )
    p.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="S,S,...",
        help="training seeds of --study arithmetic, at least two (default: the size's, 0-4 for cpu)",
    )
    p.add_argument(
        "--baselines",
        type=lambda s: [b.strip() for b in s.split(",") if b.strip()],
        default=[],
        metavar="NAME,...",
        help="--study lm: also train the paper's cross-layer baselines (denseformer, resformer, "
        "hyperconnections) or k/v-init ablations (lime-llama-kv-init: LIMe with LLaMA's k/v init; "
        "llama-torch-kv-init: LLaMA with LIMe's) and "
        "compare each with LLaMA as extra rows; --study arithmetic: both k/v-init ablations or none, "
        "the 2 x 2 of k/v init x routing, each contrast against the cell that differs in one factor "
        "(default: none)",
    )
    p.add_argument("--results", default=None, metavar="DIR", help="tables and figures (default: OUT/results)")
    p.add_argument(
        "--size", default="cpu", choices=("cpu", "tiny"), help="cpu: the protocol's runs; tiny: a smoke run"
    )
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    p.add_argument("--threads", type=_positive, default=None, metavar="N", help=THREADS_HELP)
    p.set_defaults(out=None)

    p = add("cache", *COMMANDS["cache"], cmd_cache)
    p.add_argument(
        "--cache-dir", default=_default_cache(), metavar="DIR", help="the cache (default: %(default)s)"
    )
    p.add_argument(
        "--clear",
        action="store_true",
        help="remove the entries (all, or those --older-than / of --ckpt), after asking on the terminal",
    )
    p.add_argument(
        "--older-than", type=float, default=None, metavar="DAYS", help="only entries older than this"
    )
    p.add_argument(
        "--ckpt",
        default=None,
        metavar="PATH|HUB_ID",
        help="only the entries of this checkpoint (list or clear)",
    )
    p.add_argument(
        "--yes", action="store_true", help="clear without asking (needed where stdin is not a terminal)"
    )
    p.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    p.set_defaults(out=None)
    return parser


def _check_reproduce_outputs(run_dir: str, results: str | None) -> None:
    """The runs folder and ``--results`` (written at the end, after the training) checked before any work."""
    check_writable(run_dir, folder=True, option="--out")
    if results is not None:
        check_writable(results, folder=True, option="--results")


def cmd_reproduce(args, out: None) -> None:
    """Train or reuse the runs, measure, compare (``lime_probe.studies.lm``, ``lime_probe.studies.arithmetic``);
    writes in place, resumable."""
    if args.study == "arithmetic":
        from lime_probe.studies.arithmetic import run_arithmetic_study

        if args.data is not None:
            raise ValueError("--study arithmetic generates its data; leave out --data")
        _check_reproduce_outputs(args.run_dir or "runs/arithmetic-seeds", args.results)
        results = run_arithmetic_study(
            args.run_dir or "runs/arithmetic-seeds",
            size=args.size,
            seeds=args.seeds,
            results=args.results,
            device=args.device,
            baselines=args.baselines,
        )
    else:
        from lime_probe.studies.lm import run_reproduction

        if args.data is None:
            raise ValueError("--study lm needs --data (the folder holding wikitext-2/ and blimp/)")
        if args.seeds is not None:
            raise ValueError("--seeds applies to --study arithmetic; the lm study's seeds are its protocol's")
        _check_reproduce_outputs(args.run_dir or "runs/lm-cpu", args.results)
        results = run_reproduction(
            args.run_dir or "runs/lm-cpu",
            args.data,
            size=args.size,
            results=args.results,
            device=args.device,
            baselines=args.baselines,
        )
    print(f"results in {results} (findings.md)", file=sys.stderr)


def cmd_cache(args, out: None) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command, map errors to exit codes (see module doc)."""
    try:
        signal.signal(
            signal.SIGINT, signal.default_int_handler
        )  # Ctrl-C raises KeyboardInterrupt from here on
        return _main(argv)
    except KeyboardInterrupt:  # before the command started, or while reporting how it ended
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _analyses_of(args: argparse.Namespace) -> list[str]:
    """The analyses a parsed command line runs: its own, or report's chosen ones."""
    if args.command in ANALYSES:
        return [args.command]
    if args.command == "report":
        return list(args.analyses) + (["blimp"] if args.blimp else [])
    return []


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad usage (2), message already printed
        return int(e.code or 0)
    where = f"{PROG} {args.command}"
    try:
        if getattr(args, "label", None):  # checked before any import or output
            labels_for(args.ckpt, args.label)
        for name in _analyses_of(args):  # parameters check themselves (e.g. --words): no import needed
            params_of(ANALYSES[name], args)
    except ValueError as e:
        print(f"{where}: error: {e}", file=sys.stderr)
        return 2
    try:
        if hasattr(args, "threads"):  # a torch command: set before any work, record the effective count
            args.threads = configure_threads(args.threads)  # first: before anything imports torch
            import lime_model

            lime_model.register_models()  # what `import lime_model` does for a library user (see there)
        if getattr(args, "device", None) is not None:  # a device this machine lacks fails before any work
            check_device(args.device)
        if getattr(args, "cache", None) is not None:  # the activation cache, written during the work
            check_writable(args.cache, folder=True, option="--cache")
        from lime_probe.extraction.cachedir import report_growth

        with (
            staged_output(args.out) if args.out else contextlib.nullcontext() as tmp,
            report_growth(getattr(args, "cache", None)),
            one_line_warnings(where),
        ):
            incomplete = args.handler(args, tmp)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the message short
        print(f"{where}: interrupted; nothing was written to {args.out}", file=sys.stderr)
        return 130
    except BAD_INPUT as e:
        if args.debug:
            raise
        print(f"{where}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        print(
            f"{where}: failed: {type(e).__name__}: {one_line(e)} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    if args.out:
        print(f"results in {args.out}", file=sys.stderr)
    if incomplete:  # written, but without part of what was asked
        print(f"{where}: incomplete: {incomplete}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
