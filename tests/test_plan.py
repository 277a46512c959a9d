"""``lime-model plan``: the planned memory of a training step against what a real CPU step allocates.

The real step is training's own (:func:`lime_model.train.train_step` through accelerate, the second
step, so that AdamW's state exists), measured by the profiler's record of the CPU allocator's
allocations and frees (``profile_memory``): the running sum of allocated bytes, its highest value
during the step, and, per micro-batch, what it gained between the model's forward starting and
backward starting (markers recorded by hooks written here). Nothing of the plan's code measures it.
"""

from __future__ import annotations

import bisect
import json

import pytest
import torch
from accelerate.state import AcceleratorState
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM

from lime_model import train as T
from lime_model.cli import main
from lime_model.modeling import LimeDecoderLayer
from lime_model.plan import parse_memory, stand_in_tokenizer, step_memory
from lime_model.recipes import load_recipe

VOCAB = 256
SIZES = {
    "model.vocab_size": VOCAB,
    "model.hidden_size": 64,
    "model.intermediate_size": 128,
    "model.num_hidden_layers": 3,
    "model.num_attention_heads": 4,
    "model.num_key_value_heads": 2,
    "seq_len": 64,
    "batch_size": 8,
    "micro_batch_size": 4,  # two micro-batches: the second's forward runs with the first's gradients
    "data": "(not read)",
    "mixed_precision": "no",
}
CONFIGS = {
    "llama": {"routing": "none"},
    "full": {"routing": "full"},
    "full+recompute": {"routing": "full", "model.recompute_routed_kv": True},
    "per-dim": {"routing": "per-dim"},
    "dynamic": {"routing": "dynamic"},
    "full bf16": {"routing": "full", "mixed_precision": "bf16"},
    "full+recompute bf16": {"routing": "full", "model.recompute_routed_kv": True, "mixed_precision": "bf16"},
}


class _Vocab:
    bos_token_id = eos_token_id = 0
    pad_token_id = None

    def __len__(self) -> int:
        return VOCAB


def real_step(recipe) -> tuple[int, int]:
    """(peak allocated bytes during a real second training step, the most one micro-batch's forward
    and loss added before its backward), from the profiler's allocator events."""
    AcceleratorState._reset_state(reset_partial_state=True)  # each configuration its own precision
    accelerator = T.accelerator_for(recipe)
    torch.manual_seed(0)
    rows = torch.randint(0, VOCAB, (2 * recipe.batch_size, recipe.seq_len))
    data = T.TrainingData(_Vocab(), rows, rows)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = AutoModelForCausalLM.from_config(T.model_config(recipe, _Vocab()))
        model.train()
        optimizer = T.build_optimizer(model, recipe)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        model, optimizer = T._prepare(accelerator, model, optimizer)
        T.train_step(accelerator, model, optimizer, scheduler, data, recipe, 0)  # AdamW makes its state

        def marker(name):
            with record_function(name):
                pass

        model.register_forward_pre_hook(lambda *_: marker("forward starts"))
        backward = accelerator.backward
        accelerator.backward = lambda loss, **kw: (marker("backward starts"), backward(loss, **kw))
        with record_function("measured step"):
            T.train_step(accelerator, model, optimizer, scheduler, data, recipe, 1)
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times, held, total = [], [], 0
    for t, nbytes in memory:
        total += nbytes
        times.append(t)
        held.append(total)

    def at(t: int) -> int:
        i = bisect.bisect_right(times, t)
        return held[i - 1] if i else 0

    (step,) = [e for e in events if e.name() == "measured step"]
    peak = max(h for t, h in zip(times, held, strict=True) if step.start_ns() <= t <= step.end_ns())
    starts = {
        name: sorted(e.start_ns() for e in events if e.name() == name)
        for name in ("forward starts", "backward starts")
    }
    assert len(starts["forward starts"]) == len(starts["backward starts"]) == 2
    activations = max(
        at(b) - at(f) for f, b in zip(starts["forward starts"], starts["backward starts"], strict=True)
    )
    return peak, activations


@pytest.fixture(scope="module")
def measured():
    """name -> (plan, real peak, real activations), for every configuration."""
    out = {}
    for name, extra in CONFIGS.items():
        recipe = load_recipe("cpu-tiny", {**SIZES, **extra})
        out[name] = (step_memory(recipe, gpu=False), *real_step(recipe))
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_plan_matches_a_real_cpu_step(measured, name):
    """The planned peak and activation bytes are within 10 % of those the real step allocates."""
    plan, peak, activations = measured[name]
    assert plan.peak["Total"] == pytest.approx(peak, rel=0.10)
    assert plan.activations == pytest.approx(activations, rel=0.10)


def test_recompute_saving_is_the_real_one(measured):
    """What ``recompute_routed_kv`` saves in the plan is what it saves in the real step (a plan that
    ignored the option would save nothing), and the K/V buffer is 2 x L x kv x B x T x head_dim floats."""
    full, peak, activations = measured["full"]
    recomputed, peak_r, activations_r = measured["full+recompute"]
    assert activations - activations_r > 0
    assert full.activations - recomputed.activations == pytest.approx(activations - activations_r, rel=0.10)
    layers, kv, head_dim = SIZES["model.num_hidden_layers"], SIZES["model.num_key_value_heads"], 64 // 4
    assert full.kv_buffer == 2 * layers * kv * SIZES["micro_batch_size"] * SIZES["seq_len"] * head_dim * 4
    assert measured["llama"][0].kv_buffer == 0


def _shard_bytes(tensors, world: int) -> int:
    """fp32 bytes of rank 0's shards: FSDP2 splits each tensor's first dimension into ``world`` chunks
    of ``ceil(rows / world)`` rows (the last ones padded), rank 0 holding the first."""
    return sum(-(-t.shape[0] // world) * t[0].numel() * 4 for t in tensors)


@pytest.mark.parametrize("routing", ["none", "full"])
def test_fsdp2_plan_shards_parameters_and_adam_state(routing):
    """FSDP2 over N processes, one micro-batch each (gradients reduce-scattered at once): rank 0 holds its
    shard of every parameter and of AdamW's two moments, 1/N of DDP's bytes up to the padding (computed
    here from the model's shapes), plus a 4-byte step count per parameter. The step peaks at the end of the
    forward (activations highest, no gradient made yet: the previous step's were set to None), where
    every decoder layer has been resharded after its forward and the root's parameters (embeddings, final
    norm; the tied head) stay gathered, as FSDP2 keeps the root's for the backward that follows; up to
    two layers' gathered parameters besides are allowed, a layer in flight and one prefetched. The
    per-GPU total falls below DDP's and with N; the process group is gone afterwards (plan runs twice)."""
    import torch.distributed as dist

    recipe = load_recipe("cpu-tiny", {**SIZES, "routing": routing, "batch_size": 16})
    model = AutoModelForCausalLM.from_config(T.model_config(recipe, stand_in_tokenizer(recipe)))
    params = list(model.parameters())
    layers = [m for m in model.modules() if isinstance(m, LimeDecoderLayer)]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(4 * p.numel() for p in params if id(p) not in in_layers)
    layer = 4 * sum(p.numel() for p in layers[0].parameters())
    ddp = step_memory(recipe, gpu=False, micro_batches=1)
    totals = []
    for world in (2, 4):
        plan = step_memory(recipe, gpu=False, micro_batches=1, fsdp=world)
        assert not dist.is_initialized()
        peak = plan.peak
        assert peak["Sharded Param"] == _shard_bytes(params, world)
        assert peak["OptState"] == 2 * _shard_bytes(params, world) + 4 * len(params)
        assert peak["Sharded Param"] < ddp.peak["Parameter"] / world + 4 * sum(p[0].numel() for p in params)
        assert peak["Unsharded Param"] in {root, root + layer, root + 2 * layer}
        assert peak["Total"] < ddp.peak["Total"]
        totals.append(peak["Total"])
    assert totals[1] < totals[0]


def test_fsdp2_accumulation_holds_whole_gradients():
    """With gradient sync off for all but the last micro-batch (training's ``set_requires_gradient_sync``),
    FSDP2 accumulates gradients unsharded: the second micro-batch runs with every parameter's whole fp32
    gradient held, the model's bytes, not 1/N of them."""
    recipe = load_recipe("cpu-tiny", {**SIZES, "batch_size": 16})
    model = AutoModelForCausalLM.from_config(T.model_config(recipe, stand_in_tokenizer(recipe)))
    plan = step_memory(recipe, gpu=False, micro_batches=2, fsdp=2)
    assert plan.peak["Unsharded Grad"] == 4 * sum(p.numel() for p in model.parameters())


def test_parse_memory():
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("141GB") == 141 * 10**9
    assert parse_memory(" 1.5 tib ") == int(1.5 * 2**40)
    assert parse_memory("4096") == 4096
    for bad in ("", "GiB", "80XB", "-1GB", "0GiB", "80 G iB"):
        with pytest.raises(ValueError, match="--gpu-memory"):
            parse_memory(bad)


TINY = [
    "--set",
    "model.num_hidden_layers=2",
    "--set",
    "seq_len=32",
    "--set",
    "batch_size=8",
    "--set",
    "micro_batch_size=4",
]


def test_cli_prints_and_writes_a_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(
            ["plan", "--recipe", "cpu-tiny", "--gpus", "2", "--gpu-memory", "1MiB", *TINY, "--json", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "recompute_routed_kv=false" in printed and "recompute_routed_kv=true" in printed
    assert "per-GPU peak under FSDP2" in printed and "Sharded Param" in printed
    result = json.loads(out.read_text())
    assert set(result["fsdp2"]) == set(result["ddp"])
    for name, variant in result["fsdp2"].items():  # sharded over 2: less per GPU than DDP's whole copy
        assert variant["per_gpu"] == variant["peak"]["Total"] < result["ddp"][name]["per_gpu"]
        assert variant["margin"] == 2**20 - variant["per_gpu"]
    assert result["tokens_per_step"] == 8 * 32 and result["accumulation"] == 1  # 8 rows over 2 GPUs of 4
    for variant in result["ddp"].values():  # a 1 MiB GPU holds no step; DDP on 2 adds a gradient copy
        assert not variant["fits"] and variant["margin"] == 2**20 - variant["per_gpu"]
        assert variant["ddp_buckets"] == variant["peak"]["Parameter"] > 0
    # Hardware FLOPs, as a GPU's peak counts them: every weight of a linear layer (the tied head too) does
    # one multiply-accumulate per token, two FLOPs, three times (forward, two backward products); attention's
    # two T x T products add 2 x 2 x T x hidden FLOPs per token per layer, again three times.
    recipe = load_recipe("cpu-tiny", {"model.num_hidden_layers": 2, "seq_len": 32, "data": "unused.txt"})
    model = AutoModelForCausalLM.from_config(T.model_config(recipe, stand_in_tokenizer(recipe)))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = 3 * 2 * 2 * 32 * model.config.hidden_size * 2
    assert 6 * linear + attention <= result["flops_per_token"] <= 1.25 * (6 * linear + attention)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu-memory", "80XB"], "--gpu-memory expects a size"),
        (["--mfu", "0"], "--mfu must lie in (0, 1]"),
        (["--mfu", "nan"], "--mfu must lie in (0, 1]"),
        (["--peak-tflops", "-1"], "--peak-tflops"),
        (["--gpus", "3"], "not a multiple of 3 GPUs"),
        (["--set", "model.hidden_size=65"], "hidden_size 65"),
    ],
)
def test_cli_refuses_bad_input(args, message, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--recipe", "cpu-tiny", *TINY, *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not out.exists()
