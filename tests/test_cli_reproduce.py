"""`lime-probe reproduce`: its output folders are checked before anything is trained."""

from __future__ import annotations

from helpers import run_cli


def test_reproduce_checks_its_output_folders_before_training(capsys, tmp_path):
    (tmp_path / "a-file").write_text("x")
    argv = ["reproduce", "--study", "arithmetic-seeds", "--out", tmp_path / "runs"]
    code, _, err = run_cli(capsys, *argv, "--results", tmp_path / "a-file" / "results")
    assert code == 2 and err.count("\n") == 1 and "--results" in err and "not a folder" in err, err
    assert not (tmp_path / "runs").exists()  # nothing created, nothing trained
