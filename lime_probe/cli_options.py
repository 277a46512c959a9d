"""The options of ``lime-probe``'s commands, generated from the settings they fill.

An analysis's command takes one option per field of its parameter dataclass and of the settings dataclasses
``Loading`` and ``Extraction`` (`add_param_options`, from each field's ``option`` metadata), its ``--data``
as its data kind declares (``lime_probe.specs.data.DATA_KINDS``), and the run's ``--device``, ``--out``,
``--threads``; ``report``, ``demo``, ``reproduce`` and ``cache`` add their own. The parsed arguments are
turned back into those dataclasses by ``lime_probe.cli``; nothing here runs a command.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Sequence

from lime_model.command_line import POSITIVE_INT, add_device_option, argument_type
from lime_probe.extraction.settings import (
    LAYERS_HELP,
    Extraction,
    Loading,
    cli_defaults,
    default_cache,
    dest_of,
)
from lime_probe.specs import ANALYSES, Spec
from lime_probe.specs.base import THREADS_HELP
from lime_probe.specs.data import DATA_KINDS
from lime_probe.specs.reporting import REPORT_DEFAULT, REPORT_JOINED, REPORTABLE, differing_defaults
from lime_probe.studies import STUDIES  # declarations only: no model code


def dest(flag: str) -> str:
    """The attribute of the parsed arguments that holds ``flag`` (``--max-sequences`` -> ``max_sequences``)."""
    return flag.removeprefix("--").replace("-", "_")


def checkpoint_options(
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
    kind = DATA_KINDS[data]
    if kind.option is None:  # the analysis reads the run folders only
        return
    add_param_options(g, Loading)
    g.add_argument(kind.flag, **kind.option)
    if kind.texts:
        g.add_argument(
            "--max-sequences",
            type=POSITIVE_INT,
            default=max_sequences,
            metavar="N",
            help="use at most N sequences (default: %(default)s)"
            if max_sequences
            else "use at most N sequences in every analysis (default: each analysis's own: "
            + ", ".join(f"{n} {s.max_sequences}" for n, s in ANALYSES.items() if n in REPORT_DEFAULT)
            + ")",
        )
    add_param_options(g, Extraction, skip=() if layers else ("layers",))


def run_options(p: argparse.ArgumentParser, out: str = "lime-probe-out") -> None:
    """The run's group: --device, --out (default ``out``), --threads, --verbose."""
    r = p.add_argument_group("run")
    add_device_option(r)
    r.add_argument(
        "--out", default=out, metavar="DIR", help="folder for results and figures (default: %(default)s)"
    )
    _threads_option(r)
    r.add_argument(
        "--verbose", action="store_true", help="show the libraries' own loading messages and warnings"
    )


def _threads_option(p) -> None:
    p.add_argument("--threads", type=POSITIVE_INT, default=None, metavar="N", help=THREADS_HELP)


def _seed_list(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def add_param_options(
    group, params: type, skip: Sequence[str] = (), own_defaults: dict[str, str] | None = None
) -> list[str]:
    """One option per field of the dataclass ``params`` declared with ``option`` (``per_word`` ->
    ``--per-word``), typed from its annotation and documented from its metadata (``flag``, ``cli_default``,
    argparse extras; `lime_probe.extraction.settings.option`); a boolean field that defaults to True
    becomes ``--no-NAME``, a field with ``off`` gets a ``--no-NAME`` that sets it to None, a field that
    ``parse`` reads takes one text value. Fields named in ``skip`` are left out. Returns the names added.

    With ``own_defaults`` (``report``: {field: the differing defaults of the analyses, as text}) an option
    left out is left out of the parsed arguments, so each analysis keeps its own default (``params_of``)."""
    hints = typing.get_type_hints(params)
    defaults = cli_defaults(params)
    added = []
    for f in dataclasses.fields(params):
        if f.name in skip or "help" not in f.metadata:  # a plain field is set by code, not by an option
            continue
        meta = {k: v for k, v in f.metadata.items() if k not in ("cli_default", "parse")}
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        default = defaults[dest_of(f)]
        kw: dict = {"default": list(default) if isinstance(default, tuple) else default}
        help = meta.pop("help")
        if "default" not in help and default is not None:
            help += " (default: %(default)s)"
        if own_defaults is not None:
            help = help.replace("%(default)s", str(kw["default"]).replace("%", "%%"))
            if f.name in own_defaults:
                help += f"; each analysis its own: {own_defaults[f.name]}".replace("%", "%%")
            kw["default"] = argparse.SUPPRESS
        kw["help"] = help
        positive, off = meta.pop("positive", False), meta.pop("off", None)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        dest = dest_of(f)
        if base is bool and default is True:  # on by default: the option turns it off
            flag, kw["action"] = "--no-" + flag[2:], "store_false"
        elif base is bool:
            kw["action"] = "store_true"
        elif "parse" in f.metadata or "action" in meta:  # one text value for parse, or as the action says
            pass
        elif typing.get_origin(base) is tuple:
            kw["nargs"] = "+"
        else:
            kw["type"] = POSITIVE_INT if positive else base
        if "type" in meta:  # the library's parser of the text, its ValueError the usage error
            meta["type"] = argument_type(meta["type"])
        kw.update(meta)  # metavar, choices, type, action
        group.add_argument(flag, dest=dest, **kw)
        if off is not None:
            group.add_argument("--no-" + flag[2:], dest=dest, action="store_const", const=None, help=off)
        added.append(f.name)
    return added


def report_options(p: argparse.ArgumentParser) -> None:
    """``report``'s options: the checkpoints and texts, the run, each reportable analysis's parameters once
    (left out, every analysis keeps its own default), --analyses, the joined analyses' data (--blimp) and
    --allow-skips."""
    checkpoint_options(p, data="texts", max_sequences=None, layers=False)
    run_options(p)
    g, seen, own = p.add_argument_group("analyses"), ["layers"], differing_defaults()
    g.add_argument(
        "--layers",
        default=argparse.SUPPRESS,  # left out, an analysis with layers of its own (BLiMP) keeps them
        help=LAYERS_HELP + " (default: all; BLiMP: the paper's range)",
    )
    for name in REPORTABLE:  # each option once; left out, every analysis keeps its own default
        seen += add_param_options(g, ANALYSES[name].params, skip=seen, own_defaults=own)
    g.add_argument(
        "--analyses",
        nargs="+",
        default=REPORT_DEFAULT,
        choices=REPORTABLE,
        metavar="NAME",
        help="analyses (from: %(choices)s) to include, each on the checkpoints it applies to (default: %(default)s)",
    )
    for name, flag in REPORT_JOINED.items():
        j = p.add_argument_group(f"{name} (with {flag})")
        report = DATA_KINDS[ANALYSES[name].data_kind].report
        assert report is not None  # what REPORT_JOINED holds
        j.add_argument(flag, **report[1])
        add_param_options(j, ANALYSES[name].params, skip=seen, own_defaults=own)
    p.add_argument(
        "--allow-skips",
        action="store_true",
        help="exit 0 when some sections were skipped for their input (default: the report is written and "
        "the command exits 3, naming them)",
    )


def demo_options(p: argparse.ArgumentParser) -> None:
    """``demo``'s options: the run (out: lime-probe-out/demo), --seed, --quick, --runs, --reproducible (on)."""
    run_options(p, out="lime-probe-out/demo")
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
    _reproducible_option(p, "on")


def reproduce_options(p: argparse.ArgumentParser) -> None:
    """``reproduce``'s options: --study (its description lists the studies), --data, --seeds, --out,
    --results, --size, --device, --threads, --reproducible (the study's own mode by default)."""
    p.description = (p.description or "") + "\n".join(
        f"  {s.name:<19} {s.question}" for s in STUDIES.values()
    )
    p.add_argument(
        "--study", required=True, choices=STUDIES, metavar="NAME", help="the study to run (listed above)"
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="folder holding blimp/ and wikitext-2/{valid,test}.txt or fineweb-edu/{train/,test.jsonl} "
        "(needed by "
        + ", ".join(n for n, s in STUDIES.items() if s.needs_data)
        + "; the others make their own data)",
    )
    p.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="S,S,...",
        help="training seeds, at least two, instead of the study's (e.g. the finished seeds of a stopped study)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="folder of the training runs and measurements, reused on a rerun (default: runs/STUDY)",
    )
    p.add_argument(
        "--results",
        default=None,
        metavar="DIR",
        help="folder of the tables, figures and findings.md (default: OUT/results)",
    )
    p.add_argument(
        "--size",
        default="full",
        choices=("full", "tiny"),
        help="full: the study as declared; tiny: a smoke run of it (default: %(default)s)",
    )
    add_device_option(p)
    _threads_option(p)
    _reproducible_option(p, "the study's own: on, unless it declares reproducible=False")


def _reproducible_option(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--reproducible",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin MKL, oneDNN, openBLAS and PyTorch's CPU kernels to AVX2, one thread and deterministic "
        "algorithms, so that the same seed gives the same bits on any Intel x86-64 CPU with AVX2 (MKL ignores "
        "its pin on AMD ones: lime_model.reproducible); "
        "recorded in the runs and the results' metadata; finished runs are reused only in their own mode "
        f"(default: {default})",
    )


def cache_options(p: argparse.ArgumentParser) -> None:
    """``cache``'s options: --cache, --clear, --older-than, --ckpt, --yes."""
    p.add_argument(
        "--cache",
        dest="cache_dir",
        default=default_cache(),
        metavar="DIR",
        help="the activation cache (default: %(default)s, yours alone: under $XDG_CACHE_HOME, else ~/.cache)",
    )
    p.add_argument(
        "--clear",
        action="store_true",
        help="remove the entries (all, or those --older-than / of --ckpt), after asking on the terminal",
    )
    p.add_argument(
        "--older-than",
        type=float,
        default=None,
        metavar="DAYS",
        help="only entries unused for over DAYS days",
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


def analysis_options(spec: Spec) -> Callable[[argparse.ArgumentParser], None]:
    """The options of the analysis ``spec``'s command: its checkpoints and data, the run, and one per field of
    its parameter dataclass."""

    def options(p: argparse.ArgumentParser) -> None:
        checkpoint_options(
            p,
            data=spec.data_kind,
            max_sequences=spec.max_sequences,
            layers=spec.data_kind in ("texts", "pairs"),
        )
        run_options(p)
        add_param_options(p.add_argument_group("analysis"), spec.params)

    return options
