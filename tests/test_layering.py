"""The package's layers, checked in fresh interpreters through ``sys.modules``: extraction and the probes
import no plotting and no training code; the command line imports nothing heavy before it has parsed its
arguments; Ctrl-C at any moment is one line and exit 130."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CORPUS, save_tiny_checkpoint

from lime_probe import cli
from lime_probe.specs import ANALYSES

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
HEAVY = ("torch", "transformers", "matplotlib", "nnsight", "sklearn")
# The program as its console script starts it (argv[0] .../bin/lime-probe): `import lime_model`, which the
# command line makes for its shared checks, then leaves the model types to be registered after parsing.
AS_PROGRAM = "import sys\nsys.argv[0] = 'lime-probe'\nfrom lime_probe import cli\n"


def imported_after(code: str, watched: tuple[str, ...]) -> list[str]:
    """The modules of ``watched`` (or their submodules) that a fresh interpreter holds after ``code``."""
    probe = f"{code}\nimport sys\nprint(sorted({{m for m in sys.modules for w in {watched!r} if m == w or m.startswith(w + '.')}}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600
    )
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_extraction_and_probes_import_no_plotting_and_no_training():
    code = "\n".join(f"import {m}" for m in modules_of(("extraction", "probes")))
    assert imported_after(code, ("matplotlib", "seaborn", "lime_model.train", "lime_model.data")) == []


# The package's layers, bottom to top: a module may import its own layer and those below, never above.
# protocol.py is data every layer reads; cli.py, cli_options.py, notebook.py and __init__.py sit on top of everything.
LAYERS = (
    "protocol",
    "extraction",
    "probes",
    "interventions",
    "output",
    "specs",
    "studies",
    "cli cli_options notebook __init__",
)
PACKAGE = ROOT / "lime_probe"


def layer_of(module: str) -> int:
    first = module.removeprefix("lime_probe.").split(".")[0] if module != "lime_probe" else "__init__"
    return next(i for i, names in enumerate(LAYERS) if first in names.split())


def modules_of(packages: tuple[str, ...]) -> list[str]:
    return [
        "lime_probe." + ".".join(f.relative_to(PACKAGE).with_suffix("").parts)
        for pkg in packages
        for f in sorted((PACKAGE / pkg).rglob("*.py"))
        if f.name != "__init__.py"
    ]


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module of ``package`` (lime_probe unless given) that ``path`` imports, at module level or
    inside a function."""
    top = package.name
    module = top + "." + ".".join(path.relative_to(package).with_suffix("").parts)
    parent = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parent = parent.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    parent.split(".")[: len(parent.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found |= {
                f"{base}.{a.name}"
                if (package / Path(*f"{base}.{a.name}".split(".")[1:])).with_suffix(".py").exists()
                or (package / Path(*f"{base}.{a.name}".split(".")[1:])).is_dir()
                else base
                for a in node.names
            }
    return {m for m in found if m == top or m.startswith(top + ".")}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    graph = {}
    for f in package.rglob("*.py"):
        name = (package.name + "." + ".".join(f.relative_to(package).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        graph[name] = imports_of(f, package) - {name}
    return graph


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{m} ({LAYERS[layer_of(m)]}) imports {i} ({LAYERS[layer_of(i)]})"
        for m, deps in import_graph().items()
        for i in deps
        if i != "lime_probe" and layer_of(i) > layer_of(m)
    ]
    assert upward == []


# The command line's modules; below them the settings are dataclasses and nothing knows of argparse.
COMMAND_LINE = {
    "lime_probe/cli.py",
    "lime_probe/cli_options.py",
    "lime_model/cli.py",
    "lime_model/command_line.py",
}


def test_only_the_command_line_imports_argparse():
    importers = {
        str(f.relative_to(ROOT))
        for package in ("lime_probe", "lime_model")
        for f in (ROOT / package).rglob("*.py")
        if any(
            (isinstance(n, ast.Import) and any(a.name == "argparse" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and n.module == "argparse")
            for n in ast.walk(ast.parse(f.read_text()))
        )
    }
    assert importers - COMMAND_LINE == set() and importers, importers


@pytest.mark.parametrize("package", ["lime_probe", "lime_model"])
def test_the_import_graph_has_no_cycles(package):
    """Module by module, lazy (in-function) and type-checking imports included; a package's __init__
    counts as a module."""
    graph = import_graph(ROOT / package)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            if dep == package:
                continue
            if state.get(dep) == 1:
                return [*path, m, dep]
            if dep not in state and (cycle := visit(dep, [*path, m])):
                return cycle
        state[m] = 2
        return None

    cycles = [c for m in sorted(graph) if m not in state and (c := visit(m, []))]
    assert cycles == []


def test_lime_model_never_imports_lime_probe():
    model = ROOT / "lime_model"
    hits = [
        str(f.relative_to(ROOT))
        for f in model.rglob("*.py")
        if re.search(r"^\s*(from|import) lime_probe", f.read_text(), re.M)
    ]
    assert hits == []


def test_a_module_name_repeats_only_as_a_probe_and_the_analysis_that_runs_it():
    """``probes/entropy.py`` computes, ``specs/entropy.py`` declares the ``entropy`` command; no other
    name appears twice in the package."""
    by_name: dict[str, list[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        if f.name != "__init__.py":
            by_name.setdefault(f.name, []).append(f.parent.name)
    repeated = {n: sorted(dirs) for n, dirs in by_name.items() if len(dirs) > 1}
    assert all(dirs == ["probes", "specs"] for dirs in repeated.values()), repeated


def test_the_registry_imports_nothing_heavy():
    assert imported_after("import lime_probe.specs", HEAVY) == []


@pytest.mark.slow
def test_computing_an_analysis_draws_nothing(tmp_path):
    """``compute`` returns numbers only: running analyses on a checkpoint never imports matplotlib."""
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    code = (
        "from lime_probe.specs import ANALYSES, Extraction, load_checkpoints\n"
        f"cks = load_checkpoints([{str(ckpt)!r}], None, 'cpu')\n"
        f"texts = {CORPUS * 3!r}\n"
        "kw = Extraction(max_length=32)\n"
        "assert ANALYSES['entropy'].run(cks, texts, kw, unit='documents').rows\n"
        "assert ANALYSES['separability'].run(cks, texts, kw, allow_small_samples=True).rows\n"
        "for name in ('cka', 'router'):\n"
        "    assert ANALYSES[name].run(cks, texts, kw).rows"
    )
    assert imported_after(code, ("matplotlib", "seaborn")) == []


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in cli.COMMANDS)])
def test_help_imports_nothing_heavy(argv):
    code = f"{AS_PROGRAM}try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass"
    assert imported_after(code, HEAVY) == []


def test_a_usage_error_imports_nothing_heavy():
    code = AS_PROGRAM + "assert cli.main(['entropy', '--ckpt', 'x']) == 2  # no --data"
    assert imported_after(code, HEAVY) == []


def test_bad_parameters_fail_before_anything_heavy_is_imported():
    code = (
        AS_PROGRAM
        + "assert cli.main(['separability', '--ckpt', 'x', '--data', 'y', '--words', ' is']) == 2\n"
        "assert cli.main(['report', '--ckpt', 'x', '--data', 'y', '--words', ' is', ' is']) == 2"
    )
    assert imported_after(code, HEAVY) == []


def test_abbreviated_options_are_rejected(capsys, tmp_path):
    code = cli.main(["entropy", "--ckp", "x", "--data", "t.txt", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "--ckp" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["report", "--ckpt", "x", "--data", "t.txt", "--analys", "cka"]) == 2
    assert "--analys" in capsys.readouterr().err


def test_every_parameter_field_is_an_option():
    """Options are generated from the parameter dataclasses, so a field and its option cannot drift."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    for name, spec in ANALYSES.items():
        dests = {a.dest for a in sub[name]._actions}
        fields = set(spec.params.__dataclass_fields__)
        assert fields <= dests, name
        kind = cli.DATA_KINDS[spec.data_kind]
        required = [kind.flag, "d"] if (kind.option or {}).get("required") else []
        args = sub[name].parse_args(["--ckpt", "x", *required])
        assert cli.params_of(spec, args) == spec.params()  # option defaults are the dataclass defaults


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory) -> list[str]:
    """An entropy command on a tiny checkpoint and enough text to run for several seconds."""
    root = tmp_path_factory.mktemp("sigint")
    ckpt = save_tiny_checkpoint(root / "llama", "llama")
    data = root / "texts.txt"
    data.write_text("\n\n".join(CORPUS * 2000) + "\n")
    args = ["entropy", "--ckpt", str(ckpt), "--data", str(data), "--max-sequences", "12000", "--no-cache"]
    return [sys.executable, "-m", "lime_probe.cli", *args, "--batch-size", "4"]


# Where to press Ctrl-C, found on stderr: -X importtime reports each module as it finishes importing.
MOMENTS = {
    "our imports": "lime_probe.specs.base",  # the registry, before main() runs
    "torch's import": "torch._utils",  # a heavy import inside the command
    "extraction": "extract:",  # the progress bar of the forward passes
}


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.slow
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(slow_run, tmp_path, moment):
    """SIGINT during our imports, a heavy import and the extraction: one line, exit 130, nothing written."""
    out = tmp_path / "out"
    cmd = [slow_run[0], "-X", "importtime", *slow_run[1:], "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    err = b""
    while MOMENTS[moment].encode() not in err:
        chunk = os.read(proc.stderr.fileno(), 1 << 16)
        assert chunk, f"exited before {moment}: {err.decode()[-2000:]}"
        err += chunk
    proc.send_signal(signal.SIGINT)
    err = (err + proc.communicate(timeout=120)[1]).decode()
    own = [x for x in err.replace("\r", "\n").splitlines() if not x.startswith("import time:")]
    said = [x for x in own if "interrupted" in x]
    assert proc.returncode == 130, "\n".join(own[-30:])
    assert "Traceback" not in "\n".join(own) and len(said) == 1, own  # one message (after a progress bar)
    assert re.search(r"lime-probe( entropy)?: interrupted", said[0]), said
    assert not out.exists()


def test_the_program_imports_no_numpy_before_it_runs():
    """The reproducible mode pins openBLAS before NumPy loads, so importing the command line (and parsing
    --help) must not load NumPy: a module-level import of a NumPy user anywhere under cli.py breaks the mode."""
    code = f"{AS_PROGRAM}try:\n    cli.main(['demo', '--help'])\nexcept SystemExit:\n    pass"
    assert imported_after(code, ("numpy",)) == []
