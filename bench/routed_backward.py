"""The routed read alone, forward and backward, at the paper's 1B shapes: the readers' weight gradients
computed by each reader's backward (the baseline: every source read once more), or by each source's in
one pass over its readers' gradients (``lime_model.kv_kernels``: torch's GEMMs, Triton's kernel).

A stack of ``--layers`` routed reads with full routing (layer i mixes layers 0..i with a learned
``[kv, (i+1)*kv]`` fp32 weight, as a model's) over random raw K/V of ``--tokens`` positions in the
compute dtype, then backward from random routed-K/V gradients; no attention or MLP, so all the time is
the read's. Every read takes the one-buffer path a GPU takes. Each round runs the variants side by
side in this process; a variant's ratio is the median over rounds of its time over the baseline's in
the same round, with the median's distribution-free interval (``lime_probe.probes.stats.median_ci``).
Each variant's gradients are checked against the baseline's first.

``--compiled BACKEND`` runs the reads through ``torch.compile`` (as a compiled model runs them: two custom
operators, the backward's state kept between layers). ``--sweep`` also times the Triton kernel alone on layer 0's backward (every layer a reader) for a few
tile sizes and warp counts, against the shipped ones (``kv_kernels.TILE_ELEMENTS``, ``MAX_BLOCK``,
``WARPS``); ``bench/kernel_resources.py`` shows which of them spill registers.

    python bench/routed_backward.py                     # a GPU: GQA and MHA, bf16
    python bench/routed_backward.py --device cpu --dtype float32 --tokens 64 --rounds 3   # a dry run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lime_model import kv_buffer, kv_kernels, kv_read  # noqa: E402
from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402
from lime_probe.probes.stats import median_ci  # noqa: E402

SHAPES = {"gqa": 8, "mha": 32}  # K/V heads of the 1B shapes
VARIANTS = ("readers", "source, torch", "source, triton")
# the kernel section's compiled rows: AOT autograd's graphs run as ATen ops, so the read's custom operators
# run as in a compiled model, without Inductor's minutes of compiling around them
COMPILED_BACKEND = "aot_eager"
# (TILE_ELEMENTS, MAX_BLOCK, WARPS); the first are the shipped settings. The H100's sweep had all four
# of the first within 8 %, each reading a tile's rows in segments of 32-128 bytes; the last two read
# wider segments with 16 warps (at most 128 registers each; compiled for sm_90 by Triton 3.9, up to 96
# bytes spill at MHA's shape, and 512 at its 16 readers with 32,768-number tiles, whose rows then read 128
# bytes where the others read 64)
SWEEP = [
    (4096, 64, 8), (2048, 64, 4), (8192, 64, 8), (8192, 128, 8), (16384, 64, 16), (16384, 128, 16), (32768, 64, 16)
]  # fmt: skip


def make_inputs(args: argparse.Namespace, kv: int) -> dict[str, Any]:
    """Raw keys and values ``(1, tokens, kv * head_dim)`` per layer, weights per routed layer, and the
    routed K/V's gradients ``(1, kv, tokens, head_dim)``: leaves, made once (seeded)."""
    layers, tokens, hd, device = args.layers, args.tokens, args.head_dim, args.device
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device).manual_seed(0)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    weights = [None] + [randn(kv, (i + 1) * kv, dtype=torch.float32) / (i + 1) for i in range(1, layers)]
    return {
        "keys": [randn(1, tokens, kv * hd).requires_grad_() for _ in range(layers)],
        "values": [randn(1, tokens, kv * hd).requires_grad_() for _ in range(layers)],
        "weights": [w if w is None else w.requires_grad_() for w in weights],
        "probes": [randn(1, kv, tokens, hd) for _ in range(2 * layers)],
    }


@contextmanager
def variant(name: str):
    """Reads as ``name`` computes them; every one on the one-buffer path (``kv_buffer.gemm_pieces``)."""
    kernel = name == "source, triton"
    with (
        mock.patch.object(kv_buffer, "gemm_pieces", lambda device: False),
        mock.patch.object(kv_kernels, "kernel_available", lambda device: kernel),
    ):
        yield name != "readers"


def reads(keys, values, weights, kv: int, head_dim: int, defer: bool) -> list[torch.Tensor]:
    """The stack's routed reads, forward: every layer's routed keys and values."""
    buffer = kv_buffer.KVBuffer(len(keys), kv, head_dim)
    if defer:
        buffer.defer_weight_grads({i: w for i, w in enumerate(weights) if w is not None})
    outs = []
    for i in range(len(keys)):
        outs += kv_read.routed_read(buffer, i, keys[i], values[i], weights[i], list(range(i + 1)), "matrix")
    return outs


def step(
    inputs: dict[str, Any], kv: int, defer: bool, forward: Callable[..., Any] = reads
) -> list[torch.Tensor]:
    """One forward (``forward``: `reads`, or it compiled) and backward of the stack; the leaves'
    gradients (keys, values, then weights)."""
    hd = inputs["probes"][0].shape[-1]
    outs = forward(inputs["keys"], inputs["values"], inputs["weights"], kv, hd, defer)
    leaves = [*inputs["keys"], *inputs["values"], *inputs["weights"][1:]]
    return list(torch.autograd.grad(outs, leaves, inputs["probes"]))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(kv: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every variant against the baseline with ``kv`` K/V heads: gradient errors, median ms, ratios. With
    ``args.compiled`` (a ``torch.compile`` backend) the reads run compiled, as in a compiled model: as
    the two custom operators, whose backward records each source's readers in backward order."""
    inputs = make_inputs(args, kv)
    forward = reads if not args.compiled else torch.compile(reads, backend=args.compiled, fullgraph=True)
    device = torch.device(args.device)
    names, skipped = list(VARIANTS), []
    if not kv_kernels.kernel_available(device):
        names.remove("source, triton")
        skipped.append(
            {"variant": "source, triton", "why": "no CUDA device with Triton (or TRITON_INTERPRET=1)"}
        )
    reference = None
    errors = {}
    for name in list(names):  # also each variant's warm-up (Triton compiles here)
        with variant(name) as defer, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            grads = step(inputs, kv, defer, forward)
        if name == "source, triton" and not kv_kernels.kernel_available(device):
            # the kernel fell back to the GEMMs: timing them under its name would mislead
            names.remove(name)
            skipped.append(
                {"variant": name, "why": "; ".join(str(w.message) for w in caught) or "the kernel failed"}
            )
            continue
        if reference is None:
            reference = grads
        errors[name] = max(
            float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, reference, strict=True)
        )
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            with variant(name) as defer:
                sync(args.device)
                start = time.perf_counter()
                step(inputs, kv, defer, forward)
                sync(args.device)
            times[name].append(time.perf_counter() - start)
    rows = []
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times["readers"], strict=True)]
        low, high, coverage = median_ci(ratios)
        ms = 1e3 * statistics.median(times[name])
        rows.append({"variant": name, "ms": ms, "x_readers": statistics.median(ratios), "ci": [low, high],
                     "coverage": coverage, "max_rel_error": errors[name]})  # fmt: skip
    return {"kv": kv, "rows": rows, "skipped": skipped}


def sweep(kv: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The Triton kernel alone on layer 0's backward (every layer a reader), per setting of ``SWEEP``
    at the shipped program count: median ms over ``--rounds``, over the shipped settings', and the
    bandwidth of the bytes the pass must move."""
    layers, hd, n = args.layers, args.head_dim, args.tokens * args.head_dim
    dtype = getattr(torch, args.dtype)
    kept = torch.randn(layers * kv, n, device=args.device, dtype=dtype)
    source = torch.randn(kv, n, device=args.device, dtype=dtype)
    columns = torch.randn(layers, kv, kv, device=args.device, dtype=dtype)

    def ms(tile: int, block: int, warps: int) -> float:
        # the kernel itself, not source_backward: a setting that fails must neither be timed as the GEMMs
        # it would fall back to nor turn the kernel off for the rest of the process
        backward = partial(kv_kernels._triton_backward, kept, list(range(layers)), columns, source, hd)
        with (
            mock.patch.object(kv_kernels, "TILE_ELEMENTS", tile),
            mock.patch.object(kv_kernels, "MAX_BLOCK", block),
            mock.patch.object(kv_kernels, "WARPS", warps),
        ):
            backward()  # compiles
            times = []
            for _ in range(args.rounds):
                sync(args.device)
                start = time.perf_counter()
                backward()
                sync(args.device)
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    # bytes the pass must move: every reader's gradient and the source once, the gradient written once
    moved = (layers * kv + 2 * kv) * n * kept.element_size()
    rows: list[dict[str, Any]] = []
    for tile, block, warps in SWEEP:  # the shipped settings first
        row: dict[str, Any] = {"tile": tile, "block": block, "warps": warps}
        try:
            row |= {"ms": ms(tile, block, warps)}
        except Exception as err:  # noqa: BLE001 (a setting too big for this GPU is a result)
            rows.append(row | {"error": f"{type(err).__name__}: {err}".splitlines()[0]})
            continue
        shipped = rows[0].get("ms") if rows else row["ms"]
        row |= {"x_shipped": row["ms"] / shipped if shipped else None, "GB_per_s": moved / row["ms"] / 1e6}
        rows.append(row)
    return rows


def section(ctx: Any) -> dict[str, Any]:
    """``bench/gpu_check.py``'s "kernel" section (``ctx``: its ``gpu_sections.Context``): ``measure`` at
    both shapes, then ``sweep`` at both where the kernel runs, each started only within the section's
    budget."""
    s = ctx.s
    args = argparse.Namespace(layers=s["layers"], tokens=s["batch"] * s["seq"], head_dim=s["hidden"] // s["heads"],
                              rounds=s["rounds"], device=ctx.device, dtype=s["dtype"], compiled=None)  # fmt: skip
    compiled = argparse.Namespace(**{**vars(args), "compiled": COMPILED_BACKEND})
    body: dict[str, Any] = {"rows": [], "compiled_rows": [], "sweep": [], "skipped": []}
    parts = (("rows", measure), ("compiled_rows", lambda kv, _: measure(kv, compiled)), ("sweep", sweep))
    for part, run in parts:
        for shape, kv in s["kv"].items():
            reason = ctx.skip_reason() or (None if kv_kernels.kernel_available(torch.device(ctx.device)) or part != "sweep"
                                            else "no CUDA device with Triton")  # fmt: skip
            if reason:
                body["skipped"].append({"row": f"{shape}:{part}", "why": reason})
            else:
                body[part].append({"shape": shape, **{"result": run(kv, args)}})
    return body


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--layers", type=POSITIVE_INT, default=16)
    parser.add_argument("--tokens", type=POSITIVE_INT, default=4 * 2048, help="B * T (default: 4 x 2048)")
    parser.add_argument("--head-dim", type=POSITIVE_INT, default=64)
    parser.add_argument("--rounds", type=POSITIVE_INT, default=20)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel's settings")
    parser.add_argument(
        "--compiled",
        choices=["aot_eager", "inductor"],
        default=None,
        help="run the reads through torch.compile",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    how = f"compiled ({args.compiled})" if args.compiled else "eager"
    print(
        f"routed read, full routing, {args.layers} layers, {args.tokens} tokens, {args.dtype}, {args.device}, {how}"
    )
    for shape in args.shapes:
        result = measure(SHAPES[shape], args)
        for row in result["rows"]:
            low, high = row["ci"]
            print(f"{shape} {row['variant']:<15} {row['ms']:9.3f} ms  x readers {row['x_readers']:.3f} "
                  f"[{low:.3f}-{high:.3f}] ({row['coverage']:.1%})  max rel. error {row['max_rel_error']:.1e}")  # fmt: skip
        for skip in result["skipped"]:
            print(f"{shape} {skip['variant']:<15} not run: {skip['why']}")
        if args.sweep and not result["skipped"]:
            for row in sweep(SHAPES[shape], args):
                setting = f"TILE_ELEMENTS={row['tile']} MAX_BLOCK={row['block']} WARPS={row['warps']}"
                if "error" in row:
                    print(f"{shape} kernel {setting}: failed ({row['error']})")
                    continue
                ratio = "-" if row["x_shipped"] is None else f"{row['x_shipped']:.3f}"
                print(
                    f"{shape} kernel {setting}: {row['ms']:.3f} ms, x shipped {ratio}, {row['GB_per_s']:.0f} GB/s"
                )


if __name__ == "__main__":
    main()
