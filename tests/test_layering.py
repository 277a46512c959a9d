"""The package's layers, checked in fresh interpreters through ``sys.modules``: extraction and the probes
import no plotting and no training code; the command line imports nothing heavy before it has parsed its
arguments; Ctrl-C at any moment is one line and exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CORPUS, save_tiny_checkpoint

from lime_probe import cli
from lime_probe.analyses import ANALYSES

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
PROBES = ("extraction", "cache", "entropy", "separability", "blimp", "tsne", "router", "similarity", "stats")
HEAVY = ("torch", "transformers", "matplotlib", "nnsight", "sklearn")


def imported_after(code: str, watched: tuple[str, ...]) -> list[str]:
    """The modules of ``watched`` (or their submodules) that a fresh interpreter holds after ``code``."""
    probe = f"{code}\nimport sys\nprint(sorted({{m for m in sys.modules for w in {watched!r} if m == w or m.startswith(w + '.')}}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_extraction_and_probes_import_no_plotting_and_no_training():
    code = "\n".join(f"import lime_probe.{m}" for m in PROBES)
    assert imported_after(code, ("matplotlib", "seaborn", "lime_model.train", "lime_model.data")) == []


def test_the_registry_imports_nothing_heavy():
    assert imported_after("import lime_probe.analyses", HEAVY) == []


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in [*ANALYSES, "report", "demo"])])
def test_help_imports_nothing_heavy(argv):
    code = f"from lime_probe import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass"
    assert imported_after(code, HEAVY) == []


def test_a_usage_error_imports_nothing_heavy():
    code = "from lime_probe import cli\nassert cli.main(['entropy', '--ckpt', 'x']) == 2  # no --data"
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
        args = sub[name].parse_args(
            ["--ckpt", "x", "--data", "d"] if spec.data_kind == "texts" else ["--ckpt", "x"]
        )
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


@pytest.mark.parametrize("delay", [0.3, 1.5, 6.0])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(slow_run, tmp_path, delay):
    """SIGINT during the imports, the loading and the extraction: one line, exit 130, nothing written."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*slow_run, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [
        x for x in err.replace("\r", "\n").splitlines() if x.strip() and "%|" not in x
    ]  # minus progress bars
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(lines) == 1 and "interrupted" in lines[0], err
    assert not out.exists()
