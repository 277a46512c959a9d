"""``bench/gpu_check.py``'s step section: Table 17's rows, LIMe's compiled training step over LLaMA's at the
1B shapes, each model compiled once (mostly ahead of its row, by compile workers and by the section itself
while it waits: ``CompileQueue``), with one profiled step of LLaMA and of full routing to show where the
routed read's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_sections import VARIANTS, Context, timed  # noqa: E402
from gpu_targets import STEP_TARGETS  # noqa: E402
from step_overhead import Steps, sync  # noqa: E402

from lime_model import kv_read  # noqa: E402
from lime_model.files import atomic_write  # noqa: E402
from lime_probe.probes.stats import median_ci  # noqa: E402


def step_args(s: dict[str, Any], shape: str) -> argparse.Namespace:
    """``bench/step_overhead.py``'s arguments for its ``Steps`` at this run's size."""
    return argparse.Namespace(
        vocab=s["vocab"], hidden=s["hidden"], layers=s["layers"], heads=s["heads"], kv_heads=s["kv"][shape],
        batch=s["batch"], seq=s["seq"], device=s["device"], dtype=s["dtype"], compile=True,
        compile_backend=s["backend"],
    )  # fmt: skip


CACHE_COUNTERS = (
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
)


def compiled_steps(s: dict[str, Any], shape: str, routing: str) -> tuple[Steps, dict[str, Any]]:
    """One model's ``Steps``, compiled by its first step: the seconds that took and the compile caches'
    hits and misses meanwhile (a model a worker compiled before hits AOTAutograd's and Inductor's caches)."""
    from torch._dynamo.utils import counters

    steps = Steps(routing, step_args(s, shape))
    before = [counters[group][key] for group, key in CACHE_COUNTERS]
    seconds = timed(lambda: steps.run("model"), s["device"])
    after = [counters[group][key] for group, key in CACHE_COUNTERS]
    hits = {key: a - b for (_, key), a, b in zip(CACHE_COUNTERS, after, before, strict=True)}
    return steps, {"seconds": seconds, **hits}


def top_kernels(steps: Steps, device: str, top: int = 15) -> dict[str, Any]:
    """One profiled training step of ``steps``' model (after one unprofiled): its ``top`` kernels by
    self time (on the CPU, operators), each with its calls, the total over all of them, and
    ``routed_read_ms``: the time inside the routed read's operators under ``torch.compile`` (forward and
    backward; on a GPU their kernels' device time, on the CPU their operators' time), in ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    steps.run("model")
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        steps.run("model")
        sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    # on a GPU the kernels only (a CPU operator's self device time repeats its kernels')
    events = [e for e in averages if getattr(e, key) > 0 and (not cuda or e.device_type == DeviceType.CUDA)]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    inside = "device_time_total" if cuda else "cpu_time_total"
    return {
        "total_ms": sum(getattr(e, key) for e in events) / 1e3,
        "top": [{"name": e.key, "ms": getattr(e, key) / 1e3, "calls": e.count} for e in events[:top]],
        "routed_read_ms": sum(getattr(e, inside) for e in averages if e.key.startswith(ROUTED_READ)) / 1e3,
    }


ROUTED_READ = f"{kv_read._LIB}::"  # the compiled read's operators, as the profiler names them


def step_memory(steps: Steps, device: str) -> int | None:
    """The allocator's peak during one training step of ``steps``' model above the bytes allocated when
    it began (the parameters of the row's models), in bytes: what the step itself holds at its peak,
    activations and gradients (Table 17's peak memory less the weights). None off the GPU."""
    if device != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    steps.run("model")
    sync(device)
    return torch.cuda.max_memory_allocated() - before


PROFILED = ("full",)  # the variants whose rows also profile one step of LLaMA and of the variant


def section(ctx: Context) -> dict[str, Any]:
    """Table 17's rows in order of priority (full at both shapes first): each shape's LLaMA compiled
    once and reused by every row of that shape, each variant compiled once (from the caches a worker
    filled, if one claimed it first), then interleaved rounds (LLaMA, variant, ...) with the workers
    paused. A row of ``PROFILED`` also records where each model's step spends its time (`top_kernels`),
    for the routed read's cost. The body is saved after each row."""
    s, out = ctx.s, {"rows": [], "skipped": []}  # type: ignore[var-annotated]
    # each model is a new module object, which Dynamo guards on: past its recompile limit (8) the
    # later models would silently run eager
    torch._dynamo.config.recompile_limit = 64
    bases: dict[str, tuple[Steps, dict[str, Any]]] = {}
    for variant in VARIANTS:
        for shape in s["kv"]:
            row = f"{shape}:{variant}"
            if not ctx.wants(row):
                continue
            if reason := ctx.skip_reason():
                out["skipped"].append({"row": row, "why": reason})
                continue
            ahead = {}
            for routing in ("none", variant):
                if routing == "none" and shape in bases:
                    continue
                if ctx.warm is not None:
                    ahead[routing] = compiled_ahead(ctx, f"{shape}:{routing}")
                    if reason := ctx.skip_reason():  # spent waiting for the worker
                        break
                built = compiled_steps(s, shape, routing)
                if routing == "none":
                    bases[shape] = built
            if reason:
                out["skipped"].append({"row": row, "why": reason})
                continue
            with ctx.quiet():
                out["rows"].append(timed_row(ctx, bases[shape], built, shape, variant))
            out["rows"][-1]["compile"]["ahead"] = ahead
            del built
            if ctx.device == "cuda":
                torch.cuda.empty_cache()
            ctx.save(out)
    return out


def timed_row(
    ctx: Context,
    base_built: tuple[Steps, dict[str, Any]],
    built: tuple[Steps, dict[str, Any]],
    shape: str,
    variant: str,
) -> dict[str, Any]:
    """One Table 17 row from compiled ``Steps`` of LLaMA and the variant (each with its compile's record):
    the median ratio of their step times over interleaved rounds (twice as many for a row with a target:
    ``gpu_targets.STEP_TARGETS``), its interval, each one's step peak."""
    (base, base_compile), (steps, compile_info) = base_built, built
    base_t, var_t = [], []
    rounds = ctx.s["rounds"] * (2 if (shape, variant) in STEP_TARGETS else 1)
    for _ in range(rounds):
        for model, times in ((base, base_t), (steps, var_t)):
            model.run("model")  # untimed, as step_overhead.time_pair does
            times.append(timed(lambda m=model: m.run("model"), ctx.device))
    ratios = [v / b for v, b in zip(var_t, base_t, strict=True)]
    lo, hi, coverage = median_ci(ratios)
    peak = {"llama": step_memory(base, ctx.device), "variant": step_memory(steps, ctx.device)}
    row = {
        "shape": shape,
        "variant": variant,
        "llama_step_s": statistics.median(base_t),
        "step_s": statistics.median(var_t),
        "ratio": statistics.median(ratios),
        "rounds": rounds,
        "ci": [lo, hi],
        "coverage": coverage,
        "step_peak_bytes": peak,
        "step_peak_ratio": None if peak["llama"] is None else peak["variant"] / peak["llama"],
        "compile": {"llama": base_compile, "variant": compile_info},
    }
    if variant in PROFILED:
        row["profile"] = {"llama": top_kernels(base, ctx.device), variant: top_kernels(steps, ctx.device)}
    return row


@dataclass(frozen=True)
class CompileQueue:
    """The step section's models (``SHAPE:ROUTING``, in its order), compiled ahead of their rows by the
    run's compile workers and by the run itself while it waits for one: whoever claims a model first
    (``SHAPE-ROUTING.claim`` in ``folder``, created exclusively) compiles it by one step, filling torch's
    on-disk compile caches, and writes its record (``SHAPE-ROUTING.json``: who, the compile's seconds,
    with any time its worker spent paused, and the caches' hits and misses; or the error)."""

    folder: Path
    models: tuple[str, ...]

    def _path(self, model: str, suffix: str) -> Path:
        return self.folder / f"{model.replace(':', '-')}.{suffix}"

    def claim(self, model: str) -> bool:
        """Whether this process took ``model`` (no one had)."""
        try:
            self._path(model, "claim").touch(exist_ok=False)
        except FileExistsError:
            return False
        return True

    def claim_next(self) -> str | None:
        """The first model no one has claimed, now claimed by this process; None when none is left."""
        return next((m for m in self.models if self.claim(m)), None)

    def record(self, model: str) -> dict[str, Any] | None:
        path = self._path(model, "json")
        return json.loads(path.read_text()) if path.exists() else None

    def compile(self, s: dict[str, Any], model: str, by: str) -> None:
        """Compile ``model`` by one step, free it, and write its record."""
        shape, routing = model.split(":")
        try:
            steps, info = compiled_steps(s, shape, routing)
            del steps
        except Exception as err:  # e.g. out of memory: the row's own compile then does the rest
            info = {"error": f"{type(err).__name__}: {err}"}
        if s["device"] == "cuda":
            torch.cuda.empty_cache()
        atomic_write(self._path(model, "json"), json.dumps({"by": by, **info}))


HELP_S = 60  # a model's first compile on the H100 took 38-58 s: none is started closer to the deadline


def compiled_ahead(ctx: Context, model: str) -> dict[str, Any] | None:
    """The record of ``model``'s compile ahead of its row, waited for while a worker compiles it (and
    meanwhile the next model no one has claimed compiled here); None when no one had claimed it (the
    row's own compile is the first), or no worker is left to finish it, or the row's time is spent. The
    run helps only while more than ``HELP_S`` are left before its deadline."""
    queue: CompileQueue = ctx.warm.queue
    if queue.claim(model):
        return None
    while (record := queue.record(model)) is None:
        if ctx.skip_reason() or not ctx.warm.alive():
            return queue.record(model)  # a worker may have written it as it exited
        if ctx.deadline - time.perf_counter() > HELP_S and (other := queue.claim_next()) is not None:
            queue.compile(ctx.s, other, by="run")
        else:
            time.sleep(0.5)
    return record


def warm_models(s: dict[str, Any], models: list[str], folder: Path) -> None:
    """A compile worker: compile each of ``models`` that no one has claimed, in order (``CompileQueue``)."""
    torch._dynamo.config.recompile_limit = 64
    queue = CompileQueue(folder, tuple(models))
    while (model := queue.claim_next()) is not None:
        queue.compile(s, model, by=f"worker {os.getpid()}")
