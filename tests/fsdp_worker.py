"""Gradients of a tiny model sharded with FSDP2 over the current process group
(``lime_model.train.shard``) beside the unsharded model's, for ``test_fsdp.py``. Under torchrun it
writes their relative differences, per routing and parameter, as JSON::

    python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_worker.py OUT.json ROUTING...
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import tiny_model
from torch.distributed.device_mesh import init_device_mesh

from lime_model.evaluate import token_loss_sum
from lime_model.train import shard

ROWS_PER_PROCESS, SEQ_LEN = 2, 16


def gradients(routing: str, **overrides) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Parameter name -> (the sharded model's whole gradient, the unsharded model's) after one backward
    of the same batch: the unsharded model on all rows, each process's shard on its own rows with the
    loss scaled as ``train_step`` scales it (FSDP averages over processes). A 3-layer LIMe (``routing``
    "none": LLaMA), so that a layer's sources include more than one earlier layer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = tiny_model("lime", routing=routing, num_hidden_layers=3, **overrides).train()
    model = shard(copy.deepcopy(reference), init_device_mesh("cpu", (world,)))
    vocab = reference.config.vocab_size
    ids = torch.randint(
        5, vocab, (ROWS_PER_PROCESS * world, SEQ_LEN), generator=torch.Generator().manual_seed(0)
    )
    targets = ids[:, 1:].numel()
    (token_loss_sum(reference(input_ids=ids).logits, ids) / targets).backward()
    rows = ids.chunk(world)[rank]
    (token_loss_sum(model(input_ids=rows).logits, rows) / targets * world).backward()
    return {
        name: (param.grad.full_tensor(), ref.grad)  # full_tensor: a collective, every process calls it
        for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True)
    }


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``|value - reference| / |reference|`` (Frobenius norms); 0 where both are zero."""
    return float((value - reference).norm() / reference.norm().clamp_min(torch.finfo(reference.dtype).tiny))


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out, routings = Path(sys.argv[1]), sys.argv[2:]
    errors = {r: {name: relative_error(*pair) for name, pair in gradients(r).items()} for r in routings}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(errors, indent=1))
    dist.destroy_process_group()
