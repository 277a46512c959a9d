"""``bench/gpu_check.py``'s step section: Table 17's rows, LIMe's compiled training step over LLaMA's at the
1B shapes, each model compiled once (and ahead of the section by compile workers, ``warm_models``), with
one profiled step of LLaMA and of full routing to show where the routed read's time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_sections import VARIANTS, Context, timed  # noqa: E402
from step_overhead import Steps, sync  # noqa: E402

from lime_model import kv_read  # noqa: E402
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
    once and reused by every row of that shape, each variant compiled once (after its compile worker,
    if any, filled the caches), then interleaved rounds (LLaMA, variant, ...). A row of ``PROFILED``
    also records where each model's step spends its time (`top_kernels`), for the routed read's cost."""
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
            compile_s = {}
            for routing in ("none", variant):
                if routing == "none" and shape in bases:
                    continue
                if ctx.warm is not None:
                    compile_s[routing] = ctx.warm.wait(f"{shape}:{routing}", ctx.deadline)
                    if reason := ctx.skip_reason():  # spent waiting for the worker
                        break
                built = compiled_steps(s, shape, routing)
                if routing == "none":
                    bases[shape] = built
            if reason:
                out["skipped"].append({"row": row, "why": reason})
                continue
            base, base_compile = bases[shape]
            steps, compile_info = built
            base_t, var_t = [], []
            for _ in range(s["rounds"]):
                for model, times in ((base, base_t), (steps, var_t)):
                    model.run("model")  # untimed, as step_overhead.time_pair does
                    times.append(timed(lambda m=model: m.run("model"), ctx.device))
            ratios = [v / b for v, b in zip(var_t, base_t, strict=True)]
            lo, hi, coverage = median_ci(ratios)
            peak = {"llama": step_memory(base, ctx.device), "variant": step_memory(steps, ctx.device)}
            out["rows"].append(
                {
                    "shape": shape,
                    "variant": variant,
                    "llama_step_s": statistics.median(base_t),
                    "step_s": statistics.median(var_t),
                    "ratio": statistics.median(ratios),
                    "ci": [lo, hi],
                    "coverage": coverage,
                    "step_peak_bytes": peak,
                    "step_peak_ratio": None if peak["llama"] is None else peak["variant"] / peak["llama"],
                    "compile": {"llama": base_compile, "variant": compile_info, "workers": compile_s},
                }
            )
            if variant in PROFILED:
                out["rows"][-1]["profile"] = {
                    "llama": top_kernels(base, ctx.device),
                    variant: top_kernels(steps, ctx.device),
                }
            del steps, built
            if ctx.device == "cuda":
                torch.cuda.empty_cache()
    return out


def warm_models(s: dict[str, Any], models: list[str], folder: Path) -> None:
    """A compile worker: compile each ``SHAPE:ROUTING`` model by one step, in order, filling the compile
    caches the run's own compiles then read, and write ``folder/SHAPE-ROUTING.json`` after each (its
    seconds, or the error)."""
    import json

    from lime_model.files import atomic_write

    torch._dynamo.config.recompile_limit = 64
    for model in models:
        shape, routing = model.split(":")
        try:
            steps, info = compiled_steps(s, shape, routing)
            del steps
        except Exception as err:  # e.g. out of memory beside the run: the run compiles it itself
            info = {"error": f"{type(err).__name__}: {err}"}
        if s["device"] == "cuda":
            torch.cuda.empty_cache()
        atomic_write(folder / f"{shape}-{routing}.json", json.dumps(info))
