"""A real training step's allocated bytes, for the plan's tests (``test_plan.py``; ``plan_worker.py`` on
several processes).

The step is training's own (``lime_model.train.train_step`` through accelerate, the second step, so
that AdamW's state exists), measured by the profiler's record of the CPU allocator's allocations and frees
(``profile_memory``): the running sum of allocated bytes, its highest value during the step, and, per
micro-batch, what it gained between the model's forward starting and backward starting (markers recorded
by hooks written here). Nothing of the plan's code measures it.
"""

from __future__ import annotations

import bisect

import torch
from accelerate.state import AcceleratorState
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM

from lime_model import train as T

STEP, FORWARD, BACKWARD = "measured step", "forward starts", "backward starts"
UNSEEN = 1024  # bytes of blocks freed where the profiler did not see (see _allocations)


class Vocab:
    """What ``lime_model.train.model_config`` reads of a tokenizer, for a recipe that sets
    ``model.vocab_size``."""

    bos_token_id = eos_token_id = 0
    pad_token_id = None

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def real_step(recipe) -> tuple[int, int]:
    """(peak allocated bytes of this process during a real second training step, the most one
    micro-batch's forward and loss added before its backward). In a process group of several processes
    (torchrun) the step is this process's share, and with ``recipe.fsdp`` the model is sharded as
    ``lime_model.train.train`` shards it (``lime_model.train.shard``, before the optimizer)."""
    AcceleratorState._reset_state(reset_partial_state=True)  # each configuration its own precision
    accelerator = T.accelerator_for(recipe)
    vocab = Vocab(recipe.model["vocab_size"])
    torch.manual_seed(0)
    rows = torch.randint(0, len(vocab), (2 * recipe.batch_size, recipe.seq_len))
    data = T.TrainingData(vocab, rows, rows)
    world = accelerator.num_processes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = AutoModelForCausalLM.from_config(T.model_config(recipe, vocab))
        model.train()
        if recipe.fsdp and world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            model = T.shard(model, init_device_mesh(accelerator.device.type, (world,)))
        optimizer = T.build_optimizer(model, recipe)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        model, optimizer = T.prepare(accelerator, model, optimizer)
        T.train_step(accelerator, model, optimizer, scheduler, data, recipe, 0)  # AdamW makes its state

        def marker(name):
            with record_function(name):
                pass

        # before any hook of FSDP2's (its root gathers the root's parameters as the forward starts)
        model.register_forward_pre_hook(lambda *_: marker(FORWARD), prepend=True)
        backward = accelerator.backward
        accelerator.backward = lambda loss, **kw: (marker(BACKWARD), backward(loss, **kw))
        with record_function(STEP):
            T.train_step(accelerator, model, optimizer, scheduler, data, recipe, 1)
    peak, activations = allocated(prof.profiler.kineto_results.experimental_event_tree())
    assert len(activations) == recipe.batch_size // (world * recipe.micro_batch_size)
    return peak, max(activations)


def allocated(tree) -> tuple[int, list[int]]:
    """From a profile's event tree: the highest running sum of allocated bytes within the ``STEP``
    range, and what it gained from each ``FORWARD`` marker to the next ``BACKWARD`` one."""
    events = list(_walk(tree))
    times, held, total = [], [], 0
    for t, nbytes in _allocations(events):
        total += nbytes
        times.append(t)
        held.append(total)

    def at(t: int) -> int:
        i = bisect.bisect_right(times, t)
        return held[i - 1] if i else 0

    (step,) = [e for e in events if e.name == STEP]
    peak = max(h for t, h in zip(times, held, strict=True) if step.start_time_ns <= t <= step.end_time_ns)
    starts = {name: sorted(e.start_time_ns for e in events if e.name == name) for name in (FORWARD, BACKWARD)}
    assert len(starts[FORWARD]) == len(starts[BACKWARD])
    return peak, [at(b) - at(f) for f, b in zip(starts[FORWARD], starts[BACKWARD], strict=True)]


def _allocations(events) -> list[tuple[int, int]]:
    """(time, bytes) of every allocation (bytes > 0) and free (< 0) of the profile, in time order, as
    the profiler recorded them but for collectives' blocks, some of whose frees it misses: it records a
    free only on a thread where it runs, and gloo's threads hold the tensors of the collectives they run
    and sometimes release them last.

    * The blocks a collective (a ``c10d::`` or ``gloo:`` op) allocates inside it, gloo's own copies of
      its inputs and outputs, are left out: NCCL makes none (it writes into the tensors FSDP2 hands it),
      nor does the plan's fake process group.
    * FSDP2's all-gather outputs (allocated in an ``FSDP::all_gather`` record) are freed as the unit's
      parameters are copied out of them (its ``FSDP::all_gather_copy_out`` record), where a free not
      recorded is put.
    * Any other block whose free went unrecorded shows as its address allocated again while held: it is
      freed there, and at most ``UNSEEN`` bytes of such blocks are allowed (a functional
      collective's output, the gradient norm, is one: a few bytes).
    """
    copy_outs: dict[str, list] = {}
    for e in events:
        if e.name.startswith("FSDP::all_gather_copy_out"):
            copy_outs.setdefault(e.name, []).append(e)
    for records in copy_outs.values():
        records.sort(key=lambda e: e.start_time_ns)
    by_address: dict[int, list] = {}
    for e in sorted((e for e in events if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns):
        by_address.setdefault(e.extra_fields.ptr, []).append(e)
    out, unseen = [], 0
    for blocks in by_address.values():
        for i, e in enumerate(blocks):
            nbytes = e.extra_fields.alloc_size
            if nbytes < 0:
                continue
            free = (
                blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1].extra_fields.alloc_size < 0 else None
            )
            ops = _ops(e)
            if any(op.startswith(("c10d::", "gloo:")) for op in ops):
                continue
            out.append((e.start_time_ns, nbytes))
            gather = next((op for op in reversed(ops) if op.split(" (")[0] == "FSDP::all_gather"), None)
            if free is not None:
                out.append((free.start_time_ns, -nbytes))
            elif gather is not None:
                name = gather.replace("FSDP::all_gather", "FSDP::all_gather_copy_out", 1)
                copy_out = next(c for c in copy_outs[name] if c.start_time_ns > e.start_time_ns)
                out.append((copy_out.end_time_ns, -nbytes))
            elif i + 1 < len(blocks):  # its address in use again: it was freed
                out.append((blocks[i + 1].start_time_ns, -nbytes))
                unseen += nbytes
                assert unseen <= UNSEEN, f"the free of a block {' > '.join(ops)} allocated was not recorded"
    return sorted(out)


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def _ops(event) -> list[str]:
    """The ops an event ran in, outermost first."""
    names = []
    while (event := event.parent) is not None:
        names.append(event.name)
    return names[::-1]
