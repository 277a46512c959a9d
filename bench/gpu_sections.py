"""The sections of ``bench/gpu_check.py``: each takes the run's ``Context`` and returns its JSON body.

A section with rows (parity, memory, step) starts no row once its budget is spent and lists each row it
skipped with the reason; ``--rows`` (``SHAPE:ROUTING``) selects the memory and step rows. The step section
(Table 17) is ``bench/gpu_step.py``'s, the kernel section ``bench/routed_backward.py``'s.
"""

from __future__ import annotations

import cProfile
import gc
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from helpers import tiny_tokenizer  # noqa: E402
from step_overhead import _rss_kb, sync  # noqa: E402

from lime_probe.probes.stats import median_ci  # noqa: E402

VARIANTS = ("full", "first-4", "last-4", "dilated-8")  # Table 17's rows, LLaMA ("none") their baseline
RECIPES = {"gqa": "lime-1b-gqa", "mha": "lime-1b-mha"}


@dataclass
class Context:
    """What a section needs of the run: the settings (``gpu_check.settings``), the time after which it
    starts no row and why (its budget or the run's, spent), the rows selected (None: all), the compile
    workers warming the step's models (or None) and ``save``, which writes a section's body so far into
    the run's JSON (a run killed part-way keeps the rows that finished)."""

    s: dict[str, Any]
    deadline: float
    spent: str
    rows: frozenset[str] | None = None
    warm: Any = None
    save: Callable[[dict[str, Any]], None] = lambda body: None

    @property
    def device(self) -> str:
        return self.s["device"]

    def wants(self, row: str) -> bool:
        return self.rows is None or row in self.rows

    def skip_reason(self) -> str | None:
        """Why no further row starts (a budget spent), or None."""
        return self.spent if time.perf_counter() > self.deadline else None

    def quiet(self) -> AbstractContextManager[Any]:
        """While something is timed: the compile workers paused (their compiles take the host's cores,
        their first steps the device)."""
        return self.warm.paused() if self.warm is not None else nullcontext()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def _config(s: dict[str, Any], routing: str, kv: int, vocab: int | None = None):
    from lime_model import config_for

    return config_for(
        "lime",
        routing=routing,
        vocab_size=vocab or s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=4 * s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=kv,
        max_position_embeddings=s["seq"],
        tie_word_embeddings=True,
    )


def build(s: dict[str, Any], routing: str, vocab: int | None = None, shape: str = "gqa"):
    """A random LIMe (``routing``; "none": LLaMA) at the run's size, fp32, made on the run's device
    (a 1B model's initialisation on the host would cost seconds per model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(s["device"]):
        return AutoModelForCausalLM.from_config(_config(s, routing, s["kv"][shape], vocab))


def section_parity(ctx: Context) -> dict[str, Any]:
    """bf16 autocast against fp32, same weights and tokens, LIMe (full) and LLaMA at the GQA shape."""
    s, rows, skipped = ctx.s, [], []
    for routing in ("full", "none"):
        if reason := ctx.skip_reason():
            skipped.append({"row": f"gqa:{routing}", "why": reason})
            continue
        model = build(s, routing).train()
        ids = torch.randint(0, s["vocab"], (1, s["seq"]), generator=torch.Generator().manual_seed(1))
        ids = ids.to(ctx.device)
        runs = {}
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast(ctx.device, dtype=dtype, enabled=dtype != torch.float32):
                out = model(ids, labels=ids, use_cache=False)
            out.loss.backward()
            grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            runs[dtype] = (out.logits.detach().float(), out.loss.item(), grads)
        (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = runs[torch.float32], runs[torch.bfloat16]
        errors = {n: float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()}
        router = [e for n, e in errors.items() if ".router." in n]
        rows.append(
            {
                "model": "LIMe" if routing == "full" else "LLaMA",
                "logits_rel_error": float((logits - ref_logits).norm() / ref_logits.norm()),
                "loss_fp32": ref_loss,
                "loss_abs_error": abs(loss - ref_loss),
                "grad_rel_error_median": statistics.median(errors.values()),
                "grad_rel_error_max": max(errors.values()),
                "router_grad_rel_error_max": max(router) if router else None,
            }
        )
        del model, runs, grads, ref_grads
    return {"rows": rows, "skipped": skipped}


def section_generate(ctx: Context) -> dict[str, Any]:
    """Greedy ``generate`` of a random LIMe (full, GQA): the tokens with the cache against those without
    (fp32, so that a difference is the cache's, not bf16 rounding's), then tokens per second with and
    without the cache in the run's dtype, batch 1."""
    s = ctx.s
    prompt_len, new = (128, 64) if ctx.device == "cuda" else (8, 8)
    model = build(s, "full").eval()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(4, s["vocab"], (1, prompt_len), generator=gen).to(ctx.device)
    kw: dict[str, Any] = dict(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None
    )

    def greedy(use_cache: bool) -> Any:
        with torch.inference_mode():
            return model.generate(
                prompt, use_cache=use_cache, output_scores=True, return_dict_in_generate=True, **kw
            )

    cached, plain = greedy(True), greedy(False)
    same = (cached.sequences[0, prompt_len:] == plain.sequences[0, prompt_len:]).tolist()
    agree = same.index(False) if False in same else new  # steps on which both took the same path
    score_error = None
    if agree:  # the scores (new, 1, vocab) of the steps both took alike
        a, b = torch.stack(cached.scores[:agree]), torch.stack(plain.scores[:agree])
        score_error = float((a - b).abs().max() / b.abs().max())
    model.to(getattr(torch, s["dtype"]))
    greedy(True)  # warm-up in the run's dtype
    cached_s, plain_s = timed(lambda: greedy(True), ctx.device), timed(lambda: greedy(False), ctx.device)
    return {
        "prompt_tokens": prompt_len,
        "new_tokens": new,
        "tokens_equal": agree == new,
        "first_difference": None if agree == new else agree,
        "score_rel_error_max": score_error,
        "cached_tokens_per_s": new / cached_s,
        "uncached_tokens_per_s": new / plain_s,
    }


def host_waits(fn: Callable[[], Any], device: str) -> int | None:
    """On a GPU, how many operations made the host wait for the device during ``fn()`` (torch's
    synchronisation debug mode, counted as its warnings); None elsewhere."""
    if device != "cuda":
        return None
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@contextmanager
def collected_at_once() -> Iterator[None]:
    """``extract`` collecting each batch's rows before it starts the next (as it did before it overlapped
    the host's conversion of one batch with the device's next forward): the baseline of that overlap."""
    from unittest import mock

    from lime_probe.extraction import tracing

    start = tracing._start_batch

    def serial(*args: Any, **kwargs: Any) -> Callable[[], dict[str, torch.Tensor]]:
        rows = start(*args, **kwargs)()
        return lambda: rows

    with mock.patch.object(tracing, "_start_batch", serial):
        yield


def host_profile(fn: Callable[[], Any], device: str, top: int = 12) -> dict[str, Any]:
    """One call of ``fn`` under cProfile, the device synchronised at the end: its seconds and the ``top``
    functions by their own time (seconds, calls), where the host's share of extraction goes."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    sync(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cum s, ...)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {
        "seconds": sum(v[2] for v in stats.values()),
        "top": [
            {"function": f"{Path(f).name}:{line}({name})", "seconds": v[2], "calls": v[0]}
            for (f, line, name), v in rows
        ],
    }


MIN_ROUNDS = 3  # of extraction against a plain forward, however long they take


def extract_vs_plain(
    hf, tok, s: dict[str, Any], rounds: int, serial: bool = False, deadline: float = math.inf
) -> tuple[dict[str, Any], Any, Any, list]:
    """Tokens per second of a plain forward with ``output_hidden_states`` and of ``lime_probe.extract``
    at values and routed values over the same windows, interleaved for ``rounds`` rounds after a warm-up
    of each (past the third, none that would end with what follows it past ``deadline``); the ratio is
    the median per-round extract / plain time with its interval, and on a GPU the
    host's waits for the device in one call of each (`host_waits`). With ``serial`` also extraction that
    collects each batch before starting the next (`collected_at_once`), in the same rounds, and one
    extraction's host profile (`host_profile`). Returns the numbers, the last extraction
    (``Activations``), the nnsight model and the windows (token ids)."""
    from lime_probe.extraction.loading import wrap
    from lime_probe.extraction.tracing import extract

    model = wrap(hf, tok)
    device = s["device"]
    n_windows, batch = (16, 4) if device == "cuda" else (4, 2)
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(4, len(tok), (n_windows, s["seq"]), generator=gen).tolist()
    acts: dict[str, Any] = {}

    def plain() -> None:
        with torch.inference_mode():
            for i in range(0, n_windows, batch):
                hf(torch.tensor(windows[i : i + batch], device=device), output_hidden_states=True)

    def extraction() -> None:
        acts["a"] = extract(
            model, tok, windows, sites=["values", "routed_values"], batch_size=batch,
            max_length=s["seq"], pretokenized=True, progress=False,
        )  # fmt: skip

    def extraction_serial() -> None:
        with collected_at_once():
            extraction()

    timed_fns = {
        "plain": plain,
        "extract": extraction,
        **({"extract_serial": extraction_serial} if serial else {}),
    }
    for fn in timed_fns.values():  # warm-up
        fn()
    times = {name: [] for name in timed_fns}  # type: ignore[var-annotated]
    for done in range(rounds):
        # what follows the rounds: the host's waits and profile, about three extractions
        left = (
            sum(statistics.median(t) for t in times.values()) + 3 * statistics.median(times["extract"])
            if done
            else 0
        )
        if done >= MIN_ROUNDS and time.perf_counter() + left > deadline:
            break
        for name, fn in timed_fns.items():
            times[name].append(timed(fn, device))
    rounds = len(times["plain"])

    def over_plain(name: str) -> tuple[float, tuple[float, float, float]]:
        ratios = [e / p for p, e in zip(times["plain"], times[name], strict=True)]
        return statistics.median(ratios), median_ci(ratios)

    ratio, (lo, hi, coverage) = over_plain("extract")
    tokens = n_windows * s["seq"]
    numbers = {
        "tokens": tokens,
        "rounds": rounds,
        "batch": batch,
        "plain_forward_tokens_per_s": tokens / statistics.median(times["plain"]),
        "extract_tokens_per_s": tokens / statistics.median(times["extract"]),
        "extract_over_plain_time": ratio,
        "ci": [lo, hi],
        "coverage": coverage,
        "host_waits": {"plain": host_waits(plain, device), "extract": host_waits(extraction, device)},
    }
    if serial:  # the extract section's: the overlap's baseline, and what the host does in one extraction
        numbers["host_profile"] = host_profile(extraction, device)
        serial_ratio, (serial_lo, serial_hi, _) = over_plain("extract_serial")
        numbers["extract_serial_over_plain_time"] = serial_ratio
        numbers["extract_serial_ci"] = [serial_lo, serial_hi]
    return numbers, acts["a"], model, windows


def section_extract(ctx: Context) -> dict[str, Any]:
    """Extraction against a plain forward with the model in the run's dtype (bf16 on the GPU), and the same
    extraction collecting each batch before the next (the overlap's baseline)."""
    tok = tiny_tokenizer()
    dtype = getattr(torch, ctx.s["dtype"])
    hf = build(ctx.s, "full", vocab=len(tok)).to(dtype).eval()
    rounds = 8 if ctx.device == "cuda" else 2  # 8: a 99 % interval of the median, time allowing
    out, acts, _, _ = extract_vs_plain(hf, tok, ctx.s, rounds, serial=True, deadline=ctx.deadline)
    held = {str(acts.held_dtype(site)) for site in acts.sites}
    return {"model_dtype": ctx.s["dtype"], "held_dtypes": sorted(held), **out}


def section_probes(ctx: Context) -> dict[str, Any]:
    """On a random 1B-shape LIMe (full, GQA, fp32 weights): extraction against a plain forward, the
    matrix entropy over every layer's values on the model's device, and the BLiMP probe on mean-pooled
    features."""
    import numpy as np

    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.blimp import blimp_probe
    from lime_probe.probes.entropy import stream_entropy

    tok = tiny_tokenizer()
    hf = build(ctx.s, "full", vocab=len(tok)).eval()
    out, a, model, windows = extract_vs_plain(hf, tok, ctx.s, rounds=2)
    layers = a.layers("values")

    def entropy() -> None:  # where the model is, as `lime-probe entropy` computes it
        for layer in layers:
            stream_entropy(
                lambda layer=layer: a.iter_sequences("values", layer), n_boot=100, device=ctx.device
            )

    entropy_s = timed(entropy, ctx.device)
    # BLiMP's probe on mean-pooled features: half the windows "good", half "bad", paired
    pooled = extract(
        model, tok, windows, sites=["values"], pool="mean", batch_size=out["batch"], max_length=ctx.s["seq"],
        pretokenized=True, progress=False,
    )  # fmt: skip
    half = len(windows) // 2
    good = {layer: pooled["values"][layer][:half].float().numpy() for layer in layers}
    bad = {layer: pooled["values"][layer][half:].float().numpy() for layer in layers}
    start = time.perf_counter()
    probe = blimp_probe(good, bad, np.arange(half), n_splits=2, progress=False)
    probe_s = time.perf_counter() - start
    return {
        **out,
        "layers": len(layers),
        "entropy_tokens_per_s": out["tokens"] * len(layers) / entropy_s,
        "entropy_device": ctx.device,
        "blimp_probe_s": probe_s,
        "blimp_probe_accuracy": [float(x) for x in probe.accuracy_mean],
    }


def recipe_for(s: dict[str, Any], shape: str, routing: str, tiny: bool, **extra: Any):
    """``lime-1b-<shape>`` with ``routing`` (at the toy sizes in the dry run)."""
    from lime_model.recipes import load_recipe

    overrides: dict[str, Any] = {"routing": routing, "data": "unused.txt", "mixed_precision": "auto", **extra}
    if tiny:
        overrides |= {
            "model.num_hidden_layers": s["layers"],
            "model.hidden_size": s["hidden"],
            "model.intermediate_size": 4 * s["hidden"],
            "model.num_attention_heads": s["heads"],
            "model.num_key_value_heads": s["kv"][shape],
            "model.vocab_size": s["vocab"],
            "seq_len": s["seq"],
            "micro_batch_size": s["batch"],
            "batch_size": s["batch"],
        }
    return load_recipe(RECIPES[shape], overrides)


@contextmanager
def one_process_group(device_type: str) -> Iterator[Any]:
    """A process group of this process alone (NCCL on a GPU, else gloo) and its 1-D device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with tempfile.TemporaryDirectory() as folder:
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=0, world_size=1)
        try:
            yield init_device_mesh(device_type, (1,))
        finally:
            dist.destroy_process_group()


def measured_step(recipe, device: str, mesh=None) -> dict[str, Any]:
    """Two training steps of ``recipe``'s model at one micro-batch through the trainer's accelerator
    (bf16 autocast where it trains so; sharded with ``lime_model.distributed.shard`` over ``mesh``
    when given, as training shards); the second step measured (AdamW's state made by the first).

    Returns ``peak`` (bytes; on the GPU torch's allocator peak, on the CPU the rise of the process's
    peak RSS over the step), on the GPU ``phases`` (the allocator's peak in the forward and loss, the
    backward and the optimizer step), ``requested_peak`` (the peak of the bytes asked for, before
    the allocator's rounding) and ``allocated_before`` (bytes still allocated when the row starts, which
    the peak includes: earlier rows' cuBLAS workspaces, kept by design), ``step_s``, the ``losses`` of
    both steps, and for a sharded model ``loss_vs_unsharded`` (the first step's loss minus the unsharded
    model's on the same weights)."""
    from transformers import AutoModelForCausalLM

    from lime_model.distributed import prepare, shard, sharded
    from lime_model.plan import stand_in_tokenizer
    from lime_model.train import accelerator_for, build_optimizer, micro_batch_loss, model_config

    # An earlier row's model outlives its row in a reference cycle (accelerate's autocast wrapper of its
    # forward, set on the model itself) until the cyclic collector runs; uncollected, its parameters
    # would count in this row's peak.
    gc.collect()
    accelerator = accelerator_for(recipe)
    cuda = accelerator.device.type == "cuda"
    out: dict[str, Any] = {"allocated_before": torch.cuda.memory_allocated() if cuda else None}
    torch.manual_seed(0)
    with torch.device(accelerator.device):
        model = AutoModelForCausalLM.from_config(model_config(recipe, stand_in_tokenizer(recipe))).train()
    ids = torch.randint(0, recipe.model["vocab_size"], (recipe.micro_batch_size, recipe.seq_len))
    ids = ids.to(accelerator.device)
    if mesh is not None:
        with torch.no_grad(), accelerator.autocast():
            reference = micro_batch_loss(model, ids, ids, ids.numel()).item()
        model = shard(model, mesh)
        out["sharded"] = sharded(model)
    model, optimizer = prepare(accelerator, model, build_optimizer(model, recipe))
    phases: dict[str, int] = {}
    requested: dict[str, int] = {}

    def phase(name: str) -> None:
        if cuda:
            torch.cuda.synchronize()
            phases[name] = torch.cuda.max_memory_allocated()
            requested[name] = torch.cuda.memory_stats().get("requested_bytes.all.peak", 0)
            torch.cuda.reset_peak_memory_stats()

    def step() -> float:
        loss = micro_batch_loss(model, ids, ids, ids.numel())
        phase("forward")
        accelerator.backward(loss)
        phase("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phase("optimizer")
        return loss.item()

    losses = [step()]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses.append(step())
        out["step_s"] = time.perf_counter() - start
        out |= {
            "peak": max(phases.values()),
            "phases": dict(phases),
            "requested_peak": max(requested.values()),
        }
    else:
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
            f.write("5")
        before, start = _rss_kb("VmRSS"), time.perf_counter()
        losses.append(step())
        out["step_s"] = time.perf_counter() - start
        out["peak"] = (_rss_kb("VmHWM") - before) * 1024
    out["losses"] = losses
    if mesh is not None:
        out["loss_vs_unsharded"] = losses[0] - reference
    accelerator.free_memory(model, optimizer)
    return out


def planned(recipe, gpu: bool, fsdp: int = 0) -> dict[str, Any]:
    """``lime-model plan``'s figures for one micro-batch's step of one process (no DDP copy): the total
    (tensor bytes plus the CUDA allocator's modelled terms), the tensor bytes, those terms, and the
    peak of each part of the step (forward, backward, optimizer) as the allocator would count it."""
    from lime_model.plan import step_memory

    plan = step_memory(recipe, gpu=gpu, micro_batches=1, fsdp=fsdp)
    workspaces = plan.allocator.get("cuBLAS workspaces", 0)  # the phases count the rounding already
    return {
        "planned_bytes": plan.total,
        "planned_tensor_bytes": plan.peak["Total"],
        "allocator": plan.allocator,
        "planned_phases": {name: peak + workspaces for name, peak in plan.phases.items()},
    }


def section_memory(ctx: Context) -> dict[str, Any]:
    """Peak memory of one training step of ``lime-1b-gqa`` / ``-mha``, LIMe and LLaMA, against the plan."""
    rows, skipped = [], []
    for shape in RECIPES:
        for routing in ("full", "none"):
            row = f"{shape}:{routing}"
            if not ctx.wants(row):
                continue
            if reason := ctx.skip_reason():
                skipped.append({"row": row, "why": reason})
                continue
            recipe = recipe_for(ctx.s, shape, routing, ctx.s["tiny"])
            plan = planned(recipe, gpu=ctx.device == "cuda")
            measured = measured_step(recipe, ctx.device)
            rows.append(
                {
                    "recipe": RECIPES[shape],
                    "model": "LIMe" if routing == "full" else "LLaMA",
                    "measured_bytes": measured.pop("peak"),
                    **plan,
                    **measured,
                    "what": "allocator peak" if ctx.device == "cuda" else "peak RSS rise over the step",
                }
            )
            rows[-1]["measured_over_planned"] = rows[-1]["measured_bytes"] / plan["planned_bytes"]
    return {"rows": rows, "skipped": skipped}


def section_fsdp(ctx: Context) -> dict[str, Any]:
    """One LIMe (full, GQA) training step sharded with FSDP2 in a world of one process, through the
    trainer's own path (``lime_model.distributed.shard``, ``prepare``), against the FSDP2 plan."""
    recipe = recipe_for(ctx.s, "gqa", "full", ctx.s["tiny"], fsdp=True)
    plan = planned(recipe, gpu=ctx.device == "cuda", fsdp=1)  # its fake process group, before the real one
    with one_process_group(ctx.device) as mesh:
        measured = measured_step(recipe, ctx.device, mesh)
    peak = measured.pop("peak")
    return {"measured_bytes": peak, **plan, "measured_over_planned": peak / plan["planned_bytes"], **measured}
