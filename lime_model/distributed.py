"""How a run spreads over processes and reports: accelerate's ``Accelerator`` for a recipe, FSDP2
sharding, gradient synchronisation, work done by the main process alone, and the trackers.

Distributed runs go through `accelerate` (``torchrun`` or ``accelerate launch``): DDP, or, when the
recipe sets ``fsdp``, PyTorch's FSDP2 (``fully_shard``, applied here on CPUs and GPUs alike:
``shard``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from .checks import BAD_INPUT, one_line
from .modeling import LimeDecoderLayer
from .recipes import Recipe

_T = TypeVar("_T")


def sharded(model) -> bool:
    """Whether ``model`` is sharded with FSDP2 (``shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def accelerator_for(recipe: Recipe, **tracking: Any):
    """The ``accelerate.Accelerator`` of a recipe: its mixed precision ("auto": bf16 where supported) and
    compile; ``tracking``: the trackers' arguments (``tracker_options``). FSDP is not accelerate's
    (its plugin shards only on GPUs): ``shard`` applies it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin

    # accelerate keeps one state per process: a second run in it would be refused another mixed precision
    # and would silently keep the first run's compile setting. Each run starts its own (the process
    # group, PartialState's, is kept).
    AcceleratorState._reset_state()
    precision = recipe.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    dynamo = TorchDynamoPlugin(backend="inductor") if recipe.compile else None
    # cpu=True is what makes accelerate join a torchrun/accelerate-launch group over gloo without GPUs
    accelerator = Accelerator(
        mixed_precision=precision,
        dynamo_plugin=dynamo,
        cpu=not torch.cuda.is_available(),
        **tracking,
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise RuntimeError(f"launched {launched} processes but accelerate joined {accelerator.num_processes}")
    return accelerator


def shard(model, mesh):
    """``model`` sharded over ``mesh``'s processes with FSDP2 (``fully_shard``, in place): each
    decoder layer a unit whose parameters are gathered for its forward and again for its backward, the
    rest (embeddings, final norm, head) the root's. LIMe's K/V buffer keeps copies of the router
    weights that earlier layers' backward reads (``lime_model.kv_buffer._own_copy``). ``mesh``: a
    1-D device mesh (``init_device_mesh(device.type, (world,))``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in [m for m in model.modules() if isinstance(m, LimeDecoderLayer)]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def prepare(accelerator, model, optimizer):
    """The model and optimizer through accelerate; a sharded model only gets its mixed precision
    (autocast, as under DDP): accelerate would wrap it in DDP."""
    if not sharded(model):
        return accelerator.prepare(model, optimizer)
    return accelerator.prepare_model(model, evaluation_mode=True), accelerator.prepare_optimizer(optimizer)


@contextmanager
def no_sync(accelerator, model):
    """No gradient synchronisation inside (a micro-batch that is not the last): DDP's ``no_sync``, or
    FSDP2's switch, which accelerate's ``no_sync`` sets only on models it sharded itself."""
    if not sharded(model):
        with accelerator.no_sync(model):
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


REPORT_TO = ("none", "tensorboard", "wandb")
TRACKER_PROJECT = "lime-model"  # the W&B project; TensorBoard's events go to RUN/tensorboard/lime-model/


def tracker_options(report_to: str, out_dir: Path) -> dict[str, Any]:
    """``Accelerator`` arguments that log to ``report_to`` (one of ``REPORT_TO``). A tracker whose
    package is missing is refused here: accelerate would silently skip it."""
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to must be one of {', '.join(REPORT_TO)}, got {report_to!r}")
    if report_to == "none":
        return {}
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    if not {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}[report_to]():
        extra = "pip install 'lime-probe[tracking]'" if report_to == "tensorboard" else "pip install wandb"
        raise ValueError(f"--report-to {report_to} needs the {report_to} package: {extra}")
    return {"log_with": report_to, "project_dir": str(out_dir / "tensorboard")}


def hparams(recipe: Recipe) -> dict[str, Any]:
    """The recipe flattened to dotted keys and scalar values, as trackers take hyperparameters."""

    def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
        return out

    return flat(recipe.to_dict())


def on_main(accelerator, work: Callable[[], _T]) -> _T:
    """``work()`` on the main process (the one that writes the run directory); its result on every
    process, and its failure too, so that no process waits for one that has stopped (the others raise
    ValueError for a bad input or a full disk, as ``lime_model.checks.BAD_INPUT`` counts them, else
    RuntimeError, with the main process's line)."""
    outcome: list[Any] = [None, None, False]  # result, error line, whether the error is bad input
    if accelerator.is_main_process:
        try:
            outcome[0] = work()
        except Exception as e:
            outcome[1:] = [one_line(e), isinstance(e, BAD_INPUT)]  # as text: not every exception pickles
            _broadcast(accelerator, outcome)
            raise
    _broadcast(accelerator, outcome)
    if outcome[1] is not None:
        raise (ValueError if outcome[2] else RuntimeError)(f"the main process stopped: {outcome[1]}")
    return outcome[0]


def _broadcast(accelerator, objects: list) -> None:
    """``objects`` made the main process's on every process (in place)."""
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(objects)
