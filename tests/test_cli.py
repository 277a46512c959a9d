"""`lime-probe` end to end through its entry point: results equal the library's, bad input exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lime_probe import cli

COMMANDS = ["entropy", "report"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_an_example(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert "example:" in out and f"lime-probe {command} " in out.split("example:")[1]


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2 and "COMMAND" in err


def test_label_count_must_match(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello there\n")
    code, _, err = run_cli(capsys, "entropy", "--ckpt", "a", "--ckpt", "b", "--label", "x", "--data", text,
                           "--out", tmp_path / "out")
    assert code == 2
    assert err.strip() == "lime-probe entropy: error: got 1 --label for 2 --ckpt; give one label per checkpoint or none"
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_rejected(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    code, _, err = run_cli(capsys, "entropy", "--ckpt", "a", "--data", "x", "--out", tmp_path / "f")
    assert code == 2 and "exists and is not a directory" in err


def test_unwritable_out_is_rejected(capsys, tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; /proc refuses new entries even to root
        out = Path("/proc/lime-probe-out")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        out = locked / "out"
    try:
        code, _, err = run_cli(capsys, "entropy", "--ckpt", "a", "--data", "x", "--out", out)
    finally:
        if os.geteuid() != 0:
            locked.chmod(0o700)
    assert code == 2 and "is not writable" in err and err.count("\n") == 1
    assert not out.exists()


def test_staged_output_moves_files_only_on_success(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with cli.staged_output(out) as tmp:
        (tmp / "new.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.png").write_text("png")
        assert not (out / "new.json").exists()  # nothing appears before the end
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["keep.txt", "new.json", "sub", "sub/a.png"]
    with pytest.raises(KeyboardInterrupt), cli.staged_output(out) as tmp:
        (tmp / "half.json").write_text("{")
        raise KeyboardInterrupt
    assert not (out / "half.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left behind


def test_format_table_aligns_columns():
    text = cli.format_table([{"model": "LIMe", "layer": 0, "v": 1.234567}, {"model": "LLaMA", "layer": 10, "v": None}])
    lines = text.splitlines()
    assert lines[0].split() == ["model", "layer", "v"]
    assert lines[2].split() == ["LIMe", "0", "1.235"] and lines[3].split() == ["LLaMA", "10"]
    assert len({len(line) for line in lines}) == 1
