"""FSDP: LIMe routing is refused with one line (an earlier layer's backward reads later layers' router
weights, which FSDP frees); the LLaMA baseline's fsdp recipe trains on several CPU processes, where
accelerate runs it as DDP over gloo (it shards only on GPUs), with one process's losses."""

import json
import os
import subprocess
import sys

import pytest

import lime_model.train as train_mod
from lime_model.cli import main

TINY = [
    "--recipe", "cpu-tiny", "--steps", "3", "--no-progress", "--set", "model.hidden_size=32",
    "--set", "model.intermediate_size=64", "--set", "model.num_hidden_layers=2", "--set", "model.vocab_size=300",
    "--set", "seq_len=32", "--set", "batch_size=4", "--set", "micro_batch_size=2", "--set", "log_every=1",
    "--set", "warmup_steps=1", "--set", "fsdp=true",
]  # fmt: skip


@pytest.mark.parametrize(
    "routing", ["full", "average", "last-2", "dilated-2", "first-1", "no-head-mix", "per-dim", "dynamic"]
)
def test_fsdp_refuses_lime_routing_with_one_line(routing, text, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_mod, "_uses_fsdp", lambda accelerator: True)  # as accelerate decides on GPUs
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", str(text), "--routing", routing, *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lime-model: error: FSDP does not support LIMe routing") and "\n" not in err
    assert not out.exists()  # refused before any work


@pytest.mark.slow  # trains, and two torchrun processes train
def test_llama_fsdp_recipe_on_two_cpu_processes_matches_one(text, tmp_path):
    args = ["--data", str(text), "--routing", "none", *TINY]
    assert main(["train", "--out", str(tmp_path / "one"), *args]) == 0  # 1 process (also fills the cache)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # LIME_MODEL_CACHE: the fixture's, prepared above
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lime_model.cli",
        "train", "--out", str(tmp_path / "two"), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp requested, running MULTI_CPU instead" in proc.stdout + proc.stderr
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("one", "two")
    ]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
