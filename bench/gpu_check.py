"""The GPU check: one script, one JSON, sized to run in about 8 minutes on one H100 or H200.

Sections in this order (their bodies in ``bench/gpu_sections.py``, the step section's in
``bench/gpu_step.py``, the kernel section's in ``bench/routed_backward.py``): first those that time the
host or the device or weigh its memory, each alone, then parity and the step section beside the compile
workers below. Each is timed against a budget printed at the start; a section with rows starts no row
once its budget is spent and lists each row it skipped and why. The JSON is rewritten (atomically)
before and after every section, so a run killed part-way keeps every section that finished and names
the one under way (``"running"``).

- ``kernel``: the routed read's backward alone at both 1B shapes (the readers' own weight gradients,
  the source's pass with torch's GEMMs and with Triton's kernel, checked against the first), and a
  sweep of the kernel's settings.
- ``generate``: greedy ``generate`` of a random LIMe: the tokens with the K/V cache equal those without
  (fp32), and tokens per second with and without the cache in bf16.
- ``extract``: ``lime_probe.extract`` (values, routed values) against a plain forward with the model
  in bf16: the median per-round ratio of their times, with its interval; beside it the same extraction
  collecting each batch before starting the next, the baseline of their overlap, and one extraction's
  host profile (cProfile's functions of most own time).
- ``fsdp``: one LIMe training step sharded with FSDP2 in a world of one process, through the trainer's
  own path (``lime_model.distributed.shard``, ``prepare``): that it runs, its first loss minus the
  unsharded model's on the same weights, and its peak against ``lime-model plan``'s FSDP2 figure.
- ``memory``: peak GPU memory of one training step (forward, backward, AdamW step after a first one,
  bf16 autocast as training runs it) of the ``lime-1b-gqa`` and ``lime-1b-mha`` recipes at one
  micro-batch, LIMe and LLaMA, against ``lime-model plan`` (``step_memory(recipe, micro_batches=1)
  .total``: tensor bytes plus the CUDA allocator's modelled terms), with the allocator's peak per phase
  and its requested (unrounded) peak; in the dry run the CPU's plan against the rise of the peak RSS.
- ``probes``: on a random 1B-shape LIMe (fp32 weights), extraction against a plain forward, the matrix
  entropy over every layer's values on the model's device (as ``lime-probe entropy`` computes it; the
  first run's was on the CPU) and the BLiMP probe's logistic regression (random pairs: chance).
- ``parity``: a LIMe (and, beside it, a LLaMA) forward and backward under bf16 autocast against fp32
  from the same weights: relative error of the logits, the loss and every gradient.
- ``step``: Table 17's step time (App. I: H100, 1B, PyTorch Inductor) in bf16 with ``torch.compile``,
  forward + backward of the whole model (``bench/step_overhead.py``'s ``Steps``), LIMe full, first-4,
  last-4 and dilated-8 against LLaMA at the 1B GQA and MHA shapes (16 layers, hidden 2048, 32 heads, 8
  or 32 K/V heads), 4 x 2048 tokens; the ratio is the median over interleaved rounds with its interval
  (10 rounds, 20 for the rows with a target: GQA full, MHA full, GQA first-4).
  Each shape's LLaMA is compiled once and serves every row of that shape. A model's compile takes 40-70
  s, ten of them more than the run's 8 minutes: so ``--compile-workers`` processes (by default as many
  as the GPU's memory holds beside the run, ``WORKER_GIB`` each: two on an H100, three on an H200) start
  with the parity section and compile the ten models ahead of their rows, each taking the next one no
  one has claimed, as does the step section while it waits for one (``gpu_step.CompileQueue``); their
  compiles fill torch's on-disk caches (AOTAutograd's and Inductor's FX graph cache,
  ``TORCHINDUCTOR_CACHE_DIR``, shared by the processes of one machine), so a row's own compile of a
  model compiled ahead is mostly Dynamo's trace. The workers are paused (SIGSTOP) while a row is timed
  and profiled. Each row records its compiles' seconds and cache hits and misses, and those ahead of
  it; the JSON is rewritten after each row.

No section starts a row after ``RUN_BUDGET_S`` seconds of the run, whatever its own budget: the step
section takes what the earlier sections left.

Needs no network and no data: random weights, random tokens, the tests' tiny tokenizer for extraction.
``--dry-run`` (or ``--tiny``) runs every section at toy size on the CPU (compiling with Dynamo alone);
``--sections`` runs some sections (in the order above), ``--rows SHAPE:ROUTING ...`` some memory and
step rows (``gqa:full``, ``mha:first-4``; ``none`` is LLaMA, a memory row).

On the device machine (torch 2.11 and transformers 5.17 there; lime_probe needs transformers 5.24 and
nnsight, carried as wheels). Once, here, in the repository's root::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
      -d .whl transformers==5.24.0 nnsight==0.8.1 greenlet pydantic==2.14.4 pydantic-core==2.50.5 \\
      annotated-types typing-inspection websocket-client zstandard 'typing-extensions>=4.16' regex

then the device tool's ``run`` with ``carry: [".whl"]``, ``timeout_s: 560`` and the command::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \\
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT/gpu_check.json

A rerun of what a first run skipped, on the machine still warm (its compile caches kept), names it:
``... bench/gpu_check.py --sections step --rows mha:last-4 mha:dilated-8 --out $OUT/rest.json``.
On the CPU: ``python bench/gpu_check.py --dry-run --out /tmp/check.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import gpu_sections as sections  # noqa: E402
import gpu_step  # noqa: E402
import gpu_targets  # noqa: E402
import routed_backward  # noqa: E402

from lime_model import kv_kernels  # noqa: E402
from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402
from lime_model.files import atomic_write  # noqa: E402

# Table 3-4's 1B model; "kv" is the K/V heads of the GQA and MHA shapes
FULL = dict(layers=16, hidden=2048, heads=32, vocab=50257, batch=4, seq=2048, kv={"gqa": 8, "mha": 32})
TOY = dict(layers=3, hidden=32, heads=4, vocab=64, batch=1, seq=16, kv={"gqa": 2, "mha": 4})
SECTIONS = {  # name -> (body, budget in seconds); the sections that time or weigh something alone first
    "kernel": (routed_backward.section, 45),
    "generate": (sections.section_generate, 25),
    "extract": (sections.section_extract, 35),
    "fsdp": (sections.section_fsdp, 35),
    "memory": (sections.section_memory, 60),
    "probes": (sections.section_probes, 30),  # 26 s in the first run
    "parity": (sections.section_parity, 40),
    "step": (gpu_step.section, 400),  # within the run's RUN_BUDGET_S
}
# Sections the compile workers may run beside: parity measures rounding, not time or memory. On one
# H100 with three workers beside them, fsdp, memory and probes ran out of GPU memory and extraction's
# host-bound time rose about 7x (bench/RESULTS.md).
BESIDE_WORKERS = frozenset({"parity", "step"})
SHAPES = tuple(FULL["kv"])  # type: ignore[arg-type]
ROUTINGS = ("none", *sections.VARIANTS)
# A worker's GPU memory while its model's first step runs: 4.0 GiB of fp32 weights and the step's peak
# above them, 16.2-17.4 GiB in the H100 run (step_peak_bytes), with the CUDA context and the allocator's
# cache; the run's own: a shape's LLaMA, the model it compiles or times, one step. Three workers beside
# the run on an H100 ran out of its 79 GiB (four compiles failed); two fit, three on an H200.
WORKER_GIB, RUN_GIB = 24, 30
# The run starts no section's row after this many seconds since it started, whatever the section's own
# budget: the device call's 560 s less the wheels' installation and a last row's compile and rounds.
RUN_BUDGET_S = 460


def settings(tiny: bool) -> dict[str, Any]:
    """The run's sizes and options: the GPU's, or toy ones on the CPU (``--dry-run``)."""
    if not tiny:
        return {
            **FULL,
            "device": "cuda",
            "dtype": "bfloat16",
            "backend": "inductor",
            "rounds": 10,
            "tiny": False,
        }
    # the CPU compiles with Dynamo alone ("eager"): Inductor's C++ takes minutes on a small machine
    dtype = "bfloat16" if torch.backends.mkldnn.is_available() else "float32"
    return {**TOY, "device": "cpu", "dtype": dtype, "backend": "eager", "rounds": 2, "tiny": True}


def step_models(rows: frozenset[str] | None) -> list[str]:
    """The step section's models (``SHAPE:ROUTING``) in the order it compiles them."""
    models: list[str] = []
    for variant in sections.VARIANTS:
        for shape in SHAPES:
            if rows is None or f"{shape}:{variant}" in rows:
                models += [m for m in (f"{shape}:none", f"{shape}:{variant}") if m not in models]
    return models


class CompileWorkers:
    """Processes that compile the step section's models ahead of it (``gpu_step.warm_models``), each
    taking the next model no one has claimed (``gpu_step.CompileQueue``, shared with the run); each in
    its own process group, so that ``paused`` stops its compiles' subprocesses too."""

    def __init__(self, models: list[str], workers: int, tiny: bool) -> None:
        self.queue = gpu_step.CompileQueue(Path(tempfile.mkdtemp(prefix="gpu_check_warm.")), tuple(models))
        self.procs, self.logs, self.paused_s = [], [], 0.0
        for i in range(min(workers, len(models))):
            self.logs.append(open(self.queue.folder / f"worker{i}.log", "w"))  # noqa: SIM115 (closed by stop)
            self.procs.append(
                subprocess.Popen(
                    self.command(models, self.queue.folder, tiny),
                    stdout=self.logs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    @staticmethod
    def command(models: list[str], folder: Path, tiny: bool) -> list[str]:
        cmd = [sys.executable, __file__, "--warm-models", ",".join(models), "--warm-dir", str(folder)]
        cmd += ["--warm-parent", str(os.getpid())]
        return [*cmd, "--out", os.devnull, *(["--dry-run"] if tiny else [])]

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The workers and their subprocesses stopped (SIGSTOP) while the block runs; their GPU memory
        stays allocated."""
        self._signal(signal.SIGSTOP)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._signal(signal.SIGCONT)
            self.paused_s += time.perf_counter() - start

    def _signal(self, sig: int) -> None:
        for proc in self.procs:
            with suppress(ProcessLookupError):  # the group has exited
                os.killpg(proc.pid, sig)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)  # a stopped process acts on its SIGTERM once continued
        for proc in self.procs:
            proc.wait()
        for log in self.logs:
            log.close()


PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process (a compile worker) when ``parent``, the run, dies: a timeout's
    kill of the run's process group does not reach a worker in its own session, and SIGKILL also ends
    one that is stopped. Linux only (elsewhere the run's ``stop`` alone ends its workers)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def default_workers(s: dict[str, Any]) -> int:
    """As many compile workers as the GPU's memory holds beside the run (at most 3): none in the dry run."""
    if s["tiny"]:
        return 0
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    return max(0, min(3, int((total - RUN_GIB) // WORKER_GIB)))


def run(
    tiny: bool,
    out: Path,
    names: list[str] | None = None,
    rows: frozenset[str] | None = None,
    budgets: dict[str, float] | None = None,
    workers: int | None = None,
    run_budget: float | None = None,
) -> dict[str, Any]:
    """The sections ``names`` (default all) in ``SECTIONS``' order, ``out`` rewritten after each:
    each one's body, seconds and budget, or its error (the next one still runs). No row starts after
    ``run_budget`` seconds (default ``RUN_BUDGET_S`` on a GPU, none in the dry run)."""
    s = settings(tiny)
    names = [n for n in SECTIONS if names is None or n in names]
    budgets = {n: b for n, (_, b) in SECTIONS.items()} | (budgets or {})
    run_budget = (math.inf if tiny else RUN_BUDGET_S) if run_budget is None else run_budget
    _print_plan(s, names, budgets, run_budget)
    result: dict[str, Any] = {
        "dry_run": tiny,
        "settings": s,
        "versions": _versions(),
        "device_name": torch.cuda.get_device_name() if s["device"] == "cuda" else platform.processor(),
        # how a source's backward sums its readers' gradients (lime_model.kv_kernels), at the start
        "routed_backward": _routed_backward(s["device"]),
        "selected": {"sections": names, "rows": None if rows is None else sorted(rows)},
        "not_selected": [n for n in SECTIONS if n not in names],
        "sections": {},
    }
    workers = default_workers(s) if workers is None else workers
    warm = None
    start_all = time.perf_counter()
    try:
        for name in names:
            result["running"] = name
            _write(out, result)
            if warm is None and workers and "step" in names and name in BESIDE_WORKERS:
                warm = CompileWorkers(step_models(rows), workers, tiny)

            def save(body: dict[str, Any], name: str = name) -> None:
                result["sections"][name] = body
                _write(out, result)

            start = time.perf_counter()
            deadline, spent = (
                start + budgets[name],
                f"the section's budget of {budgets[name]:.0f} s was spent",
            )
            if start_all + run_budget < deadline:
                deadline, spent = start_all + run_budget, f"the run's budget of {run_budget:.0f} s was spent"
            ctx = sections.Context(s, deadline, spent, rows, warm, save)
            result["sections"][name] = _section(name, ctx, budgets[name])
            gc.collect()  # a section's models may sit in reference cycles (nnsight's, accelerate's): freed here
            if s["device"] == "cuda":
                torch.cuda.empty_cache()
        del result["running"]
    finally:
        if warm is not None:
            warm.stop()
    result["seconds"] = time.perf_counter() - start_all
    # and at the end: a kernel that failed to build or launch fell back to the GEMMs (with a warning)
    result["routed_backward_at_end"] = _routed_backward(s["device"])
    _write(out, result)
    print(gpu_targets.table(result), flush=True)
    return result


def _print_plan(s: dict[str, Any], names: list[str], budgets: dict[str, float], run_budget: float) -> None:
    print(f"gpu_check on {s['device']} ({s['dtype']}, compile backend {s['backend']}): sections and budgets")
    for name in names:
        print(f"  {name:<8} {budgets[name]:>5.0f} s")
    print(f"  {'total':<8} {sum(budgets[n] for n in names):>5.0f} s", flush=True)
    if math.isfinite(run_budget):
        print(f"  and no row starts after {run_budget:.0f} s", flush=True)


def _section(name: str, ctx: sections.Context, budget: float) -> dict[str, Any]:
    """One section's body (or its error), with its seconds, budget and the compile workers beside it."""
    warm = ctx.warm
    alongside, paused = (warm.alive(), warm.paused_s) if warm else (0, 0.0)
    start = time.perf_counter()
    try:
        body = SECTIONS[name][0](ctx)
    except Exception as err:  # one section's failure must not cost the others' numbers
        body = {"error": f"{type(err).__name__}: {err}"}
    seconds = time.perf_counter() - start
    print(f"[{name}] {seconds:.1f} s (budget {budget:.0f} s)", flush=True)
    body = {**body, "seconds": seconds, "budget_s": budget}
    if alongside:
        body |= {"compile_workers_alongside": alongside, "compile_workers_paused_s": warm.paused_s - paused}
    return body


def _routed_backward(device: str) -> str:
    return "triton" if kv_kernels.kernel_available(torch.device(device)) else "torch"


def _versions() -> dict[str, Any]:
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("nnsight", "triton"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    return versions | {"python": platform.python_version(), "cuda": torch.version.cuda}


def _write(out: Path, result: dict[str, Any]) -> None:
    atomic_write(out, json.dumps(result, indent=1, default=_json_default))


def _json_default(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else str(value)


def _names(text: str, valid: tuple[str, ...], what: str) -> list[str]:
    names = [n for n in text.replace(",", " ").split() if n]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {' '.join(bad) or repr(text)}; valid: {', '.join(valid)}"
        )
    return names


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write (rewritten after each section)")
    parser.add_argument(
        "--dry-run", "--tiny", action="store_true", help="every section at toy size on the CPU"
    )
    parser.add_argument(
        "--sections", nargs="+", metavar="NAME", type=lambda t: _names(t, tuple(SECTIONS), "section"),
        help=f"run these sections only (of {', '.join(SECTIONS)})",
    )  # fmt: skip
    valid_rows = tuple(f"{shape}:{routing}" for shape in SHAPES for routing in ROUTINGS)
    parser.add_argument(
        "--rows", nargs="+", metavar="SHAPE:ROUTING", type=lambda t: _names(t, valid_rows, "row"),
        help="run these memory and step rows only (gqa:full, mha:first-4, ...; none is LLaMA)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-workers", type=int, default=None, metavar="N",
        help="processes compiling the step section's models ahead of it (default: as many as the GPU's memory "
        f"holds beside the run, {WORKER_GIB} GiB each, at most 3; 0 in the dry run)",
    )  # fmt: skip
    parser.add_argument("--warm-models", help=argparse.SUPPRESS)  # a compile worker's models and folder
    parser.add_argument("--warm-dir", help=argparse.SUPPRESS)
    parser.add_argument("--warm-parent", type=POSITIVE_INT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or --dry-run on the CPU")
    if args.compile_workers is not None and args.compile_workers < 0:
        parser.error(f"--compile-workers must be 0 or more, got {args.compile_workers}")
    out = Path(args.out)
    if args.warm_models is None and not out.parent.is_dir():
        parser.error(f"--out {out}: no folder {out.parent}")
    if args.warm_models is not None:
        die_with_parent(args.warm_parent)
        gpu_step.warm_models(settings(args.dry_run), args.warm_models.split(","), Path(args.warm_dir))
        return
    names = None if args.sections is None else [n for group in args.sections for n in group]
    rows = None if args.rows is None else frozenset(r for group in args.rows for r in group)
    result = run(args.dry_run, out, names, rows, workers=args.compile_workers)
    failed = [n for n, body in result["sections"].items() if "error" in body]
    print(f"wrote {out} in {result['seconds']:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
