"""``lime-probe``: the paper's analyses from the command line.

    lime-probe entropy --ckpt runs/lime --ckpt runs/llama --data valid.txt --site values --out out/

Every command compares one or more ``--ckpt`` side by side (named by ``--label``), writes
results as JSON and CSV (settings, checkpoint identity and versions recorded; see
``lime_probe.results``) and figures as PNG and PDF into ``--out``, and prints a compact table.

Output is staged in a hidden temporary folder beside ``--out`` and moved in only when the
command succeeds, so a failure or Ctrl-C never leaves half-written files there. Exit codes:
0 done, 2 bad usage or input (one line on stderr), 1 an unexpected failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lime_probe import figures as F
from lime_probe.report import Section, Table, write_report
from lime_probe.results import run_metadata, write_results

PROG = "lime-probe"
SITES = ("hidden", "final", "values", "keys", "routed_values", "routed_keys")
DEFAULT_WORDS = (" is", " are", " was", " were")
# Errors that mean "the input is wrong" (exit 2), as opposed to a bug or a crash (exit 1).
BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, KeyError)


# --------------------------------------------------------------------------- checkpoints, data


@dataclass
class Checkpoint:
    """A loaded checkpoint: its label in tables and legends, its path or hub id, model and tokenizer."""

    label: str
    source: str
    model: object
    tokenizer: object


def labels_for(ckpts: Sequence[str], labels: Sequence[str] | None) -> list[str]:
    """One label per checkpoint: the given ones, or each path's last component; must be unique."""
    if labels and len(labels) != len(ckpts):
        raise ValueError(f"got {len(labels)} --label for {len(ckpts)} --ckpt; give one label per checkpoint or none")
    out = list(labels) if labels else [Path(c.rstrip("/")).name or c for c in ckpts]
    dupes = sorted({x for x in out if out.count(x) > 1})
    if dupes:
        raise ValueError(f"checkpoint labels must be unique, {dupes} repeats; name them with --label")
    return out


def load_checkpoints(ckpts: Sequence[str], labels: Sequence[str] | None, device: str) -> list[Checkpoint]:
    """Load every checkpoint with ``lime_probe.load`` (errors name the offending path)."""
    names = labels_for(ckpts, labels)
    from lime_probe.load import load

    out = []
    for label, ckpt in zip(names, ckpts, strict=True):
        model, tok = load(ckpt, device=device)
        out.append(Checkpoint(label, ckpt, model, tok))
    return out


def load_texts(spec: str, max_sequences: int) -> list[str]:
    """The first ``max_sequences`` documents of a local .txt/.jsonl/.parquet file or folder, or of
    ``hf:NAME[:CONFIG][:SPLIT]`` (``lime_model.data.load_texts``); ValueError if there is no text."""
    from lime_model.data import load_texts as _load

    return _load(spec, max_texts=max_sequences)


# --------------------------------------------------------------------------- analyses


@dataclass
class Analysis:
    """What one analysis produced: the flat table, structured extras, figures, and a summary."""

    name: str  # file stem of its results, e.g. "entropy_values"
    title: str
    rows: list[dict]
    text: str = ""
    extra: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)  # stem -> Figure
    columns: tuple[str, ...] = ()  # shown in the compact table (default: all)


def _layer_list(spec: str | None) -> list[int] | None:
    if spec in (None, "", "all"):
        return None
    try:
        return [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be 'all' or comma-separated integers, got {spec!r}") from None


def _extract(ck: Checkpoint, texts: Sequence[str], site: str, args, **kw):
    from lime_probe.extract import extract

    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; choose from {', '.join(SITES)}")
    return extract(ck.model, ck.tokenizer, texts, sites=[site], layers=_layer_list(getattr(args, "layers", None)),
                   max_length=args.max_length, max_tokens=args.max_tokens, batch_size=args.batch_size,
                   cache_dir=args.cache, **kw)


def entropy_analysis(cks: Sequence[Checkpoint], texts: Sequence[str], args) -> Analysis:
    """Matrix entropy per layer of ``args.site`` for each checkpoint (paper Figures 2a, 4a, 7a)."""
    from lime_probe.entropy import layer_entropies

    knobs = {} if args.alpha is None else {"alpha": args.alpha}
    rows, series = [], {}
    for ck in cks:
        acts = _extract(ck, texts, args.site, args)
        res = layer_entropies({layer: acts.sequences(args.site, layer) for layer in acts[args.site]},
                              preset=args.preset, seed=args.seed, **knobs)
        layers = sorted(res)
        for layer in layers:
            r = res[layer]
            rows.append({"model": ck.label, "site": args.site, "layer": layer, "entropy_mean": r.mean,
                         "entropy_std": r.std, "ci_low": r.ci_low, "ci_high": r.ci_high, "n_sequences": len(r.values),
                         "alpha": r.config.alpha})
        series[ck.label] = {"layers": layers, "mean": [res[la].mean for la in layers],
                            "low": [res[la].ci_low for la in layers], "high": [res[la].ci_high for la in layers]}
    alpha = rows[0]["alpha"]
    fig = F.plot_entropy(series, site=args.site, alpha=alpha)
    return Analysis(f"entropy_{args.site}", f"Matrix entropy of {args.site}", rows,
                    text=(f"Matrix-based Renyi entropy (alpha={alpha:g}, preset {args.preset!r}) of each sequence's "
                          f"{args.site} per layer; mean over {rows[0]['n_sequences']} sequences with a 95% bootstrap CI. "
                          "Lower entropy means tokens crowd into fewer directions (representation collapse)."),
                    figures={f"entropy_{args.site}": fig},
                    columns=("model", "layer", "entropy_mean", "ci_low", "ci_high"))


ANALYSES: dict[str, Callable] = {"entropy": entropy_analysis}


# --------------------------------------------------------------------------- output


@contextmanager
def staged_output(out: str | os.PathLike):
    """Yield a fresh temp folder beside ``out``; on success move its files into ``out``.

    On any exception (including KeyboardInterrupt) the temp folder is removed and ``out`` is
    left as it was. Raises ValueError if ``out`` is a file and PermissionError if it cannot be
    written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"--out {out}: parent folder {parent} does not exist")
    if not os.access(out if out.exists() else parent, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out} is not writable")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    except OSError as e:
        raise PermissionError(f"--out {out} is not writable ({e.strerror})") from None
    try:
        yield tmp
        if not out.exists():
            os.replace(tmp, out)
            return
        for item in sorted(tmp.rglob("*")):
            target = out / item.relative_to(tmp)
            if item.is_dir():
                target.mkdir(exist_ok=True)
            else:
                os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    numeric = [all(isinstance(r.get(c), int | float | np.number) or r.get(c) is None for r in rows) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric, strict=True))
              for row in cells]
    return "\n".join(lines)


def write_analysis(a: Analysis, out: Path, meta: dict) -> None:
    """Write an analysis's results (JSON + CSV) and figures (PNG + PDF) into ``out``."""
    write_results(out / a.name, a.rows, meta=meta, extra=a.extra)
    for stem, fig in a.figures.items():
        F.save_figure(fig, out / stem)


def _settings(args) -> dict:
    skip = {"handler", "func", "debug"}
    return {k: v for k, v in vars(args).items() if k not in skip}


# --------------------------------------------------------------------------- commands


def _analysis_command(name: str):
    def handler(args, out: Path) -> None:
        texts = load_texts(args.data, args.max_sequences)
        cks = load_checkpoints(args.ckpt, args.label, args.device)
        a = ANALYSES[name](cks, texts, args)
        meta = run_metadata(name, settings=_settings(args), checkpoints={c.label: c.source for c in cks})
        write_analysis(a, out, meta)
        print(format_table(a.rows, a.columns))

    return handler


def cmd_report(args, out: Path) -> None:
    """Run the chosen analyses on every checkpoint and write one self-contained HTML report."""
    texts = load_texts(args.data, args.max_sequences)
    cks = load_checkpoints(args.ckpt, args.label, args.device)
    meta = run_metadata("report", settings=_settings(args), checkpoints={c.label: c.source for c in cks})
    sections = []
    for name in args.analyses:
        a = ANALYSES[name](cks, texts, args)
        write_analysis(a, out, meta)
        sections.append(Section(a.title, text=a.text, figures=list(a.figures.values()),
                                tables=[Table(a.title, [{c: r.get(c) for c in a.columns} for r in a.rows]
                                              if a.columns else a.rows)]))
        print(f"\n{a.title}\n{format_table(a.rows, a.columns)}")
    labels = " vs ".join(c.label for c in cks)
    write_report(out / "report.html", f"lime-probe report: {labels}", sections, meta=meta)


# --------------------------------------------------------------------------- parser


EXAMPLES = {
    "entropy": "lime-probe entropy --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
               "    --data wikitext-2/valid.txt --site values --max-sequences 64 --out out/entropy",
    "report": "lime-probe report --ckpt runs/lime --ckpt runs/llama --data valid.txt --out out/report",
}

HELP = {
    "entropy": "matrix-based Renyi entropy per layer (paper Sec. 5.3, Figures 2a/4a/7a)",
    "report": "run several analyses and write one self-contained HTML report",
}


def _common(p: argparse.ArgumentParser, *, data: bool = True) -> None:
    g = p.add_argument_group("checkpoints and data")
    g.add_argument("--ckpt", action="append", required=True, metavar="PATH|HUB_ID",
                   help="checkpoint directory or hub id; repeat to compare side by side")
    g.add_argument("--label", action="append", metavar="NAME",
                   help="name per --ckpt in tables and legends (default: the folder name)")
    if data:
        g.add_argument("--data", required=True, metavar="SPEC",
                       help="a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG][:SPLIT]")
        g.add_argument("--max-sequences", type=_positive, default=64, metavar="N",
                       help="use at most N sequences (default: %(default)s)")
        g.add_argument("--max-length", type=_positive, default=256, metavar="T",
                       help="truncate each sequence to T tokens (default: %(default)s)")
        g.add_argument("--max-tokens", type=_positive, default=None, metavar="N",
                       help="stop extracting after N tokens in all (default: no limit)")
        g.add_argument("--batch-size", type=_positive, default=8, metavar="B",
                       help="sequences per forward pass (default: %(default)s)")
        g.add_argument("--cache", default=_default_cache(), metavar="DIR",
                       help="activation cache; a rerun or an interrupted run reuses it (default: %(default)s)")
        g.add_argument("--no-cache", dest="cache", action="store_const", const=None,
                       help="extract without the on-disk cache")
    r = p.add_argument_group("run")
    r.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: %(default)s)")
    r.add_argument("--out", default="lime-probe-out", metavar="DIR",
                   help="folder for results and figures (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="seed for sampling, folds, t-SNE (default: %(default)s)")
    r.add_argument("--debug", action="store_true", help="show the full traceback on failure")


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
    p.add_argument("--site", default=default, choices=SITES, help="representation to probe (default: %(default)s)")
    p.add_argument("--layers", default="all", help="'all' or comma-separated layer indices (default: all)")


def _entropy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="lime", choices=("lime", "layer-by-layer"),
                   help="normalisation preset: the official code's or Skean et al.'s (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=None, help="Renyi order (default: the preset's)")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the usage itself stays one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``lime-probe`` argument parser with one subcommand per analysis."""
    parser = _Parser(prog=PROG, description="The LIMe paper's analyses of representation collapse.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run 'lime-probe COMMAND --help' for a command's options and an example.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def add(name: str, handler: Callable, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=HELP[name], description=HELP[name],
                           epilog="example:\n" + textwrap.indent(EXAMPLES[name], "  "),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _common(p, **kw)
        p.set_defaults(handler=handler)
        return p

    p = add("entropy", _analysis_command("entropy"))
    _site_options(p, "values")
    _entropy_options(p)

    p = add("report", cmd_report)
    _site_options(p, "values")
    _entropy_options(p)
    p.add_argument("--analyses", nargs="+", default=list(ANALYSES), choices=list(ANALYSES),
                   help="analyses to include (default: all that need only text)")
    return parser


def _one_line(e: BaseException) -> str:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(msg.split()) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command, map errors to exit codes (see module doc)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad usage (2), message already printed
        return int(e.code or 0)
    where = f"{PROG} {args.command}"
    try:
        with staged_output(args.out) as tmp:
            args.handler(args, tmp)
    except KeyboardInterrupt:
        print(f"{where}: interrupted; nothing was written to {args.out}", file=sys.stderr)
        return 130
    except BAD_INPUT as e:
        if args.debug:
            raise
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        print(f"{where}: failed: {type(e).__name__}: {_one_line(e)} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
    print(f"results in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
