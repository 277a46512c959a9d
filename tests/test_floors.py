"""``.ci/floors --pins``: every dependency of pyproject.toml pinned to its own lower bound (read again here
with `packaging`), and a dependency without one refused in one line. The install and test run at the
floors is ``.ci/floors`` itself, outside the suite: it downloads every floor."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason=".ci/floors is a bash script")


def pins(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(root / ".ci" / "floors"), "--pins"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )


def test_each_dependency_is_pinned_to_its_declared_floor():
    out = pins(ROOT)
    assert out.returncode == 0, out.stderr
    got = dict(line.split("==") for line in out.stdout.splitlines())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [Requirement(r) for r in project["dependencies"]]
    assert got == {r.name: next(s.version for s in r.specifier if s.operator == ">=") for r in deps}
    assert {"torch", "transformers", "accelerate", "scikit-learn", "nnsight"} <= set(got)


def test_a_dependency_without_a_floor_is_refused(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy2(ROOT / ".ci" / "floors", tmp_path / ".ci" / "floors")
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["torch>=2.6,<3", "tqdm<5"]\n')
    out = pins(tmp_path)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == ".ci/floors: the dependency 'tqdm<5' declares no single >= floor\n"
