"""Real training steps measured on every process (``real_step.real_step``), for ``test_plan.py``.
Under torchrun it writes, per configuration, each process's (peak, activations) bytes as JSON::

    python -m torch.distributed.run --nproc_per_node=2 tests/plan_worker.py OUT.json '{"NAME": OVERRIDES}'

where OVERRIDES are the recipe fields set on ``cpu-tiny``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from real_step import real_step

from lime_model.recipes import load_recipe

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    measured = {}
    for name, overrides in configs.items():
        mine = real_step(load_recipe("cpu-tiny", overrides))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        measured[name] = every
    if dist.get_rank() == 0:
        out.write_text(json.dumps(measured, indent=1))
    dist.destroy_process_group()
