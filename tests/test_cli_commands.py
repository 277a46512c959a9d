"""Both programs' subcommands are declared one way (``lime_model.command_line.Command``): each has help and examples
that parse, options that mean the same thing have the same name in both, and one mapping of how a command
ends to its exit code and message."""

from __future__ import annotations

import argparse
import shlex

import pytest

from lime_model import checks, command_line
from lime_model import cli as model_cli
from lime_probe import cli as probe_cli
from lime_probe import cli_options
from lime_probe.specs import ANALYSES

TOOLS = {"lime-probe": probe_cli, "lime-model": model_cli}


def subcommands(prog: str) -> dict[str, argparse.ArgumentParser]:
    parser = TOOLS[prog].build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def options(prog: str) -> list[tuple[str, argparse.Action]]:
    """(subcommand, action) for every option of every subcommand of ``prog``."""
    return [(name, a) for name, p in subcommands(prog).items() for a in p._actions if a.option_strings]


ALL = [(prog, name) for prog in TOOLS for name in subcommands(prog)]


@pytest.mark.parametrize(("prog", "name"), ALL, ids=[f"{p} {n}" for p, n in ALL])
def test_every_subcommand_has_help_and_examples_that_parse(prog, name):
    sub = subcommands(prog)[name]
    command = TOOLS[prog].COMMANDS[name]
    assert command.help and sub.description
    lines = [line.split(" #")[0] for line in command.example.replace("\\\n", " ").splitlines()]
    steps = [step.strip() for line in lines for step in line.split(" && ")]  # chains run in order
    calls = [shlex.split(step) for step in steps if step.startswith(f"{prog} {name}")]
    assert calls, command.example
    for argv in calls:
        args = TOOLS[prog].build_parser().parse_args(argv[1:])  # a usage error exits
        assert args.command == name and args.debug is False
    assert "examples:\n  " + command.example.splitlines()[0] in sub.format_help()


# Options that mean the same thing in both programs: the one name each has, its metavar where it shows
# one, and the spellings it must not have (another name for the same meaning).
SHARED = {
    "checkpoint": ("--ckpt", None, ["--checkpoint", "--model", "--run"]),
    "data": ("--data", None, ["--dataset", "--text"]),
    "out": ("--out", "DIR", ["--output", "--run-dir", "--out-dir", "--outdir"]),
    "device": ("--device", None, ["--devices"]),
    "threads": ("--threads", "N", ["--num-threads", "--torch-threads"]),
    "seed": ("--seed", None, ["--random-seed"]),
    "batch size": ("--batch-size", None, ["--batch", "--bs"]),
    "activation cache": ("--cache", "DIR", ["--cache-dir"]),
    "debug": ("--debug", None, ["--traceback"]),
}


@pytest.mark.parametrize("meaning", SHARED)
def test_shared_options_have_one_name_in_both_programs(meaning):
    flag, metavar, others = SHARED[meaning]
    found = {prog: [(n, a) for n, a in options(prog) if flag in a.option_strings] for prog in TOOLS}
    for prog, hits in found.items():
        spellings = {s for _, a in options(prog) for s in a.option_strings}
        assert not spellings & set(others), (prog, spellings & set(others))
        for name, action in hits:
            assert action.option_strings == [flag], (prog, name)
            if metavar is not None:
                assert action.metavar == metavar, (prog, name)
    if meaning != "activation cache":  # lime-model has no activation cache
        assert found["lime-probe"] and found["lime-model"], meaning


def test_device_threads_and_debug_are_declared_the_same_everywhere():
    """One declaration each: the same default, type and help in every subcommand of both programs."""
    for flag in ("--device", "--debug"):
        actions = [a for prog in TOOLS for _, a in options(prog) if flag in a.option_strings]
        assert len({(a.default, a.type, a.help) for a in actions}) == 1, flag
    assert all(
        "--debug" in {s for a in p._actions for s in a.option_strings}
        for prog in TOOLS
        for p in subcommands(prog).values()
    )
    threads = [a for prog in TOOLS for _, a in options(prog) if "--threads" in a.option_strings]
    assert {a.type for a in threads} == {command_line.POSITIVE_INT} and {a.default for a in threads} == {None}
    device = next(a for _, a in options("lime-model") if "--device" in a.option_strings)
    assert device.default == "cpu"


def test_out_is_a_folder_in_both_programs():
    """Every --out names a folder the command writes into (its help says so, its metavar is DIR)."""
    outs = [(prog, n, a) for prog in TOOLS for n, a in options(prog) if "--out" in a.option_strings]
    assert {prog for prog, _, _ in outs} == set(TOOLS)
    for prog, name, action in outs:
        assert action.metavar == "DIR" and ("folder" in action.help or "DIR/" in action.help), (prog, name)


def test_every_data_kind_of_the_registry_is_declared():
    assert {s.data_kind for s in ANALYSES.values()} <= set(probe_cli.DATA_KINDS)
    entropy, blimp = (subcommands("lime-probe")[n] for n in ("entropy", "blimp"))
    assert (
        entropy.parse_args(["--ckpt", "x", "--data", "t.txt"]).max_sequences
        == ANALYSES["entropy"].max_sequences
    )
    assert blimp.parse_args(["--ckpt", "x"]).data == "nyu-mll/blimp"  # BLiMP's data: the hub id by default
    report = subcommands("lime-probe")["report"]
    assert report.parse_args(["--ckpt", "x", "--data", "t.txt", "--blimp", "b"]).blimp == "b"


# --------------------------------------------------------------------------- exit codes


def _raise(error: BaseException):
    def work(*args, **kwargs):
        raise error

    return work


@pytest.mark.parametrize(
    ("work", "code", "line"),
    [
        (lambda: None, 0, None),
        (lambda: 3, 3, None),
        (_raise(KeyboardInterrupt()), 130, "tool cmd: interrupted; nothing was written to out"),
        (_raise(ValueError("bad --x\nmore")), 2, "tool: error: bad --x"),
        (_raise(FileNotFoundError(2, "No such file or directory", "f.txt")), 2, "tool: error: f.txt: No such file or directory"),
        (_raise(KeyError("bug")), 1, "tool cmd: failed: KeyError: bug (rerun with --debug for the traceback)"),
    ],
)  # fmt: skip
def test_run_command_maps_how_a_command_ends_to_one_line_and_an_exit_code(work, code, line, capsys):
    said = {"interrupted": "nothing was written to out", "error_prefix": "tool"}
    assert command_line.run_command("tool cmd", work, debug=False, **said) == code
    err = capsys.readouterr().err
    assert err == ("" if line is None else line + "\n")


def test_debug_shows_the_traceback_but_not_for_ctrl_c(capsys):
    with pytest.raises(ValueError, match="bad"):
        command_line.run_command("tool cmd", _raise(ValueError("bad")), debug=True)
    with pytest.raises(RuntimeError, match="boom"):
        command_line.run_command("tool cmd", _raise(RuntimeError("boom")), debug=True)
    assert command_line.run_command("tool cmd", _raise(KeyboardInterrupt()), debug=True) == 130
    assert capsys.readouterr().err == "tool cmd: interrupted\n"


def test_run_program_parses_and_maps_usage_help_and_ctrl_c(capsys):
    def parser():
        p = command_line.OneLineParser(prog="tool")
        p.add_argument("--n", type=command_line.POSITIVE_INT)
        return p

    assert command_line.run_program("tool", ["--n", "2"], parser, lambda args: args.n + 5) == 7
    assert command_line.run_program("tool", ["--help"], parser, lambda args: 9) == 0
    capsys.readouterr()
    assert command_line.run_program("tool", ["--n", "0"], parser, lambda args: 9) == 2
    assert capsys.readouterr().err == (
        "tool: error: argument --n: expected a positive integer, got 0 (see tool --help)\n"
    )
    assert command_line.run_program("tool", [], parser, _raise(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "tool: interrupted\n"


def test_a_library_parser_keeps_its_message_only_through_argument_type(capsys):
    """The library's parsers raise ValueError, which argparse alone prints as "invalid NAME value";
    through `argument_type` the usage error is the parser's own message."""
    with pytest.raises(ValueError, match=r"^expected a positive integer, got 'x'$"):
        checks.positive_int("x")
    for parse, said in (
        (checks.positive_int, "invalid positive_int value: 'x'"),
        (command_line.argument_type(checks.positive_int), "expected a positive integer, got 'x'"),
    ):
        p = command_line.OneLineParser(prog="tool")
        p.add_argument("--n", type=parse)
        assert command_line.run_program("tool", ["--n", "x"], lambda p=p: p, lambda args: 9) == 2
        assert capsys.readouterr().err == f"tool: error: argument --n: {said} (see tool --help)\n"


def test_each_program_keeps_its_message_prefixes(tmp_path, capsys):
    """lime-model names itself on bad input and the command on failures; lime-probe names the command."""
    assert model_cli.main(["eval-arithmetic", "--ckpt", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("lime-model: error: ")
    assert probe_cli.main(["cache", "--cache", str(tmp_path / "c"), "--older-than", "-2"]) == 2
    assert capsys.readouterr().err.startswith("lime-probe cache: error: ")


# --------------------------------------------------------------------------- reproduce


def test_reproduce_runs_the_named_study_with_the_given_settings(monkeypatch, tmp_path, capsys):
    import lime_probe.studies

    calls = []

    def run_study(name, **kw):
        calls.append((name, kw))
        return tmp_path / "results"

    monkeypatch.setattr(lime_probe.studies, "run_study", run_study)
    name = next(iter(probe_cli.STUDIES))
    argv = ["reproduce", "--study", name, "--seeds", "3,1", "--out", str(tmp_path / "r"), "--size", "tiny"]
    assert probe_cli.main([*argv, "--threads", "1"]) == 0
    assert calls == [
        (
            name,
            {"data": None, "out": str(tmp_path / "r"), "results": None, "seeds": (3, 1), "size": "tiny", "device": "cpu",
             "reproducible": False},  # lm-cpu's runs were trained before the mode existed
        )
    ]  # fmt: skip
    assert f"results in {tmp_path / 'results'}" in capsys.readouterr().err

    monkeypatch.setattr(lime_probe.studies, "run_study", _raise(ValueError("study x needs --data")))
    assert probe_cli.main(["reproduce", "--study", name, "--threads", "1"]) == 2
    assert capsys.readouterr().err == "lime-probe reproduce: error: study x needs --data\n"


def test_reproduce_offers_exactly_the_registered_studies(monkeypatch, capsys):
    """``--study`` is required and its choices are ``lime_probe.studies.STUDIES``; --baselines is gone
    (a study declares its models)."""

    class Study:
        def __init__(self, name, needs_data):
            self.name, self.needs_data, self.question = name, needs_data, f"the {name} question"

    fake = {"one": Study("one", True), "two": Study("two", False)}
    monkeypatch.setattr(probe_cli, "STUDIES", fake)
    monkeypatch.setattr(cli_options, "STUDIES", fake)
    reproduce = subcommands("lime-probe")["reproduce"]
    (study,) = [a for a in reproduce._actions if a.dest == "study"]
    assert study.required and list(study.choices) == ["one", "two"]
    text = reproduce.format_help()
    assert "the one question" in text and "the two question" in text and "(needed by one;" in text
    for argv in (
        ["reproduce"],
        ["reproduce", "--study", "three"],
        ["reproduce", "--study", "one", "--baselines", "x"],
    ):
        assert probe_cli.main(argv) == 2
        assert len(capsys.readouterr().err.splitlines()) == 1
