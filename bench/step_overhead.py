"""Training-step overhead of LIMe routing variants against the LLaMA baseline (issue: lime_model).

Both models are built in one process and timed interleaved (forward + backward, fp32 by default),
so machine noise hits them alike; time ratios are medians over repeats. Peak memory is the rise of
the process's peak RSS during one step, measured in a fresh subprocess per model (peak RSS cannot
be reset inside one process reliably).

    python bench/step_overhead.py                       # the issue's CPU setting
    python bench/step_overhead.py --threads 1 --clock cpu   # steadier on a shared, loaded machine
    python bench/step_overhead.py --device cuda --dtype bfloat16 --compile   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from lime_model import LimeConfig, LimeForCausalLM

DEFAULT_VARIANTS = ["full", "first-4", "dilated-8", "last-4", "average", "no-head-mix", "per-dim", "dynamic"]


def build(routing: str, args: argparse.Namespace) -> LimeForCausalLM:
    torch.manual_seed(0)
    cfg = LimeConfig(
        routing=routing,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # the paper's 1B ratio (2048 -> 8192)
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        tie_word_embeddings=True,
    )
    model = LimeForCausalLM(cfg).to(args.device).train()
    return torch.compile(model) if args.compile else model


def step(model: LimeForCausalLM, ids: torch.Tensor, dtype: torch.dtype) -> None:
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_memory_mb(routing: str, args: argparse.Namespace, runs: int = 3) -> float:
    """Rise of peak memory over one step, median over fresh processes (CUDA: max allocated).

    glibc serves tensors above the mmap threshold with their own mappings, returned to the system
    when freed, so with a fixed 1 MiB threshold the resident set follows live tensor memory rather
    than the allocator's free lists.
    """
    cmd = [sys.executable, __file__, "--_memory-of", routing, *sys.argv[1:]]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    peaks = []
    for _ in range(runs):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        peaks.append(json.loads(out.strip().splitlines()[-1])["peak_mb"])
    return statistics.median(peaks)


def measure_memory(routing: str, args: argparse.Namespace) -> None:
    model = build(routing, args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    dtype = getattr(torch, args.dtype)
    step(model, ids, dtype)  # warm up: allocate gradients and caches once
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, ids, dtype)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
            f.write("5")
        base = _rss_kb("VmRSS")
        step(model, ids, dtype)
        peak = (_rss_kb("VmHWM") - base) * 1024
    print(json.dumps({"peak_mb": peak / 2**20}))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: heads (MHA)")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu = this process's CPU time: less sensitive to other load (use with --threads 1)",
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--_memory-of", dest="memory_of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        return measure_memory(args.memory_of, args)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    dtype = getattr(torch, args.dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    models = {"none": build("none", args)} | {v: build(v, args) for v in args.variants}
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():  # warm-up (and compilation)
        step(model, ids, dtype)
    for _ in range(args.repeats):
        for name, model in models.items():
            sync(args.device)
            start = clock()
            step(model, ids, dtype)
            sync(args.device)
            times[name].append(clock() - start)

    base_t = statistics.median(times["none"])
    base_m = None if args.no_memory else peak_memory_mb("none", args)
    print(
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads or args.heads} kv, "
        f"{args.batch}x{args.seq} tokens, {args.dtype} on {args.device}{' compiled' if args.compile else ''}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, median of {args.repeats}"
    )
    print(f"{'routing':<12} {'step s':>8} {'time x':>7} {'peak MB':>8} {'mem x':>6}")
    print(f"{'none':<12} {base_t:8.3f} {1.0:7.3f} {base_m or float('nan'):8.1f} {1.0:6.3f}")
    for name in args.variants:
        t = statistics.median(times[name])
        m = float("nan") if base_m is None else peak_memory_mb(name, args)
        print(f"{name:<12} {t:8.3f} {t / base_t:7.3f} {m:8.1f} {m / (base_m or float('nan')):6.3f}")


if __name__ == "__main__":
    main()
