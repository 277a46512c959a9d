"""bf16 training on the CPU through the CUDA path (accelerate's autocast), and accelerate's state per run."""

import json
import warnings

import pytest
import torch

from lime_model.recipes import load_recipe
from lime_model.train import SecondEpochWarning, accelerator_for, train

STEPS = 50
# bf16 keeps 8 significant bits (a relative rounding of 2^-9 per operation). Measured on cpu-tiny over
# 50 steps, seeds 0-2: |fp32 - bf16| of the final loss 0.0002-0.0052 nats, of the mean loss
# 0.0002-0.0035, of any one step at most 0.013, against losses of 6.2 falling to 1.4-1.6. The tolerance
# is four times the largest final and mean gaps seen: a step that drifted (a loss not cast back to
# fp32, a bf16 optimizer state) moves them by tenths.
TOLERANCE = 0.02


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_bf16_training_on_the_cpu_stays_within_tolerance_of_fp32(text, tmp_path):
    """50 steps of cpu-tiny in fp32 and under bf16 autocast from the same seed, in one process. A hook
    on every linear layer (written here, not the trainer's) records their outputs' dtypes, so the test
    fails if autocast silently did nothing."""
    seen: dict[str, set[torch.dtype]] = {}

    def record(module, args, output):
        if isinstance(module, torch.nn.Linear):
            seen[precision].add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    runs = {}
    try:
        for precision in ("no", "bf16"):
            seen[precision] = set()
            with warnings.catch_warnings():  # the fixture's text repeats within 50 steps
                warnings.simplefilter("ignore", SecondEpochWarning)
                runs[precision] = train(
                    "cpu-tiny",
                    tmp_path / precision,
                    data=str(text),
                    steps=STEPS,
                    seed=0,
                    log_every=1,
                    mixed_precision=precision,
                    progress=False,
                )
    finally:
        handle.remove()
    assert seen == {"no": {torch.float32}, "bf16": {torch.bfloat16}}
    info = {p: json.loads((run / "run_info.json").read_text())[-1] for p, run in runs.items()}
    assert [info[p]["mixed_precision"] for p in ("no", "bf16")] == ["no", "bf16"]
    fp32, bf16 = losses(runs["no"]), losses(runs["bf16"])
    assert len(fp32) == len(bf16) == STEPS
    assert fp32 != bf16  # bf16 rounding changed the numbers
    assert fp32[-1] < fp32[0] - 3  # both trained: the comparison is not of two flat lines
    assert abs(fp32[-1] - bf16[-1]) <= TOLERANCE
    assert abs(sum(fp32) / STEPS - sum(bf16) / STEPS) <= TOLERANCE
    # the weights are fp32 in both (autocast casts operations, not parameters)
    state = json.loads((runs["bf16"] / "config.json").read_text())
    assert state.get("dtype", state.get("torch_dtype")) in (None, "float32")


def test_each_run_in_a_process_gets_its_own_precision_and_compile_setting(text):
    """accelerate keeps one state per process: before each run reset it, a second run was refused
    another mixed precision, and one asking to compile silently kept the first run's "no"."""
    from accelerate.utils import DynamoBackend

    recipe = load_recipe("cpu-tiny", {"data": str(text)})
    first = accelerator_for(recipe)
    assert (first.mixed_precision, first.state.dynamo_plugin.backend) == ("no", DynamoBackend.NO)
    second = accelerator_for(load_recipe(recipe, {"mixed_precision": "bf16", "compile": True}))
    assert second.mixed_precision == "bf16"
    assert second.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR
    assert accelerator_for(recipe).mixed_precision == "no"
