"""Every shell and Python example in README.md and docs/*.md and every example in the CLIs' ``--help``
texts runs as written; README's table of analyses is the registry's.

The examples are parsed, never listed here, so a new or changed example is tested as it stands:

- README.md, then docs/*.md: every line of every fenced ```bash block (``\\`` continuations joined, ``#``
  lines and trailing comments dropped). A block right after the line ``<!-- not run in tests: REASON -->``
  (invisible when rendered) is skipped with that reason (hub ids, 8 GPUs, the test suite itself).
- ``--help``: every line after ``example:`` / ``examples:`` in the help of each subcommand of
  ``lime-probe`` and ``lime-model``; a line carrying ``# not run in tests: REASON`` is skipped.
- The same documents' ```python blocks, whole (one test; see
  ``test_python_examples_run``).

How a command is run, in one shared scratch folder (so ``runs/lime`` made by one example is there
for the next), with ``lime-probe``/``lime-model`` called in-process and ``&&`` chains in order:

- The README's data folder ``data/`` (a path starting ``data/``, or ``--data data``) is read as
  ``$LIME_PROBE_DATA``; an example that uses it is skipped with a reason where that variable is unset.
- Sizes are capped at ``SIZE_CAPS`` (and the cap added where the command takes the flag but the
  example leaves it out, except ``--max-tokens``; word probes keep ``WORD_SEQUENCES`` sequences); ``lime-model train`` gets ``--steps $LIME_PROBE_DOCS_STEPS``
  (default 20), and ``lime-probe`` commands ``--threads 1``.
- Examples that write a run (``lime-model train ... --out DIR``) run first, in document order, in a
  session fixture; the examples that read ``runs/...`` then find them.
- The slow tier, ``SLOW`` (the demo trains two models) and word probes (commands taking ``--words``:
  separability, tsne, report), runs only with ``LIME_PROBE_DOCS_SLOW=1`` (several minutes).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import isolate_registries

ROOT = Path(__file__).resolve().parents[1]
# the README's folder of the user's own data: "data/..." as a path of its own, or "--data data"
DATA = re.compile(r"(?<![\w./-])data(?=/)|(?<=--data )data(?=\s|$)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A help text's example line marks itself; a document marks a whole block with a comment line right above it,
# invisible when rendered.
NOT_RUN = re.compile(r"#.*\bnot run in tests:\s*(?P<reason>.+?)\)?$")
NOT_RUN_BLOCK = re.compile(r"^<!--\s*not run in tests:\s*(?P<reason>.+?)\s*-->$")
# flag -> the largest value used in tests (the example's own value when smaller)
SIZE_CAPS = {"--max-sequences": 200, "--max-pairs": 20, "--per-word": 20, "--max-tokens": 2000}
# Word probes (--words) read up to this many documents: the cpu-tiny runs read 64 tokens of each, and only
# both WikiText-2 files' 2,480 documents hold the 50 of each of is/are/was/were that separability's five
# folds need. With the demo, they are the slow tier.
WORD_SEQUENCES = 5000
SLOW = {("lime-probe", "demo"), ("lime-probe", "reproduce")}
STEPS = int(os.environ.get("LIME_PROBE_DOCS_STEPS", "20"))


@dataclass(frozen=True)
class Example:
    where: str  # "README.md:112", "docs/models.md:40" or "lime-probe entropy --help"
    command: str  # as written, continuations joined
    skip: str | None = None


def _join_continuations(lines: list[str]) -> list[tuple[int, str]]:
    """(index of first line, logical line) for `lines`, joining lines that end in a backslash."""
    out, start, parts = [], None, []
    for i, line in enumerate(lines):
        if start is None:
            start = i
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        out.append((start, " ".join(p.strip() for p in parts)))
        start, parts = None, []
    return out


@dataclass(frozen=True)
class Block:
    first: int  # line number of the first line inside the fence
    lines: list[str]
    skip: str | None = None  # the reason of a `NOT_RUN_BLOCK` line right above the fence


def fenced_blocks(path: Path, language: str) -> list[Block]:
    """Every ```language block of `path`, in order."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{language}":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            marker = NOT_RUN_BLOCK.match(lines[i - 1].strip()) if i else None
            blocks.append(Block(i + 2, lines[i + 1 : end], marker and marker["reason"]))
            i = end
        i += 1
    return blocks


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def doc_examples(path: Path) -> list[Example]:
    examples = []
    for block in fenced_blocks(path, "bash"):
        for k, command in _join_continuations(block.lines):
            if command and not command.startswith("#"):
                examples.append(Example(f"{_name(path)}:{block.first + k}", command, block.skip))
    return examples


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each CLI's top-level parser by program name."""
    from lime_model import cli as model_cli
    from lime_probe import cli as probe_cli

    return {"lime-probe": probe_cli.build_parser(), "lime-model": model_cli.build_parser()}


def help_examples() -> list[Example]:
    examples = []
    for prog, parser in _parsers().items():
        for name, sub in _subcommands(parser).items():
            text = sub.format_help()
            match = re.search(r"^examples?:\n(?P<body>(?:[ \t]+.*\n?|\n)+)", text, re.M)
            if not match:
                continue
            body = textwrap.dedent(match["body"]).strip().splitlines()
            for _, command in _join_continuations(body):
                if command.startswith(prog):
                    match = NOT_RUN.search(command)
                    examples.append(
                        Example(f"{prog} {name} --help", command, match and match["reason"].strip())
                    )
    return examples


EXAMPLES = [e for path in DOCS for e in doc_examples(path)] + help_examples()


def _writes_run(argv: list[str]) -> bool:
    return argv[:2] == ["lime-model", "train"] and "--out" in argv


def _steps(command: str) -> list[list[str]]:
    """The argv of each command of an ``&&`` chain (comments dropped)."""
    return [shlex.split(part, comments=True) for part in command.split("&&")]


def _options(argv: list[str], parsers: dict[str, argparse.ArgumentParser]) -> dict:
    """The option strings the subcommand of `argv` takes ({} if unknown)."""
    sub = _subcommands(parsers[argv[0]]).get(argv[1] if len(argv) > 1 else "") if argv[0] in parsers else None
    return sub._option_string_actions if sub else {}


def _shrink(argv: list[str], parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """`argv` with SIZE_CAPS applied (added where the subcommand takes the flag), fewer training
    steps and one thread (see the module docstring)."""
    prog, takes = argv[0], _options(argv, parsers)
    caps = SIZE_CAPS | ({"--max-sequences": WORD_SEQUENCES} if "--words" in takes else {})
    argv = list(argv)
    for flag, cap in caps.items():
        if flag in argv:
            i = argv.index(flag) + 1
            argv[i] = str(min(int(argv[i]), cap))
        elif flag in takes and flag != "--max-tokens":
            argv += [flag, str(cap)]
    if _writes_run(argv) and "--steps" not in argv:
        argv += ["--steps", str(STEPS), "--no-progress"]
    if prog == "lime-probe" and "--threads" in takes and "--threads" not in argv:
        argv += ["--threads", "1"]
    return argv


def run(command: str, data: str | None) -> tuple[int, str]:
    """Run `command` in the current folder; (exit code of the first failing step or 0, which step)."""
    from lime_model import cli as model_cli
    from lime_probe import cli as probe_cli

    mains = {"lime-probe": probe_cli.main, "lime-model": model_cli.main}
    parsers = _parsers()
    for argv in _steps(with_data(command, data)):
        if argv[0] not in mains:
            return 127, f"{argv[0]}: not a lime-probe/lime-model command (mark it '# not run in tests: ...')"
        argv = _shrink(argv, parsers)
        try:
            code = mains[argv[0]](argv[1:])
        except SystemExit as e:  # argparse usage errors
            code = int(e.code or 0)
        if code:
            return code, shlex.join(argv)
    return 0, ""


def _producers() -> dict[str, Example]:
    """--out folder -> the first example that trains a run into it."""
    out = {}
    for example in EXAMPLES:
        for argv in _steps(example.command):
            if _writes_run(argv):
                out.setdefault(argv[argv.index("--out") + 1], example)
    return out


def with_data(text: str, data: str | None) -> str:
    """``text`` with the README's ``data/`` folder read as ``data`` (left as written when None)."""
    return DATA.sub(lambda _: data, text) if data else text


def _data() -> str | None:
    root = os.environ.get("LIME_PROBE_DATA")
    return root if root and Path(root).is_dir() else None


def _skip_reason(example: Example) -> str | None:
    if example.skip:
        return f"not run in tests: {example.skip}"
    if DATA.search(example.command) and _data() is None:
        return "uses data/: set LIME_PROBE_DATA to a folder holding wikitext-2/ and blimp/"
    parsers = _parsers()
    steps = _steps(example.command)
    slow = any(tuple(argv[:2]) in SLOW or "--words" in _options(argv, parsers) for argv in steps)
    if slow and not os.environ.get("LIME_PROBE_DOCS_SLOW"):
        return "slow (trains models or reads thousands of documents): set LIME_PROBE_DOCS_SLOW=1 to run it"
    return None


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs")


@pytest.fixture(scope="session")
def runs(workdir) -> dict[str, tuple[int, str]]:
    """Run, in document order, every example that writes a training run; where -> (code, step)."""
    done = {}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for example in EXAMPLES:
            if _skip_reason(example) is None and any(_writes_run(a) for a in _steps(example.command)):
                done[example.where] = run(example.command, _data())
    finally:
        os.chdir(cwd)
    return done


def test_examples_were_found():
    assert any(e.where.startswith("README.md") for e in EXAMPLES)
    assert any(e.where.startswith("docs/") for e in EXAMPLES)
    assert any(e.where.startswith("lime-probe") for e in EXAMPLES)


def test_user_texts_name_no_checkout_data():
    """The package, its help texts, docs and notebooks name a user's own ``data/``, never this checkout's
    ``../shared`` (the README alone says where ``./dev`` finds the test data); ``data/`` is read as the
    variable's folder, wherever it stands as a path of its own."""
    files = [
        *ROOT.glob("lime_probe/**/*.py"),
        *ROOT.glob("lime_model/**/*.py"),
        *DOCS[1:],
        *ROOT.glob("analyses/*.ipynb"),
    ]
    assert len(files) > 40
    assert [str(f.relative_to(ROOT)) for f in files if "../shared" in f.read_text()] == []
    text = 'lime-probe x --data data --blimp data/blimp && load_texts("data/w/t.txt") runs/data/x mydata/y --data data2'
    assert with_data(text, "/D") == (
        'lime-probe x --data /D --blimp /D/blimp && load_texts("/D/w/t.txt") runs/data/x mydata/y --data data2'
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.where}: {e.command[:60]}" for e in EXAMPLES])
@pytest.mark.slow
def test_example_runs(example, runs, workdir, monkeypatch, capsys):
    reason = _skip_reason(example)
    if reason:
        pytest.skip(reason)
    for out, producer in _producers().items():
        if out in shlex.split(example.command, comments=True) and producer.where != example.where:
            if producer.where not in runs:
                pytest.skip(f"needs {out}, made by {producer.where}, which is skipped")
            assert runs[producer.where][0] == 0, f"needs {out}, but {producer.where} failed"
    if example.where in runs:
        code, step = runs[example.where]
    else:
        monkeypatch.chdir(workdir)
        code, step = run(example.command, _data())
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0, f"{example.where}: exit {code} from `{step}`: {err[-1] if err else ''}"


@pytest.mark.slow
def test_python_examples_run(runs, workdir, monkeypatch):
    """Each ```python block of README.md and docs/*.md, as written (``data/`` read from $LIME_PROBE_DATA),
    in document order, in its own namespace, in the folder where the documents' own training examples
    made their runs (``runs/lime`` is README's ``lime-model train --recipe cpu-tiny``); a block may read
    the files another example wrote, never its variables, and overwrites nothing another example wrote."""
    blocks = [(path, block) for path in DOCS for block in fenced_blocks(path, "python")]
    assert len(blocks) >= 3
    data = _data()
    if data is None and any(DATA.search(line) for _, b in blocks for line in b.lines):
        pytest.skip("the examples use data/: set LIME_PROBE_DATA to a folder holding wikitext-2/ and blimp/")
    assert runs and all(code == 0 for code, _ in runs.values()), runs
    monkeypatch.chdir(workdir)
    isolate_registries(monkeypatch)  # docs/extending.md registers an analysis, an adapter, a routing kind
    made = {f: f.read_bytes() for f in (workdir / "runs").rglob("*") if f.is_file()}
    ran = 0
    for path, block in blocks:
        if block.skip:
            continue
        code = with_data("\n".join(block.lines), data)
        # line numbers in a traceback are the document's; this module's `from __future__` is not the block's
        code = compile("\n" * (block.first - 1) + code, str(path), "exec", dont_inherit=True)
        exec(code, {"__name__": "__docs__"})
        ran += 1
    assert ran >= 3
    assert (workdir / "runs" / "lime" / "recipe.json").is_file()  # the README's training run, as it made it
    assert [str(f) for f, old in made.items() if not f.is_file() or f.read_bytes() != old] == []


def test_markers_are_invisible():
    """No document shows a test-only marker: outside HTML comments, no "not run in tests"."""
    for path in DOCS:
        shown = re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S)
        assert "not run in tests" not in shown, (
            f"{_name(path)}: move the marker into <!-- not run in tests: ... -->"
        )


def _table(path: Path, header: str) -> list[list[str]]:
    """The cells of each row of the Markdown table whose header row starts with `header`."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _resolve(dotted: str):
    """The object a dotted name such as ``lime_probe.stream_entropy`` or ``lime_model.evaluate.token_nll``
    names: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_readme_analyses_table_is_the_registry():
    """README's table of analyses has one row per `ANALYSES` entry, in its order: the command, the spec's
    notebook (which exists; "none" for a spec without one), the paper's figures as the spec's help names them,
    and functions that exist and that the analysis's own module calls (an analysis that reads no data may
    name none)."""
    import inspect

    from lime_probe.specs import ANALYSES

    rows = _table(ROOT / "README.md", "| command | function | notebook | paper |")
    assert [r[0] for r in rows] == [f"`lime-probe {name}`" for name in ANALYSES]
    for (_, function, notebook, paper), spec in zip(rows, ANALYSES.values(), strict=True):
        if spec.notebook:
            path = f"analyses/{spec.notebook}.ipynb"
            assert notebook == f"[{path}]({path})" and (ROOT / path).is_file(), spec.name
        else:
            assert notebook == "none", spec.name
        cited = re.search(r"\(paper ([^)]*)\)", spec.help)
        assert paper == (cited[1] if cited else "not in the paper"), spec.name
        source = inspect.getsource(inspect.getmodule(spec.compute))
        names = re.findall(r"`((?:lime_probe|lime_model)(?:\.\w+)+)`", function)
        assert names or spec.data_kind == "none", f"{spec.name}: name its function"
        for name in names:
            assert callable(_resolve(name)), name
            last = name.rsplit(".", 1)[1]
            assert re.search(rf"\b{last}\b", source), f"{spec.name}'s module does not call {name}"


def test_parsing_rules(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "text\n```bash\n# a comment\nlime-probe cache \\\n    --clear   # trailing\n```\n"
        "<!-- not run in tests: needs 8 GPUs -->\n```bash\naccelerate launch x\n```\n"
        "```python\nlime-probe no\n```\n"
    )
    assert doc_examples(readme) == [
        Example("README.md:4", "lime-probe cache --clear   # trailing"),
        Example("README.md:9", "accelerate launch x", "needs 8 GPUs"),
    ]
    assert fenced_blocks(readme, "python") == [Block(12, ["lime-probe no"])]
    assert _steps("lime-model a --out 'r x' && lime-model b  # c") == [
        ["lime-model", "a", "--out", "r x"],
        ["lime-model", "b"],
    ]
    parsers = _parsers()
    shrunk = _shrink(["lime-probe", "separability", "--max-sequences", "9000"], parsers)
    assert shrunk[2:4] == ["--max-sequences", str(WORD_SEQUENCES)] and shrunk[-2:] == ["--threads", "1"]
    shrunk = _shrink(["lime-probe", "entropy"], parsers)
    assert shrunk[2:] == ["--max-sequences", "200", "--threads", "1"]
    assert _shrink(["lime-model", "train", "--out", "r"], parsers)[-3:] == [
        "--steps",
        str(STEPS),
        "--no-progress",
    ]
