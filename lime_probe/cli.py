"""``lime-probe``: the paper's analyses from the command line.

    lime-probe entropy --ckpt runs/lime --ckpt runs/llama --data valid.txt --site values --out out/

Every command compares one or more ``--ckpt`` side by side (named by ``--label``), writes
results as JSON and CSV (settings, checkpoint identity and versions recorded; see
``lime_probe.results``) and figures as PNG and PDF into ``--out``, and prints a compact table.

Output is staged in a hidden temporary folder beside ``--out`` and moved in only when the
command succeeds, so a failure or Ctrl-C never leaves half-written files there. Exit codes:
0 done, 2 bad usage or input (one line on stderr), 1 an unexpected failure, 130 interrupted.

The analyses themselves are in ``lime_probe.pipelines``; this module parses arguments, stages
the output, prints tables and turns errors into exit codes. Each command imports the probes it
uses when it runs, so a command loads only what it needs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from lime_model.files import umask
from lime_probe.loading import one_line
from lime_probe.pipelines import (
    ANALYSES,
    Analysis,
    Checkpoint,
    blimp_analysis,
    load_checkpoints,
    section_for,
    write_analysis,
)
from lime_probe.report import write_report
from lime_probe.results import run_metadata
from lime_probe.sites import DEFAULT_WORDS, SITES

PROG = "lime-probe"
# Errors that mean "the input is wrong" (exit 2), as opposed to a bug or a crash (exit 1). KeyError is not
# one: the library raises ValueError for a wrong name, so a KeyError is a bug.
BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


# --------------------------------------------------------------------------- options


def _layer_list(spec: str | None) -> list[int] | None:
    if spec in (None, "", "all"):
        return None
    try:
        return [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be 'all' or comma-separated integers, got {spec!r}") from None


def extract_options(args) -> dict:
    """The extraction settings of a parsed command line, as ``extract`` keywords."""
    return {
        "layers": _layer_list(getattr(args, "layers", None)),
        "max_length": args.max_length,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "cache_dir": args.cache,
    }


# --------------------------------------------------------------------------- output


@contextmanager
def staged_output(out: str | os.PathLike):
    """Yield a fresh temp folder beside ``out``; on success move its files into ``out``.

    Missing parent folders are created (as ``mkdir -p``) and removed again if the command fails.
    On any exception (including KeyboardInterrupt) the temp folder is removed and ``out`` is
    left as it was. A new ``out`` gets the mode a plain ``mkdir`` gives (0o777 & ~umask), not
    mkdtemp's private 0o700. Raises ValueError if ``out`` is a file and PermissionError if it cannot be
    written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    parent = out.resolve().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # innermost first
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"--out {out}: cannot create {parent} ({e.strerror})") from None
    published = False
    try:
        if not os.access(out if out.exists() else parent, os.W_OK | os.X_OK):
            raise PermissionError(f"--out {out} is not writable")
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


def format_table(rows: Sequence[dict], columns: Sequence[str] = ()) -> str:
    """A compact fixed-width text table of ``rows`` (floats to 4 significant digits)."""
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


def run_analysis(name: str, cks: Sequence[Checkpoint], texts: Sequence[str] | None, args) -> Analysis:
    """Call analysis ``name`` with the options of ``args`` that its signature names."""
    fn = ANALYSES[name]
    names = [p for p in inspect.signature(fn).parameters if p not in ("cks", "texts", "extract_kw")]
    kw = {p: getattr(args, p) for p in names if hasattr(args, p)}
    return fn(cks, texts, extract_kw=extract_options(args) if texts is not None else None, **kw)


def _meta(command: str, args, cks: Sequence[Checkpoint]) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("handler", "debug")}
    return run_metadata(command, settings=settings, checkpoints={c.label: c.source for c in cks})


def _analysis_command(name: str):
    def handler(args, out: Path) -> None:
        from lime_model.data import load_texts

        texts = load_texts(args.data, max_texts=args.max_sequences) if args.data is not None else None
        cks = load_checkpoints(args.ckpt, args.label, args.device)
        a = run_analysis(name, cks, texts, args)
        write_analysis(a, out, _meta(name, args, cks))
        print(format_table(a.table()))

    return handler


def cmd_report(args, out: Path) -> None:
    """Run the chosen analyses on every checkpoint and write one self-contained HTML report."""
    from lime_model.data import load_texts

    texts = load_texts(args.data, max_texts=args.max_sequences)
    cks = load_checkpoints(args.ckpt, args.label, args.device)
    meta = _meta("report", args, cks)
    sections = []
    for name in args.analyses:
        chosen = cks
        if name == "router":  # only LIMe checkpoints have routers
            chosen = [c for c in cks if getattr(c.config, "routing", "none") != "none"]
            if not chosen:
                continue
        a = run_analysis(name, chosen, texts, args)
        write_analysis(a, out, meta)
        sections.append(section_for(a))
        print(f"\n{a.title}\n{format_table(a.table())}")
    labels = " vs ".join(c.label for c in cks)
    write_report(out / "report.html", f"lime-probe report: {labels}", sections, meta=meta)


def cmd_blimp(args, out: Path) -> None:
    """BLiMP probes and minimal-pair scoring for every checkpoint."""
    from lime_probe.blimp import load_blimp

    data = load_blimp(args.data, args.paradigms)
    cks = load_checkpoints(args.ckpt, args.label, args.device)
    a = blimp_analysis(
        cks,
        data,
        site=args.site,
        max_pairs=args.max_pairs,
        method=args.method,
        seed=args.seed,
        extract_kw=extract_options(args),
    )
    write_analysis(a, out, _meta("blimp", args, cks))
    print(format_table(a.table()))


def cmd_demo(args, out: Path) -> None:
    """Train tiny LIMe and LLaMA models on arithmetic and run every analysis (``lime_probe.demo``)."""
    from lime_probe.demo import run_demo

    run_demo(out, quick=args.quick, seed=args.seed, device=args.device, runs=args.runs)


# --------------------------------------------------------------------------- parser


EXAMPLES = {
    "entropy": "lime-probe entropy --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
    "    --data wikitext-2/valid.txt --site values --max-sequences 64 --out out/entropy",
    "separability": "lime-probe separability --ckpt runs/lime --ckpt runs/llama --data wikitext-2/valid.txt \\\n"
    "    --words ' is' ' are' ' was' ' were' --site values --max-sequences 2000 --out out/sep",
    "tsne": "lime-probe tsne --ckpt runs/lime --ckpt runs/llama --data wikitext-2/valid.txt --layers 0,4,8,12 \\\n"
    "    --per-word 150 --out out/tsne",
    "blimp": "lime-probe blimp --ckpt runs/lime --ckpt runs/llama --data shared/data/blimp \\\n"
    "    --paradigms anaphor_gender_agreement adjunct_island --max-pairs 500 --out out/blimp",
    "cka": "lime-probe cka --ckpt runs/lime --data wikitext-2/valid.txt --site hidden --max-tokens 2000 --out out/cka",
    "router": "lime-probe router --ckpt runs/lime --label LIMe --out out/router",
    "report": "lime-probe report --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
    "    --data wikitext-2/valid.txt --max-sequences 256 --out out/report   # then open out/report/report.html",
    "demo": "lime-probe demo                 # about 2 minutes on 2 CPU cores, writes figures/\n"
    "lime-probe demo --quick --out /tmp/demo   # a 1-minute smoke run",
    "cache": "lime-probe cache                        # size per entry and the total\n"
    "lime-probe cache --clear --older-than 30   # remove entries last written over 30 days ago",
}

HELP = {
    "entropy": "matrix-based Renyi entropy per layer (paper Sec. 5.3, Figures 2a/4a/7a)",
    "separability": "linear-probe separability of word occurrences per layer (paper Figures 2b/7b)",
    "tsne": "t-SNE maps of word occurrences, models x layers (paper Figures 3/8)",
    "blimp": "BLiMP good-vs-bad probes per layer and minimal-pair scoring (paper Table 2)",
    "cka": "linear CKA between layers and effective rank per layer",
    "router": "LIMe router weights, layer x buffered layer and per head (paper Figures 5/9)",
    "report": "run several analyses and write one self-contained HTML report",
    "demo": "train tiny LIMe and LLaMA models on arithmetic, offline, and run every analysis",
    "cache": "list the activation cache's entries and sizes, or clear them",
}


def _checkpoint_options(p: argparse.ArgumentParser, *, data: str, max_sequences: int = 64) -> None:
    """--ckpt/--label and, unless ``data`` is "none", --data ("required", "optional" or "blimp") and the
    size limits."""
    g = p.add_argument_group("checkpoints and data")
    g.add_argument(
        "--ckpt",
        action="append",
        required=True,
        metavar="PATH|HUB_ID",
        help="checkpoint directory or hub id; repeat to compare side by side",
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
            required=data == "required",
            metavar="SPEC",
            help="a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG][:SPLIT]"
            + ("" if data == "required" else " (only for routing 'dynamic')"),
        )
    if data != "blimp":  # BLiMP is limited per paradigm by --max-pairs
        g.add_argument(
            "--max-sequences",
            type=_positive,
            default=max_sequences,
            metavar="N",
            help="use at most N sequences (default: %(default)s)",
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
        default=8,
        metavar="B",
        help="sequences per forward pass (default: %(default)s)",
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


def _run_options(p: argparse.ArgumentParser, out: str = "lime-probe-out") -> None:
    r = p.add_argument_group("run")
    r.add_argument(
        "--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: %(default)s)"
    )
    r.add_argument(
        "--out", default=out, metavar="DIR", help="folder for results and figures (default: %(default)s)"
    )
    r.add_argument(
        "--seed", type=int, default=0, help="seed for sampling, folds, t-SNE (default: %(default)s)"
    )
    r.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    r.add_argument(
        "--threads", type=_positive, default=None, metavar="N", help="torch CPU threads (default: torch's)"
    )


def _default_cache() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "lime-probe")


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _site_options(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--site", default=default, choices=SITES, help="representation to probe (default: %(default)s)"
    )
    p.add_argument("--layers", default="all", help="'all' or comma-separated layer indices (default: all)")


def _entropy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="lime",
        choices=("lime", "layer-by-layer"),
        help="normalisation preset: the official code's or Skean et al.'s (default: %(default)s)",
    )
    p.add_argument("--alpha", type=float, default=None, help="Renyi order (default: the preset's)")


def _word_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--words",
        nargs="+",
        default=list(DEFAULT_WORDS),
        metavar="WORD",
        help="single-token words to tell apart, leading spaces included (default: ' is' ' are' ' was' ' were')",
    )
    p.add_argument(
        "--method",
        default="logreg",
        choices=("logreg", "adam-linear"),
        help="probe: converged logistic regression (paper text) or the official one-epoch Adam "
        "linear layer (default: %(default)s)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the usage itself stays one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``lime-probe`` argument parser with one subcommand per analysis."""
    parser = _Parser(
        prog=PROG,
        description="The LIMe paper's analyses of representation collapse.",
        epilog="Run 'lime-probe COMMAND --help' for a command's options and an example.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def add(name: str, handler: Callable, data: str = "required") -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=HELP[name],
            description=HELP[name],
            epilog="example:\n" + textwrap.indent(EXAMPLES[name], "  "),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name != "demo":
            # word probes need many occurrences of each word: read more text by default
            max_sequences = 1000 if name in ("separability", "tsne") else 64
            _checkpoint_options(p, data=data, max_sequences=max_sequences)
        _run_options(p, out="figures" if name == "demo" else "lime-probe-out")
        p.set_defaults(handler=handler)
        return p

    p = add("entropy", _analysis_command("entropy"))
    _site_options(p, "values")
    _entropy_options(p)

    p = add("separability", _analysis_command("separability"))
    _site_options(p, "hidden")
    _word_options(p)

    p = add("tsne", _analysis_command("tsne"))
    _site_options(p, "hidden")
    _word_options(p)
    p.add_argument(
        "--per-word",
        type=_positive,
        default=100,
        metavar="N",
        help="points per word in each map (default: %(default)s)",
    )
    p.add_argument("--perplexity", type=float, default=30.0, help="t-SNE perplexity (default: %(default)s)")

    p = add("blimp", cmd_blimp, data="blimp")
    _site_options(p, "hidden")
    p.add_argument(
        "--paradigms",
        nargs="+",
        default=None,
        metavar="UID",
        help="BLiMP paradigms to use (default: all in --data)",
    )
    p.add_argument(
        "--max-pairs",
        type=_positive,
        default=200,
        metavar="N",
        help="minimal pairs per paradigm (default: %(default)s; BLiMP has 1,000)",
    )
    p.add_argument(
        "--method", default="logreg", choices=("logreg", "adam-linear"), help="probe (default: %(default)s)"
    )

    p = add("cka", _analysis_command("cka"))
    _site_options(p, "hidden")

    add("router", _analysis_command("router"), data="optional")

    p = add("report", cmd_report)
    _site_options(p, "values")
    _entropy_options(p)
    _word_options(p)
    p.add_argument(
        "--analyses",
        nargs="+",
        default=list(ANALYSES),
        choices=list(ANALYSES),
        help="analyses to include; router only for LIMe checkpoints (default: all)",
    )

    p = add("demo", cmd_demo)
    p.add_argument(
        "--quick", action="store_true", help="a tiny smoke run (about a minute) instead of the real demo"
    )
    p.add_argument(
        "--runs",
        default=None,
        metavar="DIR",
        help="keep the two training runs here and reuse finished ones (default: a temporary folder)",
    )
    p = sub.add_parser(
        "cache",
        help=HELP["cache"],
        description=HELP["cache"],
        epilog="example:\n" + textwrap.indent(EXAMPLES["cache"], "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cache-dir", default=_default_cache(), metavar="DIR", help="the cache (default: %(default)s)"
    )
    p.add_argument("--clear", action="store_true", help="remove the entries (all, or those --older-than)")
    p.add_argument(
        "--older-than", type=float, default=None, metavar="DAYS", help="only entries older than this"
    )
    p.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    p.set_defaults(handler=cmd_cache, out=None)
    return parser


def cmd_cache(args, out: None) -> None:
    """List or clear the activation cache (``lime_probe.cachedir.cache_report``)."""
    from lime_probe.cachedir import cache_report

    print(cache_report(args.cache_dir, clear=args.clear, older_than_days=args.older_than))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command, map errors to exit codes (see module doc)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad usage (2), message already printed
        return int(e.code or 0)
    where = f"{PROG} {args.command}"
    try:
        if hasattr(args, "threads"):  # a torch command: set before any work, record the effective count
            import torch

            if args.threads is not None:
                torch.set_num_threads(args.threads)
            args.threads = torch.get_num_threads()
        from lime_probe.cachedir import report_growth

        with (
            staged_output(args.out) if args.out else contextlib.nullcontext() as tmp,
            report_growth(getattr(args, "cache", None)),
        ):
            args.handler(args, tmp)
    except KeyboardInterrupt:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
