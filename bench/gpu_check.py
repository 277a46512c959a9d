"""The GPU check: one script, one JSON, sized to run in under 8 minutes on one H200.

Sections, each timed and given a budget (printed at the start; a section past its budget starts no
further row, finishing the one under way, and lists those it skipped):

- ``step``: Table 17's step time (App. I: H100, 1B, PyTorch Inductor) in bf16 with ``torch.compile``,
  forward + backward of the whole model (``bench/step_overhead.py``'s ``model`` scope and its
  ``Steps``), LIMe full, first-4, last-4 and dilated-8 against LLaMA at the 1B GQA and MHA shapes
  (Table 3-4: 16 layers, hidden 2048, 32 heads, 8 or 32 K/V heads), 4 x 2048 tokens (Table 3's
  micro-batch in ``lime-1b-*``); the ratio is the median over interleaved rounds of variant / LLaMA
  with its order-statistic interval. The paper's: full +10.5 % (MHA), +1.16 % (GQA), default mode +1.6 %.
- ``parity``: a LIMe (and, beside it, a LLaMA) forward and backward under bf16 autocast against fp32
  from the same weights: relative error of the logits, the loss and every gradient (norm of the
  difference over the norm of the fp32 one), so LIMe's is read against LLaMA's.
- ``memory``: peak GPU memory of one training step (forward, backward, AdamW step after a first one,
  bf16 autocast as training runs it) of the ``lime-1b-gqa`` and ``lime-1b-mha`` recipes at one micro-batch,
  LIMe and LLaMA, against ``lime-model plan``'s figure for the same step
  (``lime_model.plan.step_memory(recipe, gpu=True, micro_batches=1).peak["Total"]``, bytes; in the dry run
  the CPU's plan against the rise of the process's peak RSS).
- ``probes``: on a random 1B-shape LIMe (full), tokens per second of a plain forward with
  ``output_hidden_states``, of ``lime_probe.extract`` at values and routed values (their ratio to the
  plain forward), of the matrix entropy over every layer's values, and of the BLiMP probe's
  cross-validated logistic regression on mean-pooled features (random pairs: the accuracy is chance).

Needs no network and no data: random weights, random tokens, the tests' tiny tokenizer for extraction.

    python bench/gpu_check.py --out gpu_check.json            # on the GPU (bench/RESULTS.md)
    python bench/gpu_check.py --dry-run --out /tmp/check.json  # every section at toy size, on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from helpers import tiny_tokenizer  # noqa: E402
from step_overhead import Steps, _rss_kb, sync  # noqa: E402

from lime_probe.probes.stats import median_ci  # noqa: E402

VARIANTS = ("full", "first-4", "last-4", "dilated-8")
# Table 3-4's 1B model; "kv" is the K/V heads of the GQA and MHA shapes
FULL = dict(layers=16, hidden=2048, heads=32, vocab=50257, batch=4, seq=2048, kv={"gqa": 8, "mha": 32})
TOY = dict(layers=3, hidden=32, heads=4, vocab=64, batch=1, seq=16, kv={"gqa": 2, "mha": 4})
BUDGETS = {"step": 300, "parity": 30, "memory": 60, "probes": 60}  # seconds, on one H200: 450 of 480
RECIPES = {"gqa": "lime-1b-gqa", "mha": "lime-1b-mha"}


def settings(dry_run: bool) -> dict[str, Any]:
    """The run's sizes and options: the GPU's, or toy ones on the CPU (``--dry-run``)."""
    if not dry_run:
        return {**FULL, "device": "cuda", "dtype": "bfloat16", "backend": "inductor", "rounds": 10}
    # the CPU compiles with Dynamo alone ("eager"): Inductor's C++ takes minutes on a small machine
    dtype = "bfloat16" if torch.backends.mkldnn.is_available() else "float32"
    return {**TOY, "device": "cpu", "dtype": dtype, "backend": "eager", "rounds": 2}


def step_args(s: dict[str, Any], kv: int) -> argparse.Namespace:
    """``bench/step_overhead.py``'s arguments for its ``Steps`` at this run's size."""
    return argparse.Namespace(
        vocab=s["vocab"],
        hidden=s["hidden"],
        layers=s["layers"],
        heads=s["heads"],
        kv_heads=kv,
        batch=s["batch"],
        seq=s["seq"],
        device=s["device"],
        dtype=s["dtype"],
        compile=True,
        compile_backend=s["backend"],
    )


def timed(fn: Callable[[], None], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def section_step(s: dict[str, Any], deadline: float) -> dict[str, Any]:
    """Rows in order of priority, full at both shapes first (Table 17's headline numbers): each shape's
    LLaMA compiled once, each variant compiled, then interleaved rounds (LLaMA, variant, ...)."""
    out: dict[str, Any] = {"rows": [], "skipped": []}
    # each model is a new module object, which Dynamo guards on: past its recompile limit (8) the
    # later models would silently run eager
    torch._dynamo.config.recompile_limit = 64
    bases: dict[str, tuple[Steps, float]] = {}  # shape -> (compiled LLaMA, its compile seconds)
    for variant in VARIANTS:
        for shape, kv in s["kv"].items():
            if time.perf_counter() > deadline:
                out["skipped"].append(f"{shape} {variant}")
                continue
            args = step_args(s, kv)
            if shape not in bases:
                base = Steps("none", args)
                bases[shape] = (base, timed(lambda b=base: b.run("model"), s["device"]))  # compiles
            base, base_compile_s = bases[shape]
            steps = Steps(variant, args)
            compile_s = timed(lambda m=steps: m.run("model"), s["device"])
            base_t, var_t = [], []
            for _ in range(s["rounds"]):
                for model, times in ((base, base_t), (steps, var_t)):
                    model.run("model")  # untimed, as step_overhead.time_pair does
                    times.append(timed(lambda m=model: m.run("model"), s["device"]))
            ratios = [v / b for v, b in zip(var_t, base_t, strict=True)]
            lo, hi, coverage = median_ci(ratios)
            out["rows"].append(
                {
                    "shape": shape,
                    "variant": variant,
                    "llama_step_s": statistics.median(base_t),
                    "step_s": statistics.median(var_t),
                    "ratio": statistics.median(ratios),
                    "ci": [lo, hi],
                    "coverage": coverage,
                    "compile_s": {"llama": base_compile_s, "variant": compile_s},
                }
            )
            del steps
            if s["device"] == "cuda":
                torch.cuda.empty_cache()
    return out


def _config(s: dict[str, Any], routing: str, kv: int):
    from lime_model import config_for

    return config_for(
        "lime",
        routing=routing,
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=4 * s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=kv,
        max_position_embeddings=s["seq"],
        tie_word_embeddings=True,
    )


def section_parity(s: dict[str, Any], deadline: float) -> dict[str, Any]:
    """bf16 autocast against fp32, same weights and tokens, LIMe (full) and LLaMA at the GQA shape."""
    from transformers import AutoModelForCausalLM

    rows = []
    for routing in ("full", "none"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(s, routing, s["kv"]["gqa"])).to(s["device"]).train()
        ids = torch.randint(0, s["vocab"], (1, s["seq"]), generator=torch.Generator().manual_seed(1))
        ids = ids.to(s["device"])
        runs = {}
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast(s["device"], dtype=dtype, enabled=dtype != torch.float32):
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
        del model
    return {"rows": rows}


def planned_bytes(recipe, gpu: bool) -> int:
    """``lime-model plan``'s peak bytes for one micro-batch's training step of one process (no DDP copy)."""
    from lime_model.plan import step_memory

    return int(step_memory(recipe, gpu=gpu, micro_batches=1).peak["Total"])


def measured_peak(recipe, device: str) -> int:
    """Peak bytes of the second of two training steps of ``recipe``'s model at one micro-batch (AdamW's
    state made by the first), through the trainer's accelerator (bf16 autocast where it trains so).
    On the GPU torch's allocator peak; on the CPU the rise of the process's peak RSS over the step."""
    from transformers import AutoModelForCausalLM

    from lime_model.plan import stand_in_tokenizer
    from lime_model.train import accelerator_for, build_optimizer, micro_batch_loss, model_config

    accelerator = accelerator_for(recipe)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(recipe, stand_in_tokenizer(recipe))).train()
    optimizer = build_optimizer(model, recipe)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, recipe.model["vocab_size"], (recipe.micro_batch_size, recipe.seq_len))
    ids = ids.to(accelerator.device)

    def step() -> None:
        loss = micro_batch_loss(model, ids, ids, ids.numel())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
            f.write("5")
        before = _rss_kb("VmRSS")
        step()
        peak = (_rss_kb("VmHWM") - before) * 1024
    accelerator.free_memory(model, optimizer)
    return peak


def section_memory(s: dict[str, Any], deadline: float, dry_run: bool) -> dict[str, Any]:
    from lime_model.recipes import load_recipe

    rows, skipped = [], []
    for shape, name in RECIPES.items():
        for routing in ("full", "none"):
            if time.perf_counter() > deadline:
                skipped.append(f"{shape} {routing}")
                continue
            overrides: dict[str, Any] = {"routing": routing, "data": "unused.txt", "mixed_precision": "auto"}
            if dry_run:
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
            recipe = load_recipe(name, overrides)
            planned = planned_bytes(recipe, gpu=s["device"] == "cuda")
            measured = measured_peak(recipe, s["device"])
            rows.append(
                {
                    "recipe": name,
                    "model": "LIMe" if routing == "full" else "LLaMA",
                    "measured_bytes": measured,
                    "planned_bytes": planned,
                    "measured_over_planned": measured / planned,
                    "what": "allocator peak" if s["device"] == "cuda" else "peak RSS rise over the step",
                }
            )
    return {"rows": rows, "skipped": skipped}


def section_probes(s: dict[str, Any], deadline: float) -> dict[str, Any]:
    """Throughput of extraction and the probes on a random 1B-shape LIMe (full), GQA."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from lime_probe.extraction.loading import wrap
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.blimp import blimp_probe
    from lime_probe.probes.entropy import stream_entropy

    tok = tiny_tokenizer()
    sized = {**s, "vocab": len(tok)}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(sized, "full", s["kv"]["gqa"])).to(s["device"]).eval()
    model = wrap(hf, tok)
    n_windows, batch = (16, 4) if s["device"] == "cuda" else (4, 2)
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(4, len(tok), (n_windows, s["seq"]), generator=gen).tolist()
    tokens = n_windows * s["seq"]

    def plain() -> None:
        with torch.inference_mode():
            for i in range(0, n_windows, batch):
                hf(torch.tensor(windows[i : i + batch], device=s["device"]), output_hidden_states=True)

    acts: dict[str, Any] = {}

    def extraction() -> None:
        acts["a"] = extract(
            model,
            tok,
            windows,
            sites=["values", "routed_values"],
            batch_size=batch,
            max_length=s["seq"],
            pretokenized=True,
            progress=False,
        )

    plain()  # warm-up
    plain_s, extract_s = timed(plain, s["device"]), timed(extraction, s["device"])
    a = acts["a"]
    layers = a.layers("values")

    def entropy() -> None:
        for layer in layers:
            stream_entropy(lambda layer=layer: a.iter_sequences("values", layer), n_boot=100)

    entropy_s = timed(entropy, "cpu")
    # BLiMP's probe on mean-pooled features: half the windows "good", half "bad", paired
    pooled = extract(
        model, tok, windows, sites=["values"], pool="mean", batch_size=batch, max_length=s["seq"],
        pretokenized=True, progress=False,
    )  # fmt: skip
    half = n_windows // 2
    good = {layer: pooled["values"][layer][:half].numpy() for layer in layers}
    bad = {layer: pooled["values"][layer][half:].numpy() for layer in layers}
    start = time.perf_counter()
    probe = blimp_probe(good, bad, np.arange(half), n_splits=2, progress=False)
    probe_s = time.perf_counter() - start
    accuracy = [float(x) for x in probe.accuracy_mean]
    return {
        "tokens": tokens,
        "layers": len(layers),
        "plain_forward_tokens_per_s": tokens / plain_s,
        "extract_tokens_per_s": tokens / extract_s,
        "extract_over_plain_time": extract_s / plain_s,
        "entropy_tokens_per_s": tokens * len(layers) / entropy_s,
        "blimp_probe_s": probe_s,
        "blimp_probe_accuracy": accuracy,
    }


SECTIONS = ("step", "parity", "memory", "probes")


def run(dry_run: bool, budgets: dict[str, float] | None = None) -> dict[str, Any]:
    """Every section in order; its result, seconds and budget, or its error (the next one still runs)."""
    s = settings(dry_run)
    budgets = budgets or BUDGETS
    print(f"gpu_check on {s['device']} ({s['dtype']}, compile backend {s['backend']}): sections and budgets")
    for name in SECTIONS:
        print(f"  {name:<8} {budgets[name]:>5.0f} s")
    print(f"  {'total':<8} {sum(budgets.values()):>5.0f} s", flush=True)
    result: dict[str, Any] = {
        "dry_run": dry_run,
        "settings": {k: v for k, v in s.items()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "device_name": torch.cuda.get_device_name() if s["device"] == "cuda" else platform.processor(),
        "sections": {},
    }
    start_all = time.perf_counter()
    for name in SECTIONS:
        start = time.perf_counter()
        deadline = start + budgets[name]
        try:
            if name == "step":
                body = section_step(s, deadline)
            elif name == "parity":
                body = section_parity(s, deadline)
            elif name == "memory":
                body = section_memory(s, deadline, dry_run)
            else:
                body = section_probes(s, deadline)
        except Exception as err:  # one section's failure must not cost the others' numbers
            body = {"error": f"{type(err).__name__}: {err}"}
        seconds = time.perf_counter() - start
        result["sections"][name] = {**body, "seconds": seconds, "budget_s": budgets[name]}
        print(f"[{name}] {seconds:.1f} s (budget {budgets[name]:.0f} s)", flush=True)
    result["seconds"] = time.perf_counter() - start_all
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="every section at toy size on the CPU")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or --dry-run on the CPU")
    result = run(args.dry_run)
    Path(args.out).write_text(json.dumps(result, indent=1, default=_json_default))
    failed = [n for n, body in result["sections"].items() if "error" in body]
    print(
        f"wrote {args.out} in {result['seconds']:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    sys.exit(1 if failed else 0)


def _json_default(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else str(value)


if __name__ == "__main__":
    main()
