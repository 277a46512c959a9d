"""`lime-model` CLI: a run end to end, and every kind of bad input as one line + exit 2, nothing written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import train_args

from lime_model.cli import main
from lime_model.tasks.arithmetic import CHARS
from lime_model.tokenization import char_tokenizer


def test_train_and_resume_through_the_cli(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert main(train_args(out, text, "--routing", "last-2", "--stop-after", "1")) == 0
    assert main(train_args(out, text, "--routing", "last-2", "--resume")) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert json.loads((out / "config.json").read_text())["routing"] == "last-2"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)


def one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lime-model: error: "), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--set", "bogus=1"], "unknown recipe key(s): bogus"),
        (["--set", "model.hidden_sise=8"], "unknown recipe key(s): model.hidden_sise"),
        (["--routing", "sideways"], "routing"),
        (["--set", "lr=fast"], "'lr' must be float"),
        (["--set", "batch_size=3"], "not a multiple"),
        (["--set", "model.num_attention_heads=5"], "divisible"),
    ],
)
def test_bad_recipe_values(tmp_path, text, capsys, extra, needle):
    out = tmp_path / "run"
    one_line_error(capsys, train_args(out, text, *extra), needle)
    assert not out.exists()


def test_bad_data_and_tokenizer(tmp_path, text, capsys):
    out = tmp_path / "run"
    one_line_error(capsys, train_args(out, tmp_path / "missing.txt"), "data not found")
    (tmp_path / "empty.txt").write_text("\n \n\n")
    one_line_error(capsys, train_args(out, tmp_path / "empty.txt"), "no text in")
    one_line_error(capsys, train_args(out, text, "--set", "seq_len=100000"), "fewer tokens than one sequence")
    char_tokenizer(CHARS).save_pretrained(tmp_path / "tok")  # 22 tokens
    one_line_error(
        capsys, train_args(out, text, "--set", f"tokenizer={tmp_path / 'tok'}", "--set", "model.vocab_size=16"),
        "22 tokens", "vocab_size is 16",
    )  # fmt: skip
    one_line_error(capsys, train_args(out, text, "--set", f"tokenizer={tmp_path / 'nope'}"), "tokenizer")
    one_line_error(capsys, ["train", "--recipe", "no-such-recipe", "--out", str(out)], "recipe not found")
    assert not out.exists()


def test_resume_guards(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert main(train_args(out, text)) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    one_line_error(capsys, train_args(out, text, "--set", "lr=0.5", "--resume"), "another config", "lr")
    one_line_error(
        capsys, train_args(out, text, "--routing", "none", "--resume"), "another config", "routing"
    )
    one_line_error(capsys, train_args(out, text), "already holds this recipe's finished run", "new --out")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    one_line_error(capsys, train_args(tmp_path / "other", text), "not empty", "no lime-model run")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing touched
    one_line_error(capsys, train_args(tmp_path / "fresh", text, "--resume"), "nothing to resume")
    assert not (tmp_path / "fresh").exists()
    # a finished run cannot be extended: the length is part of the schedule, said in one line
    one_line_error(
        capsys, train_args(out, text, "--resume", "--steps", "4"), "steps 2 -> 4", "cannot be extended", "new --out"
    )  # fmt: skip
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_resume_help_says_the_length_cannot_change(capsys):
    assert main(["train", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--steps included" in help_text and "a finished run cannot be extended" in help_text


def test_out_under_a_file_is_a_one_line_error(tmp_path, text, capsys):
    (tmp_path / "a_file").write_text("x")  # a path under a file fails even for root
    one_line_error(capsys, train_args(tmp_path / "a_file" / "run", text), "a_file", "not a folder")
    one_line_error(capsys, train_args(tmp_path / "a_file", text), "a_file", "not a folder")


def test_unwritable_out_is_a_one_line_error(tmp_path, text, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions
            pytest.skip("permissions are not enforced for this user")
        one_line_error(capsys, train_args(locked / "run", text), str(locked), "ermission denied")
    finally:
        locked.chmod(0o755)
    assert not (locked / "run").exists()


@pytest.mark.slow
def test_console_script_evaluates_what_training_wrote(tmp_path):
    script = Path(sys.executable).with_name("lime-model")
    if not script.exists():
        pytest.skip(f"the lime-model console script is not installed beside {sys.executable}")
    out = tmp_path / "arith"
    argv = ["train", "--recipe", "arithmetic", "--out", str(out), "--steps", "1", "--no-progress",
            "--set", 'arithmetic={"operators": [1], "train_per_tier": 16, "test_per_tier": 4}',
            "--set", "batch_size=8", "--set", "micro_batch_size=8", "--set", "seq_len=24"]  # fmt: skip
    assert main(argv) == 0
    written = json.loads((out / "arithmetic_eval.json").read_text())["accuracy"]
    # the installed console script, in its own process
    done = subprocess.run([script, "eval-arithmetic", "--ckpt", out, "--no-progress"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == written


def test_eval_arithmetic_errors_and_recipe_list(tmp_path, capsys):
    one_line_error(
        capsys, ["eval-arithmetic", "--ckpt", str(tmp_path / "none")], "not a finished lime-model run"
    )
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    names = set(out.split())
    assert {"cpu-tiny", "arithmetic", "arithmetic-cpu", "lime-1b-gqa", "lime-1b-mha", "lime-150m"} <= names
    assert {"lime-deep-32", "lime-deep-64", "lime-deep-128"} <= names
    # cpu-tiny's line: its model built from the recipe file's own sizes, counted here; 200 steps of 16 x 64
    import lime_model
    from lime_model import LimeConfig, LimeForCausalLM

    recipe = json.loads((Path(lime_model.__file__).parent / "recipes" / "cpu-tiny.json").read_text())
    n = sum(p.numel() for p in LimeForCausalLM(LimeConfig(**recipe["model"])).parameters())
    lines = out.splitlines()
    line = next(ln for ln in lines if ln.startswith("cpu-tiny "))
    assert line == f"cpu-tiny  {n / 1e3:.3g}K parameters; 205K tokens, 200 steps of 16 x 64", line
    assert " ".join(lines[lines.index(line) + 1].split()).startswith("Smoke test on one CPU")
