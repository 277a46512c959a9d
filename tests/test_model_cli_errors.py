"""`lime-model` on bad input and Ctrl-C: one line, exit 2 (or 130), no traceback, nothing written.

The bad-input table runs each command line in-process with model loading replaced by a failure, so a
row passes only if its input is refused *before* a model is loaded. Ctrl-C is sent for real to a
training process, which must then be continued by the same command.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from helpers import save_tiny_checkpoint, train_args

from lime_model import cli
from lime_model import train as T
from lime_model.checks import check_device
from lime_model.files import check_writable
from lime_model.recipes import load_recipe

ROOT = Path(__file__).resolve().parent.parent
UNWRITABLE = "/proc/lime-model-test/out"  # /proc refuses new files, even for root


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A tiny LIMe checkpoint that is also a finished arithmetic run (recipe.json of the task)."""
    path = save_tiny_checkpoint(tmp_path / "ckpt", "lime")
    (path / "recipe.json").write_text(json.dumps(load_recipe("arithmetic").to_dict()))
    return path


def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def lm_eval_or_skip():
    pytest.importorskip("lm_eval", reason="lm-eval (optional) is not installed")


# (id, argv with {ckpt} {corrupt} {tmp} {text} filled in, message fragments, needs lm-eval)
ROWS = [
    ("eval corrupt weights", "eval --ckpt {corrupt} --data {text} --out {tmp}/o",
     ["cannot read the weights file", "model.safetensors", "header"], False),
    ("eval-arithmetic corrupt weights", "eval-arithmetic --ckpt {corrupt}",
     ["cannot read the weights file", "model.safetensors"], False),
    ("eval-downstream corrupt weights", "eval-downstream --ckpt {corrupt} --tasks agreement_demo --out {tmp}/o",
     ["cannot read the weights file", "model.safetensors"], True),
    ("eval unwritable --out", f"eval --ckpt {{ckpt}} --data {{text}} --out {UNWRITABLE}",
     [f"--out {UNWRITABLE}", "cannot write in /proc"], False),
    ("eval --out is a file", "eval --ckpt {ckpt} --data {text} --out {text}",
     ["--out ", "is not a folder"], False),
    ("eval-downstream unwritable --out", f"eval-downstream --ckpt {{ckpt}} --tasks agreement_demo --out {UNWRITABLE}",
     [f"--out {UNWRITABLE}", "cannot write in /proc"], True),
    ("train unwritable --out", "train --recipe cpu-tiny --data {text} --out /proc/lime-model-test/run",
     ["--out /proc/lime-model-test/run", "cannot write in /proc"], False),
    ("eval --device gpu0", "eval --ckpt {ckpt} --data {text} --device gpu0 --out {tmp}/o",
     ["--device 'gpu0' is not a torch device", "cpu, cuda"], False),
    ("eval --device cuda:99", "eval --ckpt {ckpt} --data {text} --device cuda:99",
     ["--device cuda:99"], False),
    ("eval-arithmetic --device gpu0", "eval-arithmetic --ckpt {ckpt} --device gpu0", ["--device 'gpu0'"], False),
    ("eval-downstream --device cuda:99", "eval-downstream --ckpt {ckpt} --tasks agreement_demo --device cuda:99",
     ["--device cuda:99"], True),
    ("unknown recipe", "train --recipe no-such-recipe --out {tmp}/o/run", ["recipe not found: no-such-recipe"], False),
    ("bad --set key", "train --recipe cpu-tiny --data {text} --out {tmp}/o/run --set bogus=1",
     ["unknown recipe key(s): bogus"], False),
    ("bad --set value", "train --recipe cpu-tiny --data {text} --out {tmp}/o/run --set lr=fast",
     ["'lr' must be float"], False),
    ("--set without =", "train --recipe cpu-tiny --data {text} --out {tmp}/o/run --set lr",
     ["--set expects key=value"], False),
    ("eval missing checkpoint", "eval --ckpt {tmp}/nope --data {text}", ["nope is not a model directory"], False),
    ("eval-arithmetic missing checkpoint", "eval-arithmetic --ckpt {tmp}/nope", ["not a finished lime-model run"], False),
    ("eval-downstream missing checkpoint", "eval-downstream --ckpt {tmp}/nope --tasks agreement_demo",
     ["nope is not a model directory"], True),
    ("usage error", "eval --ckpt {ckpt}", ["the following arguments are required: --data", "--help"], False),
    ("abbreviated option", "eval --ckpt {ckpt} --data {text} --windo 8", ["unrecognized arguments: --windo 8"], False),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needles", "lm_eval"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_and_exit_2(argv, needles, lm_eval, tmp_path, text, ckpt, monkeypatch, capsys):
    if lm_eval:
        lm_eval_or_skip()
    if "{corrupt}" in argv:
        (ckpt / "model.safetensors").write_bytes(b"\x07garbage")
    no_loading(monkeypatch)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if "cache" not in p.parts}
    args = argv.format(ckpt=ckpt, corrupt=ckpt, tmp=tmp_path, text=text).split()
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if "cache" not in p.parts}
    assert after == before  # nothing written, nothing left behind (no output, no folder, no temp file)


def test_a_plain_cuda_device_without_cuda_is_refused(ckpt, text, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    no_loading(monkeypatch)
    assert cli.main(["eval", "--ckpt", str(ckpt), "--data", str(text), "--device", "cuda"]) == 2
    assert "--device cuda: this machine has no CUDA device (use --device cpu)" in capsys.readouterr().err


def test_check_device_and_check_writable_directly(tmp_path):
    assert check_device("cpu") == torch.device("cpu")
    for bad in ("gpu0", "cuda:x", ""):
        with pytest.raises(ValueError, match="is not a torch device"):
            check_device(bad)
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        check_writable(tmp_path / "f" / "sub" / "out.json")
    with pytest.raises(IsADirectoryError):
        check_writable(tmp_path)
    with pytest.raises(PermissionError, match="cannot write in /proc"):
        check_writable("/proc/x/run", folder=True)
    check_writable(tmp_path / "new" / "deeper" / "out.json")  # missing folders are creatable
    check_writable(tmp_path / "f")  # an existing file is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the checks leave nothing behind


def test_an_unexpected_failure_is_one_line_and_exit_1(ckpt, text, monkeypatch, capsys):
    from lime_model import evaluate

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(evaluate, "token_nll", broken)
    assert cli.main(["eval", "--ckpt", str(ckpt), "--data", str(text)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert err == "lime-model eval: failed: RuntimeError: boom (rerun with --debug for the traceback)"
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["eval", "--ckpt", str(ckpt), "--data", str(text), "--debug"])


# --------------------------------------------------------------------------- Ctrl-C


def test_interrupted_evaluations_print_one_line_exit_130_and_write_nothing(
    ckpt, text, tmp_path, monkeypatch, capsys
):
    from lime_model import evaluate
    from lime_model.tasks import arithmetic

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "token_nll", interrupt)
    monkeypatch.setattr(arithmetic, "evaluate", interrupt)
    out = tmp_path / "ppl"
    assert cli.main(["eval", "--ckpt", str(ckpt), "--data", str(text), "--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "lime-model eval: interrupted; nothing was written"
    assert cli.main(["eval-arithmetic", "--ckpt", str(ckpt), "--no-progress"]) == 130
    assert (
        capsys.readouterr().err.splitlines()[-1]
        == "lime-model eval-arithmetic: interrupted; nothing was written"
    )
    assert not out.exists() and not (ckpt / "arithmetic_eval.json").exists()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main ignores a second Ctrl-C after the first


def test_training_interrupted_before_its_first_checkpoint_restarts_with_the_same_command(
    tmp_path, text, monkeypatch, capsys
):
    out = tmp_path / "run"
    argv = train_args(out, text, steps=3)
    real_step = T.train_step

    def interrupted_step(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "train_step", interrupted_step)
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"lime-model train: interrupted; run the same command again to continue the run in {out}"
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert (out / "recipe.json").is_file() and not T.checkpoints(out)  # what the interruption left
    monkeypatch.setattr(T, "train_step", real_step)
    assert cli.main(argv) == 0
    assert "from the start (no checkpoint yet)" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert len(json.loads((out / "run_info.json").read_text())) == 2  # one entry per start


@pytest.mark.slow
def test_ctrl_c_during_training_exits_130_and_the_same_command_continues(tmp_path, text):
    """A real SIGINT to a training process once it has logged three steps (a checkpoint every two)."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "lime_model.cli", *train_args(out, text, "--set", "save_every=2", "--threads",
            "1", steps=150)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"lime-model train: interrupted; run the same command again to continue the run in {out}"
    )
    assert T.checkpoints(out) and not (out / "model.safetensors").exists()
    again = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "lime-model: continuing the run in" in again.stderr and "Traceback" not in again.stderr
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, 151))  # lines logged after the checkpoint were dropped, then relogged
    assert (out / "model.safetensors").is_file()


# --------------------------------------------------------------------------- --help


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_help_is_light_and_lists_examples(command):
    """``lime-model [COMMAND] --help`` as the program runs it imports neither torch nor transformers."""
    argv = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "lime_model.cli",
        *([command] if command else []),
        "--help",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    imported = {
        line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    assert not {m.split(".")[0] for m in imported} & {"torch", "transformers", "numpy", "lm_eval"}
    if command is None:
        assert "lime-model COMMAND --help" in done.stdout
    else:
        assert "examples:\n  " in done.stdout and f"lime-model {command}" in done.stdout
