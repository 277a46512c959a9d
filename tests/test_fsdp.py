"""FSDP2 (``fully_shard``, ``lime_model.train.shard``) on gloo CPU processes: LLaMA's and LIMe's
gradients equal the unsharded model's, and a short run's weights equal one process's.

Tolerance, per parameter: ``|sharded - unsharded| / |unsharded| <= 1e-6`` (Frobenius norms). Sharded,
each process's gradient covers its own rows and FSDP sums the processes'; one process sums all rows
at once. The same float32 numbers are added in another order, which moves a sum by a few float32
epsilons (1.2e-7; measured here: at most 2.6e-7 for gradients, 2e-7 for weights after three steps);
an error of the sharding (a contribution lost or doubled, a stale router weight) is of the order of
the gradient itself. On one process nothing is reordered, and the gradients are equal bit for bit.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_worker import gradients, relative_error
from helpers import torchrun
from safetensors.torch import load_file

from lime_model.cli import main

RTOL = 1e-6
ROUTINGS = ["none", "full", "per-dim", "dynamic"]  # LLaMA; LIMe's static, per-dim and per-token routers

TINY = [
    "--recipe", "cpu-tiny", "--steps", "3", "--no-progress", "--set", "model.hidden_size=32",
    "--set", "model.intermediate_size=64", "--set", "model.num_hidden_layers=2", "--set", "model.vocab_size=300",
    "--set", "seq_len=32", "--set", "batch_size=4", "--set", "micro_batch_size=2", "--set", "log_every=1",
    "--set", "warmup_steps=1", "--set", "fsdp=true",
]  # fmt: skip


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "routing, overrides",
    [*((r, {}) for r in ROUTINGS), ("full", {"recompute_routed_kv": True})],
    ids=[*ROUTINGS, "full-recomputed"],
)
def test_sharded_gradients_equal_unsharded_bit_for_bit_in_one_process(routing, overrides, one_process_group):
    # FSDP frees a layer's gathered parameters after its backward on one process too: without the K/V
    # buffer's own copies of the router weights, full and per-dim fail here ("storage of size 0")
    for name, (sharded, unsharded) in gradients(routing, **overrides).items():
        assert torch.equal(sharded, unsharded), name


@pytest.mark.slow  # two torchrun processes
def test_sharded_gradients_equal_unsharded_on_two_gloo_processes(tmp_path):
    out = tmp_path / "errors.json"
    torchrun(str(Path(__file__).with_name("fsdp_worker.py")), str(out), *ROUTINGS)
    errors = json.loads(out.read_text())
    assert list(errors) == ROUTINGS
    assert any(".router." in name for name in errors["full"])  # the routers' gradients are among them
    for routing, per_parameter in errors.items():
        assert max(per_parameter.values()) <= RTOL, (routing, per_parameter)


def write_entry(folder: Path) -> str:
    """A lime-model entry point that says when training shards the model (the run would be DDP's
    otherwise, with the same numbers)."""
    path = folder / "entry.py"
    path.write_text(
        "import sys\n"
        "import lime_model.train as train\n"
        "from lime_model.cli import main\n"
        "shard = train.shard\n"
        "def shard_and_say(*a, **k):\n"
        "    print('lime-model test: sharded with fully_shard')\n"
        "    return shard(*a, **k)\n"
        "train.shard = shard_and_say\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return str(path)


def assert_same_run(one: Path, two: Path) -> None:
    """``two`` holds the weights (within ``RTOL``), losses and files of ``one``."""
    weights = [load_file(run / "model.safetensors") for run in (one, two)]
    assert weights[0].keys() == weights[1].keys()  # a tied head stored once in both
    for name, value in weights[0].items():
        assert relative_error(weights[1][name], value) <= RTOL, name
    losses = [
        [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (one, two)
    ]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=RTOL)
    # the model's own code and class, not FSDP's subclass
    assert (one / "config.json").read_text() == (two / "config.json").read_text()
    assert sorted(p.name for p in one.glob("*.py")) == sorted(p.name for p in two.glob("*.py"))


@pytest.mark.slow  # trains, and two torchrun processes train
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fsdp_run_on_two_gloo_processes_matches_one(routing, text, tmp_path):
    args = ["--data", str(text), "--routing", routing, *TINY]
    # one process: fsdp=true has nothing to shard, the model trains whole (and fills the fixture's cache)
    assert main(["train", "--out", str(tmp_path / "one"), *args]) == 0
    proc = torchrun(write_entry(tmp_path), "train", "--out", str(tmp_path / "two"), *args)
    assert proc.stdout.count("sharded with fully_shard") == 2  # both processes
    assert_same_run(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow  # trains, and two torchrun processes train twice
def test_fsdp_run_stopped_and_resumed_matches_one_process(text, tmp_path):
    # the optimizer state saved from the shards and loaded into them again
    args = ["--data", str(text), "--routing", "full", *TINY]
    assert main(["train", "--out", str(tmp_path / "one"), *args]) == 0
    two = ["train", "--out", str(tmp_path / "two"), *args]
    torchrun("-m", "lime_model.cli", *two, "--stop-after", "2")
    assert "continuing the run" in torchrun("-m", "lime_model.cli", *two).stderr
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_sharded_routers_keep_their_weight_gradients_to_their_own_backward(one_process_group, monkeypatch):
    """Off the CPU an unsharded model's sources compute its routers' weight gradients (one pass over
    the readers' gradients: ``KVBuffer.defer_weight_grads``); a sharded router's weight is whole only
    in its own layer's forward, so FSDP2's model keeps them to the readers' backward. Both give the
    same gradients (the same sums in another order)."""
    from lime_model import kv_buffer

    monkeypatch.setattr(kv_buffer, "gemm_pieces", lambda device: False)
    deferred, original = [], kv_buffer.KVBuffer.defer_weight_grads

    def spy(self, weights):
        deferred.append(sorted(weights))
        original(self, weights)

    monkeypatch.setattr(kv_buffer.KVBuffer, "defer_weight_grads", spy)
    for name, (sharded, unsharded) in gradients("full").items():
        torch.testing.assert_close(sharded, unsharded, rtol=1e-5, atol=1e-7, msg=name)
    assert deferred == [[1, 2], []]  # the unsharded model's forward, then the sharded one's
