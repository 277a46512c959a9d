"""`lime-model prepare` packs a recipe's data, in parallel, into the cache that `train` reads; a train on
several processes reads only that cache and, without it, stops with one line."""

import os
import subprocess
import sys

import numpy as np
import pytest

import lime_model.train as train_mod
from lime_model import data
from lime_model.cli import main
from lime_model.tokenization import train_bpe

TINY = [
    "--recipe", "cpu-tiny", "--steps", "2", "--set", "model.hidden_size=32", "--set", "model.intermediate_size=64",
    "--set", "model.num_hidden_layers=2", "--set", "model.vocab_size=300", "--set", "seq_len=32",
    "--set", "batch_size=4", "--set", "micro_batch_size=2", "--set", "warmup_steps=1",
]  # fmt: skip


def packed_files(cache):
    return sorted(p for p in cache.iterdir() if p.name.startswith("packed-") and p.suffix == ".npy")


def test_train_reads_what_prepare_packed(text, tmp_path, monkeypatch, capsys):
    args = ["--data", str(text), *TINY]
    assert main(["prepare", "--num-proc", "1", "--no-progress", *args]) == 0
    assert "training rows of 32 tokens" in capsys.readouterr().out

    def fail(*a, **k):
        raise AssertionError("train tokenised")

    monkeypatch.setattr(data, "_tokenize", fail)
    monkeypatch.setattr(train_mod, "train_bpe", fail)
    assert main(["train", "--out", str(tmp_path / "run"), "--no-progress", *args]) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


@pytest.mark.slow  # two tokenising worker processes start
def test_parallel_prepare_packs_the_serial_rows_bit_for_bit(text, tmp_path, monkeypatch):
    args = ["--no-progress", "--data", str(text), *TINY, "--set", "max_texts=60"]
    monkeypatch.setenv("LIME_MODEL_CACHE", str(tmp_path / "serial"))
    assert main(["prepare", "--num-proc", "1", *args]) == 0
    monkeypatch.setenv("LIME_MODEL_CACHE", str(tmp_path / "parallel"))
    monkeypatch.setattr(data, "_token_chunks", _small_chunks(data._token_chunks))  # several chunks per worker
    assert main(["prepare", "--num-proc", "2", *args]) == 0
    (serial,), (parallel,) = packed_files(tmp_path / "serial"), packed_files(tmp_path / "parallel")
    assert serial.name == parallel.name  # the same cache key: train finds it
    assert serial.read_bytes() == parallel.read_bytes()
    # independently: each document's ids then eos, concatenated, cut into rows of 32
    tokenizer = train_bpe(data.load_texts(str(text), max_texts=60), 300)
    (bpe,) = (tmp_path / "serial").glob("bpe-*")
    assert (
        tokenizer.backend_tokenizer.to_str() == train_mod.load_tokenizer(str(bpe)).backend_tokenizer.to_str()
    )
    stream = [
        i
        for doc in data.load_texts(str(text), max_texts=60)
        for i in [*tokenizer.encode(doc, add_special_tokens=False), tokenizer.eos_token_id]
    ]
    expected = np.array(stream[: len(stream) // 32 * 32], dtype=np.int32).reshape(-1, 32)
    np.testing.assert_array_equal(np.load(parallel), expected)


def _small_chunks(token_chunks):
    return lambda docs, tokenizer, chunk, num_proc: token_chunks(docs, tokenizer, 7, num_proc)


@pytest.mark.slow  # two tokenising worker processes start
def test_streamed_packing_in_parallel_matches_serial(text):
    tokenizer = train_bpe(data.load_texts(str(text)), 300)
    serial, parallel = np.zeros((12, 16), np.int32), np.zeros((12, 16), np.int32)
    n_serial = data.stream_pack(data.iter_texts(str(text)), tokenizer, 16, serial, chunk=5)
    n_parallel = data.stream_pack(data.iter_texts(str(text)), tokenizer, 16, parallel, chunk=5, num_proc=2)
    assert n_serial == n_parallel == 12
    np.testing.assert_array_equal(serial, parallel)


@pytest.mark.slow  # two torchrun processes start
def test_several_processes_without_the_cache_stop_with_one_line(text, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "LIME_MODEL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lime_model.cli",
        "train", "--out", str(tmp_path / "run"), "--data", str(text), "--no-progress", *TINY,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode != 0
    # Each process writes its line; torchrun may stop the second before it does, and two processes'
    # writes to the shared stderr can land on one line, so the messages are counted, not the lines.
    said = proc.stderr.count("lime-model: error: no BPE tokenizer")
    assert 1 <= said <= 2, proc.stderr[-3000:]
    assert proc.stderr.count("run `lime-model prepare` with the same --recipe, --data") == said
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr  # exit 2: bad input
    assert not cache.exists() or not any(cache.iterdir())  # nothing was tokenised
