"""`lime-probe`'s contract common to every command, through its entry point: help with examples, usage
errors, the output folder staged and published whole with normal permissions, bad input in one line with
exit 2 before any output, a bug exit 1, Ctrl-C exit 130 with a usable cache. Each command's own results
are tested in tests/test_cli_<command>.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as tf
from helpers import digits_checkpoint, read_json, run_cli

from lime_probe import cli
from lime_probe.output.console import format_table
from lime_probe.output.staging import staged_output


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_help_shows_an_example(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert "examples:" in out and f"lime-probe {command}" in out.split("examples:")[1]


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2 and "COMMAND" in err


def test_label_count_must_match(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello there\n")
    code, _, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        "a",
        "--ckpt",
        "b",
        "--label",
        "x",
        "--data",
        text,
        "--out",
        tmp_path / "out",
    )
    assert code == 2
    assert (
        err.strip()
        == "lime-probe entropy: error: got 1 --label for 2 --ckpt; give one label per checkpoint or none"
    )
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_rejected(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    code, _, err = run_cli(capsys, "entropy", "--ckpt", "a", "--data", "x", "--out", tmp_path / "f")
    assert code == 2 and f"--out {tmp_path / 'f'}: {tmp_path / 'f'} is not a folder" in err


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
    assert code == 2 and f"--out {out}: cannot write in" in err and err.count("\n") == 1
    assert not out.exists()


def test_staged_output_moves_files_only_on_success(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with staged_output(out) as tmp:
        (tmp / "new.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.png").write_text("png")
        assert not (out / "new.json").exists()  # nothing appears before the end
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "keep.txt",
        "new.json",
        "sub",
        "sub/a.png",
    ]
    with pytest.raises(KeyboardInterrupt), staged_output(out) as tmp:
        (tmp / "half.json").write_text("{")
        raise KeyboardInterrupt
    assert not (out / "half.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left behind


def test_staged_output_creates_missing_parents_and_removes_them_on_failure(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with staged_output(out) as tmp:
        (tmp / "r.json").write_text("{}")
    assert (out / "r.json").read_text() == "{}"
    failed = tmp_path / "x" / "y" / "out"
    with pytest.raises(ValueError), staged_output(failed) as tmp:
        raise ValueError("bad input")
    assert not (tmp_path / "x").exists()  # nothing half-made is left behind


def test_format_table_aligns_columns():
    text = format_table(
        [{"model": "LIMe", "layer": 0, "v": 1.234567}, {"model": "LLaMA", "layer": 10, "v": None}]
    )
    lines = text.splitlines()
    assert lines[0].split() == ["model", "layer", "v"]
    assert lines[2].split() == ["LIMe", "0", "1.235"] and lines[3].split() == ["LLaMA", "10"]
    assert len({len(line) for line in lines}) == 1


def _corrupt_copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return dst


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "checkpoint not found"),
        ("not_ckpt", "not a checkpoint"),
        ("corrupt", "cannot read the weights file {tmp_path}/corrupt/model.safetensors"),
        ("no_tokenizer", "has no tokenizer"),
        ("empty_data", "no text"),
        ("missing_data", "data not found"),
        ("non_utf8", "latin1.txt is not UTF-8 text"),
        ("unknown_tokens", "the data does not fit the tokenizer"),
        ("device_name", "--device 'gpu0' is not a torch device"),
        ("device_absent", "--device cuda: this machine has no CUDA device"),
        ("cache_unwritable", "--cache"),
        (
            "hf_unreachable",
            "--data hf:wikitext:wikitext-2-raw-v1 not found locally and the hub is unreachable",
        ),
        ("hf_offline", "--data hf:wikitext:wikitext-2-raw-v1 not found locally and the hub is unreachable"),
        ("blimp_unreachable", "BLiMP data (nyu-mll/blimp) not found locally and the hub is unreachable"),
        ("blimp_non_utf8", "latin1.jsonl: not UTF-8 text"),
        ("one_word", "--words needs at least two distinct words"),
        ("repeated_word", "--words repeats ' is'"),
        ("small_sample", "per word in each of the 5 test folds (fewer than 10)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, ckpts, text_file, monkeypatch, case, match):
    ckpt, data, command, extra = ckpts["llama"], text_file, "entropy", []
    if case == "missing":
        ckpt = tmp_path / "nope"
    elif case == "not_ckpt":
        ckpt = tmp_path / "plain"
        ckpt.mkdir()
    elif case == "corrupt":
        ckpt = _corrupt_copy(ckpts["llama"], tmp_path / "corrupt")
    elif case == "no_tokenizer":  # a model saved alone, as save_pretrained(DIR) leaves it
        ckpt = tmp_path / "weights-only"
        tf.AutoModelForCausalLM.from_pretrained(ckpts["llama"]).save_pretrained(ckpt)
    elif case == "empty_data":
        data = tmp_path / "empty.txt"
        data.write_text("\n\n  \n")
    elif case == "missing_data":
        data = tmp_path / "nothing.txt"
    elif case == "non_utf8":  # named even inside a folder
        data = tmp_path / "folder"
        data.mkdir()
        (data / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    elif case == "unknown_tokens":
        ckpt = digits_checkpoint(tmp_path / "digits")
        extra = ["--num-windows", 2]
    elif case == "device_name":
        extra = ["--device", "gpu0"]
    elif case == "device_absent":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
        extra = ["--device", "cuda"]
    elif case == "cache_unwritable":  # under a file: no folder can be made there
        (tmp_path / "a-file").write_text("x")
        extra = ["--cache", tmp_path / "a-file" / "cache"]
    elif case == "hf_unreachable":  # nothing listens there: the one request fails at once
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
        data = "hf:wikitext:wikitext-2-raw-v1"
    elif case == "hf_offline":  # HF_HUB_OFFLINE: datasets reads its cache, which lacks the dataset
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
        monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
        monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
        data = "hf:wikitext:wikitext-2-raw-v1"
    elif case == "blimp_unreachable":  # blimp without --data reads the hub
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
        command, data = "blimp", None
    elif case == "blimp_non_utf8":
        command, data, extra = "blimp", tmp_path / "blimp", ["--tasks", "all"]
        data.mkdir()
        (data / "latin1.jsonl").write_bytes('{"sentence_good": "caf\u00e9"}\n'.encode("latin-1"))
    elif case in ("one_word", "repeated_word"):  # refused before any data or model is read
        monkeypatch.setattr("lime_probe.cli.load_checkpoints", lambda *a, **k: pytest.fail("loaded"))
        monkeypatch.setattr("lime_probe.cli.load_data", lambda *a, **k: pytest.fail("read"))
        command, extra = "separability", ["--words", " is", *([" is"] if case == "repeated_word" else [])]
    elif case == "small_sample":  # 6 occurrences of each word: 1.2 per word per test fold
        command = "separability"
    out = tmp_path / "out"
    argv = [command, "--ckpt", ckpt, *(["--data", data] if data is not None else []), "--out", out, *extra]
    if "--cache" not in extra:
        argv.append("--no-cache")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("lime-probe")]
    match = match.format(tmp_path=tmp_path)
    assert len(lines) == 1 and lines[0].startswith(f"lime-probe {command}: error: ") and match in lines[0], (
        err
    )
    assert "Traceback" not in err
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_a_missing_relative_path_fails_fast_naming_both_readings(capsys, tmp_path, text_file, monkeypatch):
    import time

    monkeypatch.chdir(tmp_path)  # "runs/nope" reads as a hub id too, and the hub cannot be reached here
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    code, _, err = run_cli(
        capsys, "entropy", "--ckpt", "runs/nope", "--data", text_file, "--out", "o", "--no-cache"
    )
    took = time.monotonic() - start
    assert code == 2
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "lime-probe entropy: error: checkpoint not found: runs/nope (no such local folder, and no hub model "
        )
    )
    assert "Retry" not in err and "Traceback" not in err
    assert took < 10, f"took {took:.1f} s: the hub was retried"
    assert not (tmp_path / "o").exists()


def test_a_bug_raising_keyerror_is_exit_1_not_bad_input(capsys, tmp_path, monkeypatch):
    def buggy(*args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "analyse", buggy)
    monkeypatch.setattr(cli, "load_checkpoints", lambda *a, **kw: [])
    (tmp_path / "t.txt").write_text("hello there\n")
    code, _, err = run_cli(
        capsys, "cka", "--ckpt", "x", "--data", tmp_path / "t.txt", "--out", tmp_path / "o"
    )
    assert code == 1 and "failed: KeyError: internal" in err


def test_published_files_and_folder_have_normal_permissions(capsys, tmp_path, ckpts):
    from lime_model.files import umask

    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "router", "--ckpt", ckpts["lime"], "--out", out)
    assert code == 0, err
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask()
    files = sorted(out.iterdir())
    assert {f.suffix for f in files} == {".json", ".csv", ".png", ".pdf"}
    assert {f.name: f.stat().st_mode & 0o777 for f in files} == {f.name: 0o666 & ~umask() for f in files}


@pytest.mark.slow
def test_installed_script_reports_bad_input(tmp_path, text_file):
    script = Path(sys.executable).with_name("lime-probe")
    if not script.exists():
        pytest.skip("lime-probe is not installed in this environment (pip install -e .)")
    proc = subprocess.run(
        [
            str(script),
            "entropy",
            "--ckpt",
            str(tmp_path / "nope"),
            "--data",
            str(text_file),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"lime-probe entropy: error: checkpoint not found: {tmp_path / 'nope'}"
    )


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "placed-by-a-thread"])
def test_ctrl_c_leaves_no_output_and_a_usable_cache(
    capsys, tmp_path, ckpts, text_file, monkeypatch, threaded
):
    import importlib

    extract_mod = importlib.import_module("lime_probe.extraction.tracing")
    monkeypatch.setattr(extract_mod, "places_in_a_thread", lambda device: threaded)  # a GPU's worker thread

    monkeypatch.setattr(extract_mod, "SHARD_BYTES", 1)  # a cache shard after every batch
    real_forward, calls = extract_mod.trace_batch, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_forward(*a, **k)

    argv = [
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--batch-size",
        4,
        "--max-length",
        16,
        "--unit",
        "documents",  # 18 texts, several batches
        "--cache",
        tmp_path / "cache",
    ]
    monkeypatch.setattr(extract_mod, "trace_batch", interrupted)
    code, _, err = run_cli(capsys, *argv, "--out", tmp_path / "out")
    assert code == 130 and "interrupted" in err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["cache"]
    calls.clear()
    monkeypatch.setattr(extract_mod, "trace_batch", lambda *a, **k: calls.append(1) or real_forward(*a, **k))
    assert run_cli(capsys, *argv, "--out", tmp_path / "out")[0] == 0
    assert len(calls) == 5 - 2  # 18 texts in batches of 4: the 2 batches cached before Ctrl-C are reused
    assert run_cli(capsys, *argv[:-2], "--no-cache", "--out", tmp_path / "fresh")[0] == 0
    resumed = read_json(tmp_path / "out" / "entropy_values.json")["rows"]
    assert resumed == read_json(tmp_path / "fresh" / "entropy_values.json")["rows"]
