"""The command-line machinery shared by the two programs, ``lime-model`` and ``lime-probe``: subcommands
declared as ``Command`` and built by ``build_parser``, option types from the library's parsers
(``argument_type``), and one mapping of how a command ends to an exit code (``run_program``, ``run_command``).

Both end a failure with one line on stderr and an exit code: 0 done, 2 bad usage or input
(``lime_model.checks.BAD_INPUT``), 1 an unexpected failure (``--debug``: the full traceback instead), 130
interrupted (Ctrl-C). Options that mean the same in both programs have the same name: ``--ckpt``, ``--data``,
``--out`` (always a folder the command writes its outputs into), ``--device``, ``--threads``, ``--seed``,
``--batch-size``, ``--debug``. The library below the two programs imports nothing from here: argparse stays
in the command line. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .checks import BAD_INPUT, one_line, positive_int

_T = TypeVar("_T")

__all__ = [
    "POSITIVE_INT",
    "Command",
    "OneLineParser",
    "add_device_option",
    "argument_type",
    "build_parser",
    "close_progress_bars",
    "print_error",
    "run_command",
    "run_program",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the usage itself stays one ``--help`` away) and no abbreviated
    options (``--ckp`` is an error, not ``--ckpt``). Pass it on as ``add_subparsers(parser_class=...)``."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def close_progress_bars() -> None:
    """Close every tqdm progress bar still drawn (innermost first), so that the line printed next starts a
    line of its own instead of following a bar that a failure or Ctrl-C left half-way; tqdm is not imported
    for it (no bar exists unless it was)."""
    tqdm = sys.modules.get("tqdm.std")
    if tqdm is None:
        return
    for bar in sorted(tqdm.tqdm._instances, key=lambda b: -abs(getattr(b, "pos", 0))):
        bar.close()


def print_error(line: str) -> None:
    """``line`` on stderr, on a line of its own (`close_progress_bars` first)."""
    close_progress_bars()
    print(line, file=sys.stderr)


def argument_type(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """``parse`` as an argparse ``type``: its ValueError becomes a usage error whose message argparse prints
    as it is (a ValueError it would print as "invalid PARSE value" instead). For the library's parsers of an
    option's text (`positive_int`, a size, a site), which know nothing of argparse."""

    @functools.wraps(parse, updated=())  # its name, not the attributes of a class such as `str`
    def parse_option(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_option


POSITIVE_INT = argument_type(positive_int)  # the type of a count option: --batch-size, --threads, ...


def add_device_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--device``, as both programs take it (checked by ``check_device`` before any work)."""
    parser.add_argument(
        "--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps (default: %(default)s)"
    )


# --------------------------------------------------------------------------- subcommands and exit codes


@dataclass(frozen=True)
class Command:
    """One subcommand, declared once: ``PROG NAME``'s one-line ``help`` (also its description unless
    ``description``), its ``example`` lines (shown under ``examples:`` and run as written by
    tests/test_docs_examples.py), ``options(parser)`` adding its options, and ``run`` (called by its
    program with the parsed arguments). ``check(args)``: the checks of its input that need no model, run by
    its program before torch is imported, so a mistyped path or number is named in a second, not after a
    minute of imports and loading. ``interrupted``: what a Ctrl-C leaves behind, said after
    ``PROG NAME: interrupted; `` (``str.format``-ted with the parsed arguments; empty: nothing said)."""

    name: str
    help: str
    example: str
    run: Callable
    options: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    description: str = ""
    interrupted: str = "nothing was written"
    check: Callable[[argparse.Namespace], None] = lambda args: None


def build_parser(prog: str, description: str, commands: Iterable[Command]) -> OneLineParser:
    """The parser of ``prog``: one subcommand per ``Command``, each with ``--debug``; the chosen name
    is ``args.command``."""
    parser = OneLineParser(
        prog=prog,
        description=description,
        epilog=f"Run '{prog} COMMAND --help' for a command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    for c in commands:
        p = sub.add_parser(
            c.name,
            help=c.help,
            description=c.description or c.help,
            epilog="examples:\n" + textwrap.indent(c.example.rstrip("\n"), "  "),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.options(p)
        p.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    return parser


def run_program(
    prog: str,
    argv: Sequence[str] | None,
    parser: Callable[[], argparse.ArgumentParser],
    run: Callable[[argparse.Namespace], int],
) -> int:
    """A program's ``main``: parse ``argv`` with ``parser()`` and return ``run(args)``. From here on Ctrl-C
    raises KeyboardInterrupt; one that reaches here (while parsing, or while a command reports how it
    ended) prints ``PROG: interrupted`` and gives 130. ``--help`` gives 0 and a usage error 2, argparse's
    one line printed."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            args = parser().parse_args(argv)
        except SystemExit as e:
            return int(e.code or 0)
        return run(args)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the message short
        print_error(f"{prog}: interrupted")
        return 130


def run_command(
    where: str,
    work: Callable[[], int | None],
    *,
    debug: bool,
    interrupted: str = "",
    error_prefix: str | None = None,
) -> int:
    """``work()``'s exit code (None: 0), with how it fails mapped to an exit code and one line on stderr:

    - Ctrl-C: ``WHERE: interrupted[; INTERRUPTED]``, 130 (``interrupted`` says what it left behind);
    - bad input (``BAD_INPUT``): ``ERROR_PREFIX: error: MESSAGE``, 2 (``error_prefix`` default ``where``);
    - anything else: ``WHERE: failed: TYPE: MESSAGE (rerun with --debug for the traceback)``, 1.

    With ``debug`` the last two raise instead, for the full traceback."""
    try:
        return work() or 0
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the message short
        print_error(f"{where}: interrupted" + (f"; {interrupted}" if interrupted else ""))
        return 130
    except BAD_INPUT as e:
        if debug:
            raise
        print_error(f"{error_prefix or where}: error: {one_line(e)}")
        return 2
    except Exception as e:
        if debug:
            raise
        print_error(
            f"{where}: failed: {type(e).__name__}: {one_line(e)} (rerun with --debug for the traceback)"
        )
        return 1
