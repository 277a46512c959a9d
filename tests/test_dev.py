"""``./dev``: runs the commands without an activated .venv, from the caller's folder, and hands the shared
data and the paper's text beside the checkout to the tests unless they are set already.

Run on a copy of ``dev`` in a temporary tree with a stand-in .venv (its install stamp present, its
``bin/lime-probe`` a script printing what it was given), so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="./dev is a bash script")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """tmp/checkout/{dev, pyproject.toml, constraints.txt, .venv (stand-in)} and tmp/shared/{data, paper}."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("dev", "pyproject.toml", "constraints.txt"):
        shutil.copy2(ROOT / name, checkout / name)
    stamp = subprocess.run(
        "cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1",
        shell=True,
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    bin_dir = checkout / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (checkout / ".venv" / f".installed-{stamp}").touch()
    for command in ("lime-probe", "lime-model"):
        script = bin_dir / command
        script.write_text(
            '#!/usr/bin/env bash\necho "$(basename "$0")|$*|$PWD|${LIME_PROBE_DATA:-}|${LIME_PROBE_PAPER:-}"\n'
        )
        script.chmod(0o755)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "paper").mkdir()
    (tmp_path / "shared" / "paper" / "lime-paper.txt").write_text("the paper\n")
    return checkout


def _dev(tree: Path, *args: str, cwd: Path, **env: str) -> list[str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LIME_PROBE_DATA", "LIME_PROBE_PAPER", "LIME_VENV")
    }
    out = subprocess.run(
        [str(tree / "dev"), *args], cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split("|")


def test_dev_runs_either_command_from_the_callers_folder(tree, tmp_path):
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    name, args, cwd, *_ = _dev(tree, "lime-probe", "entropy", "--ckpt", "runs/x", cwd=elsewhere)
    assert (name, args, cwd) == ("lime-probe", "entropy --ckpt runs/x", str(elsewhere))
    assert _dev(tree, "lime-model", "--help", cwd=tree)[:2] == ["lime-model", "--help"]


def test_dev_passes_the_shared_data_and_paper_beside_the_checkout(tree, tmp_path):
    *_, data, paper = _dev(tree, "lime-probe", cwd=tree)
    assert data == str((tmp_path / "shared" / "data").resolve())
    assert paper == str((tmp_path / "shared" / "paper" / "lime-paper.txt").resolve())


def test_dev_keeps_settings_the_user_made(tree, tmp_path):
    *_, data, paper = _dev(tree, "lime-probe", cwd=tree, LIME_PROBE_DATA="/mine", LIME_PROBE_PAPER="/p.txt")
    assert (data, paper) == ("/mine", "/p.txt")
    shutil.rmtree(tmp_path / "shared")
    *_, data, paper = _dev(tree, "lime-probe", cwd=tree)
    assert (data, paper) == ("", "")  # nothing beside the checkout: nothing set, the data tests skip


def test_dev_rejects_an_unknown_command(tree):
    out = subprocess.run([str(tree / "dev"), "frobnicate"], cwd=tree, capture_output=True, text=True)
    assert out.returncode == 2 and "usage: ./dev" in out.stderr
