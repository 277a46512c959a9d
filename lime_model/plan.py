"""A recipe's memory and time plan: one training step run on shape-only tensors, measured by torch's tracker.

The model is built from the recipe as ``lime_model.train.train`` builds it, under
``FakeTensorMode`` (tensors with shapes and dtypes but no data, so a 1B model costs no memory), and
runs training's own step pieces (``lime_model.train.micro_batch_loss``, backward, gradient
clipping, ``lime_model.train.build_optimizer``'s AdamW step) under
``torch.distributed._tools.mem_tracker.MemTracker``, which records every tensor storage alive at each
op by category (parameters, buffers, gradients, activations, backward temporaries, optimizer state).
One optimizer step runs, of ``min(accumulation, 2)`` micro-batches, with AdamW's state made
beforehand (AdamW makes it lazily, in its first step: later steps hold it throughout); a second
micro-batch runs its forward with the first one's gradients held, as gradient accumulation does.

What a GPU run would do differently, and how the plan follows it:

* mixed precision: ``"auto"`` is bf16 on a GPU (train.py); the forward is wrapped as accelerate wraps
  it (autocast, outputs converted to fp32). Only CPU kernels exist here, so autocast is the CPU's; its
  lists differ from CUDA's in details, not in the matmuls it runs in bf16.
* attention: scaled-dot-product attention with a causal flag and no mask (transformers' SDPA path)
  runs the CPU's flash kernel, which keeps for backward what CUDA's flash kernel keeps (output and
  log-sum-exp), not the (T, T) matrix.
* LIMe's K/V buffer is read as on a GPU: one GEMM per contiguous range of source layers (on the CPU,
  training sums pieces of a few layers each, for speed: ``lime_model.kv_buffer.gemm_pieces``).
* AdamW on CUDA takes torch's foreach path by default (its temporaries are counted: the plan asks for
  it); on the CPU the per-tensor loop.
* under DDP every process holds the whole step plus DDP's gradient buckets, one more copy of the
  gradients (accelerate leaves ``gradient_as_bucket_view`` off): added from the parameters' bytes, the
  one number not traced.
* the CUDA caching allocator (a GPU plan only, ``StepMemory.allocator``), so that the plan is
  ``torch.cuda.max_memory_allocated``'s measure and not only tensor bytes. Modelled, each from torch's
  source: the allocator hands out blocks of a multiple of 512 bytes (``kMinBlockSize`` and ``round_size``
  in ``c10/cuda/CUDACachingAllocator.cpp``; MemTracker rounds CUDA storages the same way), so every
  storage alive at the peak is counted rounded up (``block rounding``, and the peak is found on the
  rounded total); and cuBLAS's workspaces, which torch allocates through the caching allocator for each
  cuBLAS handle and stream that runs a GEMM and keeps until ``torch._C._cuda_clearCublasWorkspaces()``
  (``aten/src/ATen/cuda/CublasHandlePool.cpp``; the CUDA notes' "cuBLAS workspaces"): handles are per
  thread, and a training step runs its GEMMs on two threads, the forward's and the autograd engine's
  device thread, on one stream, so ``CUBLAS_HANDLES`` workspaces of
  ``cublas_workspace_bytes`` (32 MiB on a Hopper GPU unless ``CUBLAS_WORKSPACE_CONFIG`` says
  otherwise). Not modelled: the cuBLASLt workspace (1 MiB per handle and stream, only where a GEMM
  takes the Lt path, which is decided at run time); a block left unsplit (the large pool keeps a
  remainder under 1 MiB inside the block it hands out), which depends on the cache's history;
  kernels' internal workspaces (flash attention's backward allocates ``dq_accum``, fp32, the size of
  the query gradient; shape-only tensors run no kernel), which add to the peak only if it falls inside
  that kernel; a compiled graph's buffers (``lime-1b-*`` train eagerly). Not counted either: the CUDA
  context, NCCL's buffers, and what the allocator reserves beyond what it hands out (its 2 MiB and
  20 MiB segments: ``torch.cuda.max_memory_reserved``). Measured, not modelled: ``bench/gpu_check.py``
  compares the plan with ``max_memory_allocated`` of a real step (bench/RESULTS.md).
* under FSDP2 (on 2 GPUs or more) the model is sharded as training shards it
  (``lime_model.train.shard``: each decoder layer a unit, the rest the root's; no
  ``MixedPrecisionPolicy``, so parameters, gradients and AdamW's state stay fp32, autocast as under DDP)
  in a fake process group of N processes, this one rank 0, and measured by
  ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (its categories: sharded and gathered
  parameters and gradients, collectives' buffers). The micro-batches before the last run with gradient
  sync off, as training's do, and FSDP2 then accumulates whole unsharded gradients.

Tokens per step, FLOPs per token (``lime_model.flops.training_flops_per_token``: the paper's count
with each matmul's multiply-accumulates counted twice, as a GPU's peak FLOP/s counts them) and the step time at a stated model-FLOPs utilisation follow from the
recipe; the peak and the utilisation defaults are ours (``DEFAULT_PEAK_TFLOPS``, ``DEFAULT_MFU``).
"""

from __future__ import annotations

import math
import os
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

# ours: the dense bf16 peak of an H100 / H200 SXM (NVIDIA's datasheets: 989 TFLOP/s without sparsity)
DEFAULT_PEAK_TFLOPS = 989.0
DEFAULT_MFU = 0.33  # ours: a third of the peak, a common utilisation for a 1B model on 8 GPUs
DEFAULT_GPU_MEMORY = "80GiB"  # an H100's 80 GB, which are 80 GiB
# torch's CUDA caching allocator hands out blocks of a multiple of this (kMinBlockSize, CUDACachingAllocator.cpp)
BLOCK_BYTES = 512
# cuBLAS handles are per thread: a step's GEMMs run on the forward's thread and the autograd engine's
CUBLAS_HANDLES = 2
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")
# FSDPMemTracker's (its "Inputs" stay empty: the plan counts the input ids as activations, as MemTracker does)
FSDP_CATEGORIES = (
    *("Sharded Param", "Unsharded Param", "Buffer", "Sharded Grad", "Unsharded Grad", "Activation", "Temp"),
    *("All Gather", "Reduce Scatter", "OptState"),
)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """Bytes of a memory size: ``"80GiB"``, ``"141GB"``, ``"80 gib"``, ``"1.5TiB"``, ``"1000000"`` (bytes).
    ValueError naming the text otherwise (a check before torch)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() or "b" if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--gpu-memory expects a size like 80GiB or 141GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def cublas_workspace_bytes(config: str | None = None, hopper: bool = True) -> int:
    """Bytes of one cuBLAS workspace as torch sizes it (``parseChosenWorkspaceSize`` in
    ``aten/src/ATen/cuda/CublasHandlePool.cpp``): ``CUBLAS_WORKSPACE_CONFIG`` (``config``, default the
    environment's), ``:SIZE:COUNT`` pairs in KiB, summed; else 32 MiB on a Hopper GPU (compute capability
    9.0: the H100 and H200 the plan's defaults describe) and ``:4096:2:16:8`` (8 MiB + 128 KiB) on others."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if not pairs:  # torch falls back to its default when the setting does not parse
        return 4096 * 8 * 1024 if hopper else 4096 * 1024 * 2 + 16 * 1024 * 8
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def rounded_block(nbytes: int) -> int:
    """The block the CUDA caching allocator hands out for ``nbytes``: a multiple of ``BLOCK_BYTES``."""
    return math.ceil(nbytes / BLOCK_BYTES) * BLOCK_BYTES


@dataclass(frozen=True)
class StepMemory:
    """One planned training step of one process, in bytes: ``peak`` by MemTracker category (and
    ``Total``) at the step's highest total; ``activations``, the most one micro-batch's forward and
    loss add (what backward keeps, plus the logits and loss); ``kv_buffer``, LIMe's K/V buffer of one
    micro-batch (0 for LLaMA and the baselines); ``allocator``, the CUDA caching allocator's modelled
    bytes beyond the tensors' at the peak (a GPU plan; empty for the CPU): ``"block rounding"``, what
    rounding every storage alive up to a multiple of ``BLOCK_BYTES`` adds, and ``"cuBLAS
    workspaces"`` (module docstring); ``phases``, the highest total (tensor bytes plus block rounding)
    in each part of the step, ``"forward"`` (with the loss), ``"backward"`` and ``"optimizer"``
    (clipping and AdamW), to read against a GPU's allocator peak in each part."""

    peak: dict[str, int]
    activations: int
    kv_buffer: int
    allocator: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The step's peak as the process's allocator would count it: ``peak["Total"]`` plus ``allocator``."""
        return self.peak["Total"] + sum(self.allocator.values())


class _Vocab(SimpleNamespace):
    """What ``lime_model.train.model_config`` reads of a tokenizer: its length and special ids."""

    def __len__(self) -> int:
        return self.size


def stand_in_tokenizer(recipe) -> Any:
    """A stand-in for the recipe's tokenizer (no hub, no data): ``model.vocab_size`` entries, or the
    arithmetic task's own characters."""
    if recipe.model.get("vocab_size") is not None:
        return _Vocab(size=recipe.model["vocab_size"], bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if recipe.task != "arithmetic":
        raise ValueError("the recipe trains its own BPE: set model.vocab_size to plan it")
    from .tasks import arithmetic
    from .tokenization import char_tokenizer

    return char_tokenizer(arithmetic.CHARS)


def step_memory(recipe, *, gpu: bool = True, micro_batches: int = 2, fsdp: int = 0) -> StepMemory:
    """Plan one training step of ``recipe`` on one process (see the module docstring).

    Args:
        recipe: a ``lime_model.recipes.Recipe``.
        gpu: plan for a GPU (``mixed_precision="auto"`` is bf16, AdamW takes the foreach path), else
            for the CPU (``"auto"`` is fp32, AdamW's per-tensor loop), as training would choose.
        micro_batches: micro-batches per optimizer step to run (the process's accumulation, at most this).
        fsdp: shard the model over this many processes with FSDP2 as training does
            (``lime_model.train.shard``), in a fake process group of this one process as rank 0, and
            measure with ``FSDPMemTracker`` (its categories in ``peak``); 0: the whole model, unsharded.
    """
    import torch
    from accelerate.utils import convert_outputs_to_fp32
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from .train import build_optimizer, micro_batch_loss, model_config, shard

    config = model_config(recipe, stand_in_tokenizer(recipe))
    precision = recipe.mixed_precision
    if precision == "auto":
        precision = "bf16" if gpu else "no"
    micro, seq_len = recipe.micro_batch_size, recipe.seq_len
    n_micro = min(micro_batches, recipe.batch_size // (max(fsdp, 1) * micro))
    n_targets = n_micro * micro * (seq_len - 1)
    with (
        _fake_process_group(fsdp) as mesh,
        FakeTensorMode(),
        _masks_of_real_inputs(),
        _kv_buffers(gpu) as buffers,
    ):
        model = AutoModelForCausalLM.from_config(config)
        model.train()
        if mesh is not None:  # before the optimizer, as in training: sharding replaces the parameters
            model = shard(model, mesh)
        if precision != "no":  # as accelerate's prepare_model wraps it
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
            model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(model.forward))
        optimizer = build_optimizer(model, recipe, foreach=True if gpu else None)
        for p in model.parameters():  # AdamW makes its state lazily, in its first step: make it now
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = _peak_tracker(model, optimizer, sharded=mesh is not None, round_blocks=gpu)
        activations = kv_buffer = 0
        with tracker:
            input_ids = torch.zeros(micro, seq_len, dtype=torch.long)
            for i in range(n_micro):
                tracker.reset_mod_stats()  # its per-module statistics take one forward each
                # gradients reduce-scattered on the last micro-batch only, as in training
                if mesh is not None:
                    model.set_requires_gradient_sync(i == n_micro - 1)
                before = _total(tracker)
                tracker.phase = "forward"
                loss = micro_batch_loss(model, input_ids, input_ids, n_targets)
                activations = max(activations, _total(tracker) - before)
                kv_buffer = max([kv_buffer, *(_nbytes(b()) for b in buffers if b() is not None)])
                tracker.phase = "backward"
                loss.backward()
                del loss
            tracker.phase = "optimizer"
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    allocator = {}
    if gpu:
        allocator = {
            "block rounding": tracker.peak_rounding,
            "cuBLAS workspaces": CUBLAS_HANDLES * cublas_workspace_bytes(),
        }
    peak = {_name(k): v for k, v in peak.items()}
    return StepMemory(peak, activations, kv_buffer, allocator, dict(tracker.phase_peaks))


@contextmanager
def _fake_process_group(world: int) -> Iterator[Any]:
    """With ``world`` > 0, a 1-D CPU device mesh over a fake process group of ``world`` processes, this one
    rank 0 (collectives return at once, their outputs' shapes right), destroyed on leaving; else None.
    The mesh is made before ``FakeTensorMode``: it reads its ranks from a real tensor."""
    if not world:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("planning FSDP2 needs its own process group: one is initialised already")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _peak_tracker(model, optimizer, sharded: bool, round_blocks: bool = False):
    """A ``MemTracker`` (``FSDPMemTracker`` for a ``sharded`` model) of ``model`` and ``optimizer`` that
    keeps only the whole step's peak (the per-module peaks, which the plan does not read, cost it most of
    its time: every op scans every module's statistics). With ``round_blocks`` it also keeps what rounding
    each live storage up to ``rounded_block`` adds (``rounding``), finds the peak on the rounded total,
    as the CUDA allocator counts it, and keeps the rounding there (``peak_rounding``); the categories stay
    tensor bytes (the shape-only tensors are the CPU's, which MemTracker does not round). ``phase_peaks``:
    the highest rounded total while ``phase`` (set by the caller) held each value."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType

    base = FSDPMemTracker if sharded else MemTracker

    def slack(nbytes: int) -> int:
        return rounded_block(nbytes) - nbytes if round_blocks else 0

    class PeakTracker(base):  # type: ignore[valid-type, misc]
        rounding = peak_rounding = 0
        phase: str | None = None

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.phase_peaks: dict[str, int] = {}

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if u_type == _UpdateType.ADD:
                self.rounding += slack(winfo.mem_consumed)
            elif u_type == _UpdateType.DEL:
                self.rounding -= slack(winfo.mem_consumed)
            elif u_type == _UpdateType.SIZE:
                self.rounding += slack(winfo.mem_consumed) - slack(old_mem_consumed)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap[_TOTAL_KEY] + self.rounding
                if self.phase is not None:
                    self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), total)
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_rounding = self.rounding

    if sharded:
        return PeakTracker(model, optimizer)
    tracker = PeakTracker()
    tracker.track_external(model, optimizer)
    return tracker


def _name(key: Any) -> str:
    return getattr(key, "value", key)


def _total(tracker) -> int:
    snapshot = tracker.get_tracker_snapshot("current")
    return sum(s["Total"] for s in snapshot.values())


def _nbytes(buffer) -> int:
    return sum(t.untyped_storage().nbytes() for store in buffer.data for t in store)


@contextmanager
def _kv_buffers(gpu: bool) -> Iterator[list]:
    """Weak references to the K/V buffers the model's forwards create inside (each forward its own,
    locally; a strong reference here would keep them alive past their backward). With ``gpu`` the
    buffer lays out and reads its data as on a GPU (one GEMM per source range, one tensor; the CPU's
    pieces and chunks are for CPU speed: ``lime_model.kv_buffer.gemm_pieces``)."""
    from . import kv_buffer, modeling

    made: list = []
    original, pieces = modeling.KVBuffer, kv_buffer.gemm_pieces

    class Recorded(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    modeling.KVBuffer = Recorded  # type: ignore[misc]
    if gpu:
        kv_buffer.gemm_pieces = lambda device: False
    try:
        yield made
    finally:
        modeling.KVBuffer, kv_buffer.gemm_pieces = original, pieces  # type: ignore[misc]


@contextmanager
def _masks_of_real_inputs() -> Iterator[None]:
    """The model's causal mask decided as for real inputs. Training's forward passes no mask and
    positions ``0..T-1``, for which transformers returns no mask (SDPA's causal flag then runs the flash
    kernel); on shape-only tensors it cannot read the positions and builds a full mask instead, which
    sends grouped-query attention through copies of the K/V heads. So the decision is made on real
    stand-ins of the inputs' shapes (no data of any size), and a real "no mask" is kept."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import modeling

    original = modeling.create_causal_mask

    def create_causal_mask(*, config, inputs_embeds, attention_mask, cache, position_ids):
        import torch

        with unset_fake_temporarily():
            B, T = inputs_embeds.shape[:2]
            real = original(
                config=config,
                inputs_embeds=torch.empty(B, T, 0, dtype=inputs_embeds.dtype),
                attention_mask=None,
                cache=None,
                position_ids=torch.arange(T).unsqueeze(0),
            )
        if real is None and attention_mask is None and cache is None:
            return None
        return original(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )

    modeling.create_causal_mask = create_causal_mask
    try:
        yield
    finally:
        modeling.create_causal_mask = original


def plan(
    recipe,
    gpus: int = 8,
    gpu_memory: int = parse_memory(DEFAULT_GPU_MEMORY),
    mfu: float = DEFAULT_MFU,
    peak_tflops: float = DEFAULT_PEAK_TFLOPS,
) -> dict[str, Any]:
    """The plan of ``recipe`` (a ``lime_model.recipes.Recipe``) on ``gpus`` GPUs of ``gpu_memory``
    bytes: per-GPU peak memory under DDP and, on 2 GPUs or more, under FSDP2 as training shards
    (``lime_model.train.shard``; LIMe: each with and without ``recompute_routed_kv``), tokens per
    step, FLOPs per token, step time at ``mfu`` of ``peak_tflops``, GPU-hours, whether it fits. JSON-able."""
    from .flops import training_flops_per_token
    from .recipes import load_recipe
    from .train import model_config

    if recipe.batch_size % (gpus * recipe.micro_batch_size):
        raise ValueError(
            f"batch_size {recipe.batch_size} is not a multiple of {gpus} GPUs x micro_batch_size "
            f"{recipe.micro_batch_size}: choose another --gpus"
        )
    config = model_config(recipe, stand_in_tokenizer(recipe))
    variants = {"as recipe": recipe}
    if config.routing_spec.enabled:
        flag = bool(recipe.model.get("recompute_routed_kv", False))
        variants = {
            f"recompute_routed_kv={str(v).lower()}": load_recipe(recipe, {"model.recompute_routed_kv": v})
            for v in (flag, not flag)
        }
    ddp, fsdp2 = {}, {}
    for name, variant in variants.items():
        step = step_memory(variant)
        buckets = step.peak["Parameter"] if gpus > 1 else 0  # DDP's flat gradient copy (see module doc)
        ddp[name] = {**asdict(step), "ddp_buckets": buckets, **_fit(step.total + buckets, gpu_memory)}
        if gpus > 1:
            step = step_memory(variant, fsdp=gpus)
            fsdp2[name] = {**asdict(step), **_fit(step.total, gpu_memory)}
    tokens_per_step = recipe.batch_size * recipe.seq_len
    flops_per_token = training_flops_per_token(config, recipe.seq_len)
    step_s = tokens_per_step * flops_per_token / (gpus * peak_tflops * 1e12 * mfu)
    steps = recipe.steps
    return {
        "params": sum(p.numel() for p in _meta_model(config).parameters()),
        "gpus": gpus,
        "gpu_memory": gpu_memory,
        "micro_batch_size": recipe.micro_batch_size,
        "seq_len": recipe.seq_len,
        "accumulation": recipe.batch_size // (gpus * recipe.micro_batch_size),
        "ddp": ddp,
        **({"fsdp2": fsdp2} if fsdp2 else {}),
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token,
        "mfu": mfu,
        "peak_tflops": peak_tflops,
        "step_s": step_s,
        "steps": steps,
        "tokens": None if steps is None else steps * tokens_per_step,
        "gpu_hours": None if steps is None else steps * step_s * gpus / 3600,
    }


def overview(recipe) -> dict[str, Any]:
    """``recipe`` at a glance (``lime-model recipes``): ``params``, its model's parameters (counted on
    shape-only tensors, a tied head once); ``tokens``, the token positions it trains on (steps x batch x
    seq_len; an epoch-based arithmetic recipe: epochs x its expressions x seq_len; None for an
    epoch-based text recipe, whose length is its data's); ``length``, how that reads (``"200 steps of 16
    x 64"``); ``purpose``, its description."""
    from .train import model_config

    config = model_config(recipe, stand_in_tokenizer(recipe))
    per_row = recipe.seq_len
    if recipe.steps is not None:
        tokens: float | None = recipe.steps * recipe.batch_size * per_row
        length = f"{recipe.steps:,} steps of {recipe.batch_size} x {per_row}"
    elif recipe.task == "arithmetic":
        rows = recipe.arithmetic.train_per_tier * len(recipe.arithmetic.operators)
        tokens = recipe.epochs * rows * per_row
        length = f"{recipe.epochs:g} epochs of {rows:,} expressions x {per_row}"
    else:
        tokens, length = None, f"{recipe.epochs:g} epochs of the data x {per_row}"
    return {
        "params": sum(p.numel() for p in _meta_model(config).parameters()),
        "tokens": tokens,
        "length": length,
        "purpose": recipe.description,
    }


def _fit(total: int, gpu_memory: int) -> dict[str, Any]:
    return {"per_gpu": total, "fits": total <= gpu_memory, "margin": gpu_memory - total}


def _meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def size(n: float) -> str:
    """Bytes as GiB, MiB or KiB, whichever keeps 3 digits or more."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def format_plan(name: str, p: dict[str, Any]) -> str:
    """A plan (``plan``'s dict) as a few readable lines and a table per strategy, one row per variant."""
    lines = [
        f"{name}: {p['params'] / 1e6:.1f}M parameters; {p['gpus']} GPU(s) of {size(p['gpu_memory'])}; "
        f"micro-batch {p['micro_batch_size']} x {p['seq_len']} tokens, {p['accumulation']} per GPU per step",
        "per-GPU peak under DDP: tensor bytes (MemTracker's categories at the step's peak) and the CUDA "
        "allocator's block rounding and cuBLAS workspaces:",
        *_table(p["ddp"], CATEGORIES, {"DDP buckets": "ddp_buckets"}),
    ]
    if "fsdp2" in p:
        lines.append(
            "per-GPU peak under FSDP2: tensor bytes (FSDPMemTracker's categories at the step's peak) and "
            "the CUDA allocator's:"
        )
        lines += _table(p["fsdp2"], FSDP_CATEGORIES, {})
    lines.append(
        f"tokens/step {p['tokens_per_step']:,}; training FLOPs/token {p['flops_per_token']:.4g}; step "
        f"{p['step_s']:.3g} s at {p['mfu']:.0%} MFU of {p['peak_tflops']:g} TFLOP/s per GPU"
        + ("" if p["gpu_hours"] is None else f"; {p['steps']:,} steps: {p['gpu_hours']:.3g} GPU-hours")
    )
    return "\n".join(lines)


def _table(variants: dict[str, Any], categories: tuple[str, ...], extra: dict[str, str]) -> list[str]:
    """Rows of one strategy's variants: the peak's ``categories``, the ``extra`` columns (header -> key), the
    per-GPU total and its fit, the K/V buffer and the activations."""
    header = [
        "variant",
        *categories,
        "allocator",
        *extra,
        "per GPU",
        "fits",
        "margin",
        "K/V buffer",
        "activations",
    ]
    rows = [header]
    for variant, d in variants.items():
        rows.append(
            [
                variant,
                *(size(d["peak"].get(c, 0)) for c in categories),
                size(sum(d["allocator"].values())),
                *(size(d[key]) for key in extra.values()),
                size(d["per_gpu"]),
                "yes" if d["fits"] else "NO",
                size(d["margin"]),
                size(d["kv_buffer"]),
                size(d["activations"]),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
