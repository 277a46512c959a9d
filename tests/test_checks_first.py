"""Both programs check what needs no model before torch is imported, and refuse the inputs a model cannot
take (an encoder's perplexity, a tokenizer without its vocabulary) in one line, exit 2.

The budget runs each bad command line as the program (``python -X importtime -m ...``): exit 2, one line,
torch never imported, and under 2 s of the child's CPU time (on a quiet machine its wall time; CPU time,
so that a loaded machine does not fail the test). Before these checks ran first, each took a torch import
and a model load: 30-50 s under load.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import save_tiny_checkpoint, tiny_model, tiny_tokenizer

from lime_model import cli as model_cli
from lime_probe import cli as probe_cli

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
BUDGET_S = 2.0
UNWRITABLE = "/proc/lime-probe-test/out"  # /proc refuses new files, even for root


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checks")
    (root / "empty.txt").write_text("\n\n  \n")
    (root / "text.txt").write_text("The cat is on the mat.\n\nThe dogs are in the garden.\n")
    return {
        "llama": save_tiny_checkpoint(root / "llama", "llama"),
        "empty": root / "empty.txt",
        "text": root / "text.txt",
        "missing": root / "missing.txt",
        "corrupt": _corrupt(root / "corrupt"),
        "root": root,
    }


def _corrupt(folder: Path) -> Path:
    """A checkpoint folder whose weights file is garbage."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\x07garbage")
    return folder


def run_program(module: str, argv: list[str]) -> tuple[int, str, set[str], float]:
    """``python -X importtime -m MODULE ARGV`` as a user runs it: exit code, stderr without the import
    lines, the top-level packages it imported, its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, *map(str, argv)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stderr.splitlines()
    imported = {ln.split("|")[-1].strip().split(".")[0] for ln in lines if ln.startswith("import time:")}
    err = "\n".join(ln for ln in lines if not ln.startswith("import time:"))
    return done.returncode, err, imported, cpu


# (id, program, argv with {llama} {text} {empty} {missing} {out} filled in, message fragment)
BUDGET = [
    ("probe missing --data", "lime_probe.cli", "entropy --ckpt {llama} --data {missing} --out {out}",
     "data not found"),
    ("probe empty --data", "lime_probe.cli", "entropy --ckpt {llama} --data {empty} --out {out}", "no text in"),
    ("probe --layers abc", "lime_probe.cli", "entropy --ckpt {llama} --data {text} --layers abc --out {out}",
     "--layers must be 'all' or comma-separated integers, got 'abc'"),
    ("probe negative --alpha", "lime_probe.cli", "entropy --ckpt {llama} --data {text} --alpha -0.5 --out {out}",
     "--alpha must be a finite number > 0, got -0.5"),
    ("probe unwritable --out", "lime_probe.cli", f"entropy --ckpt {{llama}} --data {{text}} --out {UNWRITABLE}",
     f"--out {UNWRITABLE}: cannot write in"),
    ("probe tsne --perplexity -3", "lime_probe.cli", "tsne --ckpt {llama} --data {text} --perplexity -3 --out {out}",
     "--perplexity must be a finite number > 0, got -3.0"),
    ("probe blimp --layers", "lime_probe.cli", "blimp --ckpt {llama} --data {root} --layers top --out {out}",
     "--layers must be 'paper', 'all' or comma-separated integers, got 'top'"),
    ("probe report --layers abc", "lime_probe.cli", "report --ckpt {llama} --data {text} --layers abc --out {out}",
     "--layers must be 'all' or comma-separated integers"),
    ("probe missing --ckpt", "lime_probe.cli", "entropy --ckpt {root}/nope --data {text} --out {out}",
     "checkpoint not found:"),
    ("probe corrupt --ckpt", "lime_probe.cli", "entropy --ckpt {corrupt} --data {text} --out {out}",
     "cannot read the weights file"),
    ("model missing --data", "lime_model.cli", "eval --ckpt {llama} --data {missing}", "data not found"),
    ("model empty --data", "lime_model.cli", "eval --ckpt {llama} --data {empty}", "no text in"),
    ("model unwritable --out", "lime_model.cli", f"eval --ckpt {{llama}} --data {{text}} --out {UNWRITABLE}",
     f"--out {UNWRITABLE}: cannot write in"),
    ("model train missing --data", "lime_model.cli", "train --recipe cpu-tiny --data {missing} --out {out}",
     "data not found"),
    ("model plan --gpu-memory", "lime_model.cli", "plan --recipe cpu-tiny --gpu-memory 80XB",
     "--gpu-memory expects a size"),
    ("model plan --mfu", "lime_model.cli", "plan --recipe cpu-tiny --mfu 1.5", "--mfu must lie in"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "argv", "needle"), [r[1:] for r in BUDGET], ids=[r[0] for r in BUDGET])
def test_checks_that_need_no_model_run_before_torch_within_the_budget(files, tmp_path, module, argv, needle):
    out = tmp_path / "out"
    args = argv.format(**files, out=out).split()
    code, err, imported, cpu = run_program(module, args)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err, err
    assert "torch" not in imported, f"torch was imported before the input was refused: {err}"
    assert cpu < BUDGET_S, f"{cpu:.2f} s of CPU to refuse {argv!r}"
    assert not out.exists()


# --------------------------------------------------------------------------- a model without a causal LM head


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    """A tiny random BertForMaskedLM folder with its tokenizer, as save_pretrained leaves it."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("bert") / "bert", "bert")


def test_probe_perplexity_refuses_an_encoder_in_one_line(bert, files, tmp_path, capsys):
    argv = ["perplexity", "--ckpt", bert, "--data", files["text"], "--out", tmp_path / "o"]
    code = probe_cli.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert (
        err
        == "lime-probe perplexity: error: bert (bert) is not a causal LM: perplexity needs a next-token head, which it has not"
    )
    assert not (tmp_path / "o").exists()


def test_model_eval_says_first_that_an_encoder_is_no_causal_lm(bert, files, capfd):
    """Only the one line: transformers' load report (a table of MISSING weights) went to stderr before it."""
    code = model_cli.main(["eval", "--ckpt", str(bert), "--data", str(files["text"])])
    err = capfd.readouterr().err.strip()
    assert code == 2, err
    assert (
        err
        == f"lime-model: error: {bert} (bert) is not a causal LM: perplexity needs a next-token head, which it has not"
    )


# --------------------------------------------------------------------------- a tokenizer without its vocabulary


@pytest.fixture(scope="module")
def gpt2_without_vocab(tmp_path_factory) -> Path:
    """A GPT-2 folder whose tokenizer lost vocab.json and merges.txt (tokenizer_config.json and tokenizer.json
    kept): transformers loads it as a tokenizer of one special token, and every text as no token at all."""
    import transformers as tf

    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    tok = tiny_tokenizer()
    tiny_model("gpt2", tok).save_pretrained(folder)
    tok.backend_tokenizer.model.save(str(folder))  # vocab.json, merges.txt
    tf.GPT2Tokenizer(
        vocab_file=str(folder / "vocab.json"), merges_file=str(folder / "merges.txt")
    ).save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        (folder / name).unlink()
    return folder


MISSING_VOCAB = (
    "(GPT2Tokenizer) has no vocabulary, only its 1 special token(s): vocab.json, merges.txt missing from"
)


def test_probe_names_the_tokenizer_files_that_are_missing(gpt2_without_vocab, files, tmp_path, capsys):
    argv = [
        "entropy",
        "--ckpt",
        gpt2_without_vocab,
        "--data",
        files["text"],
        "--out",
        tmp_path / "o",
        "--no-cache",
    ]
    code = probe_cli.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert MISSING_VOCAB in err and "0 tokens" not in err, err


def test_model_eval_names_the_tokenizer_files_that_are_missing(gpt2_without_vocab, files, capsys):
    code = model_cli.main(["eval", "--ckpt", str(gpt2_without_vocab), "--data", str(files["text"])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert MISSING_VOCAB in err, err


# --------------------------------------------------------------------------- --layers: negative indices


def _layer_helps() -> dict[str, str]:
    """The --layers help of every lime-probe command that takes it."""
    helps = {}
    for name in probe_cli.COMMANDS:
        parser = probe_cli.build_parser()
        sub = parser._subparsers._group_actions[0].choices[name]
        action = next((a for a in sub._actions if "--layers" in a.option_strings), None)
        if action is not None:
            helps[name] = action.help
    return helps


def test_every_layers_option_documents_negative_indices():
    helps = _layer_helps()
    assert {"entropy", "separability", "tsne", "cka", "blimp", "report"} <= set(helps)
    for name, text in helps.items():
        assert "negative ones counted from the last (-1: the last)" in text, (name, text)


def test_a_negative_layer_is_the_last_one_counted_from_the_end(files, tmp_path, capsys):
    argv = [
        "entropy",
        "--ckpt",
        files["llama"],
        "--data",
        files["text"],
        "--site",
        "hidden",
        "--unit",
        "documents",
    ]
    rows = {}
    for layers in ("-1", "2"):  # hidden: the embeddings and the 2 blocks' outputs, 3 entries
        out = tmp_path / layers
        code = probe_cli.main([str(a) for a in [*argv, f"--layers={layers}", "--out", out, "--no-cache"]])
        assert code == 0, capsys.readouterr().err
        rows[layers] = json.loads((out / "entropy_hidden.json").read_text())["rows"]
    assert [r["layer"] for r in rows["-1"]] == [2]
    assert rows["-1"] == rows["2"]
