"""Held-out evaluation, single-pass data, the second-epoch warning, reproducibility, the typed recipe.

Perplexities are recomputed here with a plain loop over the model's logits; packed rows are rebuilt
from the tokenizer's ids of each document; weights are compared bit for bit across processes.
"""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import train_args
from safetensors.torch import load_file

from lime_model import data as D
from lime_model import train as T
from lime_model.cli import main
from lime_model.modeling import LimeForCausalLM
from lime_model.recipes import Recipe, identity, load_recipe
from lime_model.tokenization import load_tokenizer

TINY = {
    "model": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "seq_len": 16, "batch_size": 4, "micro_batch_size": 4, "steps": 4, "warmup_steps": 1, "log_every": 1,
    "save_every": 4, "lr": 3e-3, "min_lr": 3e-4,
}  # fmt: skip


@pytest.fixture
def docs(tmp_path):
    texts = [f"document {i} says the cat sat on mat {i % 13} near tree {i % 5}" for i in range(60)]
    path = tmp_path / "t.txt"
    path.write_text("\n\n".join(texts))
    return path, texts


def hand_windows(texts, tok, window):
    """Documents + eos, concatenated, cut into non-overlapping windows; the tail dropped."""
    stream = []
    for t in texts:
        stream += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(stream) // window
    return [stream[i * window : (i + 1) * window] for i in range(n)]


def hand_perplexity(model, windows):
    """exp(mean NLL of every next token within each window), one position at a time."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1)
            for t in range(len(w) - 1):
                nll -= float(logp[t, w[t + 1]])
                count += 1
    return nll / count, math.exp(nll / count), count


def test_eval_cli_perplexity_is_exp_mean_nll_over_fixed_windows(docs, tmp_path, monkeypatch, capsys):
    path, texts = docs
    monkeypatch.setenv("LIME_MODEL_CACHE", str(tmp_path / "cache"))
    run = T.train(
        "cpu-tiny", tmp_path / "run", progress=False, data=str(path), cache_dir=str(tmp_path / "c"), **TINY
    )
    out = tmp_path / "new" / "ppl"  # missing folders are created
    assert main(["eval", "--ckpt", str(run), "--data", str(path), "--window", "12", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads((out / "perplexity.json").read_text()) == printed
    model = LimeForCausalLM.from_pretrained(run).eval()
    windows = hand_windows(texts, load_tokenizer(str(run)), 12)
    loss, ppl, count = hand_perplexity(model, windows)
    assert (printed["windows"], printed["tokens"], printed["window"]) == (len(windows), count, 12)
    assert printed["loss"] == pytest.approx(loss, rel=1e-5)
    assert printed["perplexity"] == pytest.approx(ppl, rel=1e-5)
    # a checkpoint of the same run is scored on the same windows; the default window is seq_len
    ckpt = T.checkpoints(run)[-1]
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(path), "--threads", "1"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["window"] == 16 and again["windows"] == len(
        hand_windows(texts, load_tokenizer(str(run)), 16)
    )
    assert main(["eval", "--ckpt", str(tmp_path / "nope"), "--data", str(path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(run), "--data", str(path), "--threads", "0"]) == 2
    assert "--threads: expected a positive integer, got 0" in capsys.readouterr().err


def test_threads_option_sets_torch_threads_before_work(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert main(["eval-arithmetic", "--ckpt", "/nonexistent", "--threads", "3"]) == 2  # fails after setting
    assert calls == [3]
    capsys.readouterr()


def test_held_out_rows_never_train_and_are_evaluated_every_eval_every(docs, tmp_path):
    path, _ = docs
    recipe = {**TINY, "data": str(path), "cache_dir": str(tmp_path / "c"), "eval_holdout": 0.25, "eval_every": 2,
              "log_every": 3}  # fmt: skip
    run = T.train("cpu-tiny", tmp_path / "run", progress=False, **recipe)
    tok = load_tokenizer(str(run))
    r = load_recipe("cpu-tiny", recipe)
    all_rows = torch.from_numpy(D.packed_sequences(D.TextSource(str(path)), tok, 16, tmp_path / "c"))
    data = T.prepare_data(r, tok)
    n_eval = round(0.25 * len(all_rows))
    assert torch.equal(data.input_ids, all_rows[:-n_eval]) and torch.equal(
        data.eval_input_ids, all_rows[-n_eval:]
    )
    seen = torch.cat([T.batch_indices(s, 4, len(data.input_ids), r.seed) for s in range(4)])
    assert int(seen.max()) < len(all_rows) - n_eval  # training indexes the training rows only
    ms = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ms] == [2, 3, 4]  # eval steps 2, 4; log step 3; the last
    assert ["val_loss" in m for m in ms] == [True, False, True]
    model = LimeForCausalLM.from_pretrained(run).eval()
    loss, ppl, _ = hand_perplexity(model, all_rows[-n_eval:].tolist())
    assert ms[-1]["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert ms[-1]["val_perplexity"] == pytest.approx(ppl, rel=1e-5)


def test_arithmetic_runs_evaluate_on_their_test_expressions(tmp_path):
    arith = {"operators": [1], "train_per_tier": 16, "test_per_tier": 4}
    run = T.train("arithmetic", tmp_path / "a", progress=False, steps=2, batch_size=8, micro_batch_size=8,
                  seq_len=24, arithmetic=arith)  # fmt: skip
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    data = T.prepare_data(
        load_recipe(json.loads((run / "recipe.json").read_text())), load_tokenizer(str(run))
    )
    model = LimeForCausalLM.from_pretrained(run).eval()
    nll, count = 0.0, 0
    with torch.no_grad():  # loss on the solution tokens only (labels -100 elsewhere)
        for ids, lab in zip(data.eval_input_ids, data.eval_labels, strict=True):
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
            for t in range(len(ids) - 1):
                if lab[t + 1] != -100:
                    nll, count = nll - float(logp[t, lab[t + 1]]), count + 1
    assert len(data.eval_input_ids) == 4
    assert last["val_loss"] == pytest.approx(nll / count, rel=1e-5)


def test_second_epoch_warns_once_at_the_step_that_starts_it(docs, tmp_path):
    path, _ = docs
    recipe = {**TINY, "data": str(path), "cache_dir": str(tmp_path / "c")}
    n_rows = len(T.prepare_data(load_recipe("cpu-tiny", recipe)).input_ids)
    one_pass = n_rows // 4  # steps of 4 rows that fit in one epoch
    with warnings.catch_warnings():
        warnings.simplefilter("error", T.SecondEpochWarning)
        T.train(
            "cpu-tiny", tmp_path / "a", progress=False, **{**recipe, "steps": one_pass, "save_every": 100}
        )
    with pytest.warns(T.SecondEpochWarning, match="second epoch") as caught:
        T.train(
            "cpu-tiny", tmp_path / "b", progress=False, **{**recipe, "steps": one_pass + 2, "save_every": 100}
        )
    assert len([w for w in caught if w.category is T.SecondEpochWarning]) == 1
    assert f"step {one_pass + 1} starts" in str(caught[0].message)
    # the rule itself, against the positions of each batch in the row stream
    for n, b in [(10, 4), (8, 4), (3, 4), (12, 1)]:
        firsts = [s for s in range(20) if any(p >= n for p in range(s * b, (s + 1) * b))]
        assert [s for s in range(20) if T.second_epoch_starts(s, b, n)] == firsts[:1]


def test_one_pass_streams_exactly_the_rows_the_steps_consume(docs, tmp_path):
    path, texts = docs
    tok = T.prepare_data(load_recipe("cpu-tiny", {**TINY, "data": str(path)})).tokenizer
    windows = hand_windows(texts, tok, 8)
    read = []

    def counted():
        for t in texts:
            read.append(t)
            yield t

    out = np.zeros((5, 8), dtype=np.int32)
    assert D.stream_pack(counted(), tok, 8, out, chunk=2) == 5
    assert out.tolist() == windows[:5]
    assert len(read) < len(texts)  # stopped reading once the rows were full
    cached = D.packed_sequences(D.TextSource(str(path)), tok, 8, tmp_path / "c", max_rows=5)
    assert cached.tolist() == windows[:5]
    assert (
        D.packed_sequences(D.TextSource(str(path)), tok, 8, tmp_path / "c", max_rows=10**6).tolist()
        == windows
    )
    recipe = load_recipe("cpu-tiny", {**TINY, "data": str(path), "one_pass": True, "steps": 3, "seq_len": 8})
    assert len(T.prepare_data(recipe, tok).input_ids) == 3 * 4
    for name in ("lime-1b-gqa", "lime-1b-mha", "lime-150m", "lime-deep-32", "lime-deep-64", "lime-deep-128"):
        r = load_recipe(name)
        assert r.one_pass and r.max_texts is None and r.steps is not None


def _train_in_subprocess(out: Path, data: Path, threads: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": str(threads)}
    extra = ["--threads", str(threads), "--set", f"cache_dir={out.parent / 'cache'}"]
    extra += [f"--set=model.{k}={v}" for k, v in TINY["model"].items()]
    extra += [f"--set={k}={TINY[k]}" for k in ("seq_len", "batch_size", "micro_batch_size", "lr", "min_lr")]
    argv = train_args(out, data, *extra, steps=6)
    code = "import sys; from lime_model.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_same_command_same_weights_bit_for_bit_and_run_info(docs, tmp_path):
    path, _ = docs
    a, b = tmp_path / "a", tmp_path / "b"
    _train_in_subprocess(a, path, 1)
    _train_in_subprocess(b, path, 1)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k  # equal as bits, not just close
    (info,) = json.loads((a / "run_info.json").read_text())
    assert info["torch_threads"] == 1 and info["torch"] == torch.__version__ and info["processes"] == 1
    assert info["deterministic_algorithms"] is False and info["device"] == "cpu"


def test_recipe_is_typed_and_validated_and_old_runs_still_resume():
    r = load_recipe("cpu-tiny", {"data": "x.txt", "model.hidden_size": 128})
    assert isinstance(r, Recipe) and r.model["hidden_size"] == 128 and r.arithmetic.operators == [4, 5, 6]
    assert load_recipe(r.to_dict()) == r and json.loads(json.dumps(r.to_dict())) == r.to_dict()
    for bad, needle in [({"steps": "many"}, "'steps' must be int"), ({"eval_holdout": 1.5}, "eval_holdout"),
                        ({"arithmetic": {"operands": [4]}}, "operators n-1"), ({"one_pass": 1}, "'one_pass' must be bool"),
                        ({"arithmetic.operators": [0]}, "operator counts")]:  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            load_recipe("cpu-tiny", {"data": "x.txt", **bad})
    # a recipe.json written before eval_*/one_pass existed, with the old arithmetic keys, on an lm run
    saved = {k: v for k, v in r.to_dict().items() if not k.startswith("eval_") and k != "one_pass"}
    saved["arithmetic"] = {"operands": [4, 5, 6], "train_per_operand": 50000}
    assert identity(saved) == r.identity()
    assert identity({**saved, "lr": 0.5}) != r.identity()


def test_train_cli_eval_data_matches_the_eval_command_on_the_final_model(docs, tmp_path, monkeypatch, capsys):
    path, _ = docs
    held = tmp_path / "held.txt"
    held.write_text("\n\n".join(f"a held out line {i} about a dog on a log" for i in range(20)))
    monkeypatch.setenv("LIME_MODEL_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    argv = [
        "train",
        "--recipe",
        "cpu-tiny",
        "--out",
        str(run),
        "--data",
        str(path),
        "--eval-data",
        str(held),
        "--steps",
        "3",
        "--no-progress",
        "--set",
        "eval_every=1",
        "--set",
        "log_every=5",
    ]
    argv += [f"--set=model.{k}={v}" for k, v in TINY["model"].items()]
    argv += [f"--set={k}={TINY[k]}" for k in ("seq_len", "batch_size", "micro_batch_size")]  # fmt: skip
    assert main(argv) == 0
    ms = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ms] == [1, 2, 3] and all("val_perplexity" in m for m in ms)
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--data", str(held)]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(ms[-1]["val_loss"], rel=1e-6)
