"""Two CPU processes (gloo, under torchrun) train the same weights as one with the same global batch;
no process reads the data: they load what `lime-model prepare` cached."""

import json

import pytest
import torch
from helpers import torchrun
from safetensors.torch import load_file

from lime_model.cli import main

pytestmark = pytest.mark.slow  # two torchrun processes train

ARGS = [
    "--recipe", "cpu-tiny", "--steps", "3", "--no-progress",
    "--set", "model.hidden_size=32", "--set", "model.intermediate_size=64", "--set", "model.num_hidden_layers=2",
    "--set", "model.vocab_size=300", "--set", "seq_len=32", "--set", "batch_size=4", "--set", "micro_batch_size=2",
    "--set", "log_every=1", "--set", "warmup_steps=1",
]  # fmt: skip


def write_entry(folder):
    """A lime-model entry point whose ranks fail if they read the texts (beyond the first document the checks
    before work read), or if the DDP model is still alive
    when the process group is destroyed."""
    path = folder / "entry.py"
    path.write_text(
        "import os, sys\n"
        "from lime_model import data\n"
        "from lime_model.cli import main\n"
        "documents = data._file_documents\n"
        "def no_reading(*a, **k):  # the checks before work may read a file's first document, no more\n"
        "    for i, doc in enumerate(documents(*a, **k)):\n"
        "        if i:\n"
        "            raise AssertionError('rank ' + os.environ['RANK'] + ' read the texts')\n"
        "        yield doc\n"
        "data._file_documents = no_reading\n"
        "import gc, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel\n"
        "destroy = dist.destroy_process_group\n"
        "def destroy_after_ddp(*a, **k):  # a live DDP reducer would free the gloo group with the GIL held\n"
        "    assert not any(isinstance(o, DistributedDataParallel) for o in gc.get_objects()), 'DDP outlives the group'\n"
        "    return destroy(*a, **k)\n"
        "dist.destroy_process_group = destroy_after_ddp\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return str(path)


def test_two_gloo_processes_match_one(tmp_path, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text(
        "\n\n".join(f"process {i} reads the cat that sat on mat {i % 11} today" for i in range(100))
    )
    monkeypatch.setenv("LIME_MODEL_CACHE", str(tmp_path / "cache"))
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", "--out", str(one), "--data", str(text), *ARGS]) == 0  # 1 process, 2 micro-batches
    # a fresh cache: prepare trains the BPE and packs the tokens; the processes must only load them
    cache = tmp_path / "cache-2"
    monkeypatch.setenv("LIME_MODEL_CACHE", str(cache))
    assert main(["prepare", "--num-proc", "1", "--data", str(text), *ARGS]) == 0
    run = [write_entry(tmp_path), "train", "--out", str(two), "--data", str(text), *ARGS]
    torchrun(*run, env={"LIME_MODEL_CACHE": str(cache)})  # a free port, one thread per process
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["bpe", "packed", "packed"]  # .npy, .json
    wa, wb = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)  # only the reduction order differs
    la = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert la == pytest.approx(lb, rel=1e-5) and len(la) == 3
