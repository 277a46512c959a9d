"""Training-step overhead of LIMe routing variants against the LLaMA baseline (issue 14).

Two scopes, both forward + backward, fp32 by default:

- ``stack``: the decoder layers alone (``LimeModel`` from fixed random input embeddings to the
  final norm, loss = a fixed random projection of the output), where every bit of routing cost lives;
- ``model``: the whole training step (embedding, layers, tied LM head, cross-entropy).

The default vocabulary is 4096: at hidden 256 the tied head then has as many weights as one layer
(4096 x 256 ~ 256 x 256 x 4 + 3 x 256 x 1024), so the whole-model line is within ~10 % of the stack
line instead of diluted by half (a 50257-token head at hidden 256 costs about as much as 16 layers).

Each routing variant runs in its own process next to its own LLaMA, interleaved: each round times
both once, and the reported ratio is the median over rounds of (variant time / LLaMA time in the same
round), so a load spike that hits one round moves one sample, not the statistic; min-max over rounds
is printed too, and the median's distribution-free confidence interval (order statistics,
``lime_probe.probes.stats.median_ci``), against which each row's time target (``TIME_TARGETS``) is
called met, missed or not resolved (then with the rounds that might resolve it,
``rounds_to_resolve``): on a shared 2-core VM per-round ratios spread by 0.1-0.4, so a median of a
few rounds alone says little about a target a few points away. ``best x`` is the fastest variant step
over the fastest LLaMA step: interference only ever adds time, so on a shared host the fastest steps
are the least disturbed. One process per pair,
because a model's step time depends on the heap other models left: with LLaMA and five variants
in one process, dynamic routing measured 1.5x LLaMA, and 1.15x in a
process holding only LLaMA and dynamic models. For the same
reason each timed step follows an untimed step of the same model: the first step after another
model ran was slower here (full/LLaMA 1.16 with LLaMA timed first, 1.08 with full first, 1.09 with an
untimed step before each), which biased whichever row came first in a round. And each pair runs in
``--processes`` fresh processes (default 2) that share the rounds, alternately building and timing
LLaMA or the variant first: of two identical LLaMAs in one process, the one built and timed second
ran faster in seven processes of nine (8 rounds each; pooled ratio 0.983 [0.957-1.007]), a bias of
up to a few percent that a fixed order would hand to every variant and that alternating cancels. The row ``a/a``
measures the bench itself: LLaMA against a second LLaMA, run like any row; its interval should
contain 1.
Peak memory is the rise of the process's peak RSS during one step (CUDA: max allocated), measured
in fresh subprocesses (peak RSS cannot be reset reliably inside one process), median over runs.

    python bench/step_overhead.py --threads 1 --clock cpu    # every row, memory too (bench/RESULTS.md)
    python bench/step_overhead.py --rounds 3 --no-memory --variants full   # quick check
    python bench/step_overhead.py --threads 1 --clock cpu --rounds 80 --processes 8 --scopes stack \
        --no-memory --variants per-dim   # a long run, as in bench/RESULTS.md's table of targets
    python bench/step_overhead.py --threads 1 --clock cpu --rounds 30 --scopes stack --no-memory \
        --variants first-4 last-1   # a tighter interval for two rows (last-1: the buffer, no mixing)
    python bench/step_overhead.py --device cuda --dtype bfloat16 --compile  # on a GPU
    python bench/step_overhead.py --threads 1 --clock cpu --rounds 16 --scopes stack --no-memory \
        --variants a/a   # the bench's own bias and spread: LLaMA against LLaMA
    python bench/step_overhead.py --threads 1 --profile --variants full first-4  # where the extra time goes

``--profile`` replaces the timing with ``torch.profiler``: self CPU time per operator over the layer
stack's forward + backward, each row against LLaMA, largest differences first, each operator's median
over interleaved rounds (the profiler's own overhead inflates small operators, so read it as a
breakdown, not as the ratio).

Rows are LIMe routing specs or the names of the paper's cross-layer baselines (every row is compared
with LLaMA, ``none``), e.g. ``--variants full denseformer resformer hyperconnections`` (issue 13);
``full+recompute`` is LIMe with ``recompute_routed_kv`` (routed K/V recomputed in backward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
from transformers import AutoModelForCausalLM

from lime_model import ARCHITECTURES, config_for
from lime_model.command_line import POSITIVE_INT, OneLineParser
from lime_probe.probes.stats import median_ci, median_ci_rank

DEFAULT_VARIANTS = ["full", "first-4", "dilated-8", "last-4", "average", "no-head-mix", "per-dim", "dynamic"]
SCOPES = ("stack", "model")
# the A/A row: LLaMA against a second LLaMA, built and timed like any row (the bench's own bias)
AA = "a/a"
# the time targets of issues 9 and 14 (variant step over LLaMA's); memory's is 1.05x for every row
TIME_TARGETS = {"full": 1.10, "first-4": 1.04, "dilated-8": 1.04, "per-dim": 1.15, "dynamic": 1.25}


def rounds_to_resolve(median: float, lo: float, hi: float, rounds: int, target: float) -> int | None:
    """Rounds after which the interval ``lo..hi`` of ``rounds`` ratios would clear ``target``, if the
    median and the per-round spread held (run-to-run drift makes this a lower bound): an
    order-statistic interval narrows as ``1 / sqrt(rounds)``, so its half-width on the target's side
    must shrink to the median's distance from the target. ``None`` when the median is the target."""
    gap = abs(target - median)
    if gap == 0:
        return None
    half = hi - median if median < target else median - lo
    return max(rounds, round(rounds * (half / gap) ** 2))


def against(target: float, lo: float, hi: float) -> str:
    """A ratio's interval ``lo..hi`` against its upper ``target``: met, missed or not resolved."""
    return "met" if hi <= target else "missed" if lo > target else "not resolved"


def verdict(name: str, median: float, lo: float, hi: float, coverage: float, rounds: int) -> str:
    """Whether a row's confidence interval ``lo..hi`` of the median time ratio meets its target
    (none below 95 % coverage: fewer than 6 rounds), and if not resolved how many rounds might
    resolve it; for the A/A row, whether the interval contains 1."""
    target = TIME_TARGETS.get(name.partition("+")[0])
    if name == AA and coverage >= 0.95:
        return "contains 1: no bias resolved" if lo <= 1 <= hi else "excludes 1: the bench is biased"
    if target is None:
        return ""
    if coverage < 0.95:
        return f"<= {target:.2f}: too few rounds to tell"
    if (state := against(target, lo, hi)) != "not resolved":
        return f"<= {target:.2f}: {state}"
    needed = rounds_to_resolve(median, lo, hi, rounds, target)
    hint = "median on the target" if needed is None else f"~{needed} rounds at this spread"
    return f"<= {target:.2f}: not resolved ({hint})"


def build(name: str, args: argparse.Namespace) -> torch.nn.Module:
    """The model of one row at the benchmark's size: a cross-layer baseline named by its arch
    (``denseformer``, ``resformer``, ``hyperconnections``: ``lime_model.ARCHITECTURES``), or LIMe
    with routing ``name`` (``"none"`` = LLaMA); ``<routing>+recompute`` sets ``recompute_routed_kv``."""
    name, _, option = ("none", "", "") if name == AA else name.partition("+")
    if option not in ("", "recompute"):
        raise SystemExit(f"{name}+{option}: the only row option is +recompute")
    arch, routing = (name, "none") if name in ARCHITECTURES and name != "lime" else ("lime", name)
    extra = {"recompute_routed_kv": True} if option else {}
    torch.manual_seed(0)
    try:
        cfg = config_for(
            arch,
            routing=routing,
            **extra,
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,  # the paper's 1B ratio (2048 -> 8192)
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads or args.heads,
            tie_word_embeddings=True,
        )
    except ValueError as err:  # a bad routing spec or size
        raise SystemExit(f"{name}: {err}") from None
    with torch.device(args.device):  # a 1B model took 11-18 s to initialise on a 2-core host
        return AutoModelForCausalLM.from_config(cfg).train()


class Steps:
    """One model's two timed steps: ``stack`` (decoder layers only) and ``model`` (full step)."""

    def __init__(self, routing: str, args: argparse.Namespace) -> None:
        self.model = build(routing, args)
        self.dtype = getattr(torch, args.dtype)
        gen = torch.Generator().manual_seed(1)
        shape = (args.batch, args.seq)
        self.ids = torch.randint(0, args.vocab, shape, generator=gen).to(args.device)
        self.embeds = torch.randn(*shape, args.hidden, generator=gen).to(args.device)
        self.probe = torch.randn(*shape, args.hidden, generator=gen).to(args.device)
        compiled = partial(torch.compile, backend=args.compile_backend)
        self.stack = compiled(self.model.model) if args.compile else self.model.model
        self.full = compiled(self.model) if args.compile else self.model

    def run(self, scope: str) -> None:
        with torch.autocast(self.ids.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            if scope == "stack":  # no cache, as lime_model.train calls the model
                hidden = self.stack(inputs_embeds=self.embeds, use_cache=False).last_hidden_state
                loss = (hidden.float() * self.probe).mean()
            else:
                loss = self.full(self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        self.model.zero_grad(set_to_none=True)


def median_per_operator(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each operator's median time over profiled ``steps`` (operator -> time), 0 where a step lacks it."""
    return {op: statistics.median(step.get(op, 0.0) for step in steps) for op in set().union(*steps)}


def profile_rows(models: dict[str, Steps], args: argparse.Namespace, top: int = 12) -> None:
    """Print, per row, the operators whose self CPU time per stack step differs most from LLaMA's.

    Each step is profiled on its own, the models interleaved round by round as in the timing, and
    each operator's time is its median over the rounds: on a shared host a neighbour's burst can
    slow every memory-bound operator of one step severalfold (seen: one model's SwiGLU products up
    to 25x slower in one step), which in a sum over steps reads as a difference between models."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, steps in models.items():
            steps.run("stack")  # untimed, as in time_pair
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                steps.run("stack")
            per_step[name].append({e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()})
    per_op = {name: median_per_operator(steps) for name, steps in per_step.items()}
    base = per_op.pop("none")
    print(
        f"[stack] self CPU ms per step by operator, median over {args.rounds} interleaved rounds; "
        f"LLaMA total {sum(base.values()):.1f} ms"
    )
    for name, ops in per_op.items():
        diff = {op: ops.get(op, 0.0) - base.get(op, 0.0) for op in ops.keys() | base.keys()}
        print(f"\n{name}: total {sum(ops.values()):.1f} ms ({sum(diff.values()):+.1f} ms vs LLaMA)")
        print(f"{'operator':<56} {'LLaMA':>8} {name[:8]:>8} {'diff':>8}")
        for op in sorted(diff, key=lambda o: -abs(diff[o]))[:top]:
            print(f"{op[:56]:<56} {base.get(op, 0.0):8.1f} {ops.get(op, 0.0):8.1f} {diff[op]:+8.1f}")
    gemm_rates(args)


def gemm_rates(args: argparse.Namespace, reps: int = 10) -> None:
    """GFLOP/s of the routed read's GEMM shapes at this size next to the layer's q/k/v projection:
    with kv output rows the router GEMMs are far slower per FLOP, and on the CPU a read summed from
    pieces of ``lime_model.kv_buffer.CPU_HEADS_PER_GEMM`` source heads beats one long GEMM."""
    from lime_model.kv_buffer import CPU_HEADS_PER_GEMM

    kv, hd = args.kv_heads or args.heads, args.hidden // args.heads
    n, tokens = args.batch * args.seq * hd, args.batch * args.seq
    piece = max(kv, CPU_HEADS_PER_GEMM // kv * kv)
    print(f"\nGEMM rates at this size (kv = {kv}, B*T*head_dim = {n}), median of {reps}:")
    x, w_qkv = torch.randn(tokens, args.hidden), torch.randn(args.hidden, 3 * args.hidden)
    cases = [
        (
            "projection [B*T, hidden] @ [hidden, 3*hidden]",
            3 * args.hidden * args.hidden * tokens,
            lambda: x @ w_qkv,
        )
    ]
    for layers in sorted({min(4, args.layers) + 1, args.layers}):
        K = layers * kv
        w, src, g = torch.randn(kv, K), torch.randn(K, n), torch.randn(kv, n)

        def pieces(w=w, src=src, K=K):
            out = w[:, :piece] @ src[:piece]
            for i in range(piece, K, piece):
                out.addmm_(w[:, i : i + piece], src[i : i + piece])

        cases += [
            (f"routed read [kv, {K}] @ [{K}, n], one GEMM", kv * K * n, lambda w=w, src=src: w @ src),
            (f"routed read, summed over [{piece}]-head pieces", kv * K * n, pieces),
            (f"weight gradient [kv, n] @ [n, {K}]", kv * K * n, lambda g=g, src=src: g @ src.t()),
        ]
    for name, macs, fn in cases:
        times = []
        for _ in range(reps):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        print(f"  {name:<52} {2 * macs / statistics.median(times) / 1e9:6.1f} GFLOP/s")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def in_subprocess(
    flag: str, name: str, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()
) -> dict:
    """Run this script again with ``flag name``, this run's arguments and then ``extra`` (which win
    over them); its last line is JSON."""
    cmd = [sys.executable, __file__, flag, name, *sys.argv[1:], *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit((done.stderr.strip().splitlines() or [f"{name}: exit {done.returncode}"])[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_memory_mb(routing: str, args: argparse.Namespace) -> dict[str, float]:
    """Rise of peak memory over one step per scope, median over fresh processes.

    glibc serves tensors above the mmap threshold with their own mappings, returned to the system
    when freed, so with a fixed 1 MiB threshold the resident set follows live tensor memory rather
    than the allocator's free lists.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    runs = [in_subprocess("--_memory-of", routing, env) for _ in range(args.memory_runs)]
    return {scope: statistics.median(r[scope] for r in runs) for scope in SCOPES}


def time_pair(variant: str, args: argparse.Namespace) -> None:
    """Print the step times of LLaMA (``base``) and ``variant``, interleaved over rounds, per scope
    (JSON). ``--_variant-first`` builds and times the variant first (see ``pair_times``)."""
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    roles = ("variant", "base") if args.variant_first else ("base", "variant")
    models = {role: Steps("none" if role == "base" else variant, args) for role in roles}
    for steps in models.values():  # warm-up (and compilation)
        for scope in args.scopes:
            steps.run(scope)
    times = {role: {scope: [] for scope in args.scopes} for role in models}
    for _ in range(args.rounds):
        for scope in args.scopes:
            for role, steps in models.items():
                steps.run(scope)  # untimed: the allocator settles on this model's sizes (docstring)
                sync(args.device)
                start = clock()
                steps.run(scope)
                sync(args.device)
                times[role][scope].append(clock() - start)
    print(json.dumps(times))


def pair_times(variant: str, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """LLaMA's (``base``) and ``variant``'s step times per scope, round for round, from
    ``args.processes`` fresh processes that share the rounds: even ones build and time LLaMA first,
    odd ones the variant.

    Why both orders: of two identical LLaMAs in one process, the second ran faster in seven
    processes of nine (module docstring), so a fixed order may bias every ratio the same way. Why
    several processes: a process's heap placement can move its ratio for all its rounds (the same GEMM
    shape ran 7-15 % slower in one model of a process than in the other), so rounds spread over
    processes sample that too."""
    k = min(args.processes, args.rounds)
    runs = []
    for i in range(k):
        rounds = args.rounds // k + (i < args.rounds % k)
        order = ("--_variant-first",) if i % 2 else ()
        runs.append(in_subprocess("--_pair-of", variant, extra=("--rounds", str(rounds), *order)))
    return {
        role: {scope: [t for run in runs for t in run[role][scope]] for scope in args.scopes}
        for role in ("base", "variant")
    }


def measure_memory(routing: str, args: argparse.Namespace) -> None:
    steps = Steps(routing, args)
    peaks = {}
    for scope in SCOPES:
        steps.run(scope)  # warm up: allocate gradients and caches once
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            steps.run(scope)
            peaks[scope] = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
                f.write("5")
            base = _rss_kb("VmRSS")
            steps.run(scope)
            peaks[scope] = (_rss_kb("VmHWM") - base) / 1024
    print(json.dumps(peaks))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--layers", type=POSITIVE_INT, default=16)
    parser.add_argument("--hidden", type=POSITIVE_INT, default=256)
    parser.add_argument("--heads", type=POSITIVE_INT, default=8)
    parser.add_argument("--kv-heads", type=POSITIVE_INT, default=None, help="default: heads (MHA)")
    parser.add_argument("--vocab", type=POSITIVE_INT, default=4096, help="see the module docstring")
    parser.add_argument("--batch", type=POSITIVE_INT, default=8)
    parser.add_argument("--seq", type=POSITIVE_INT, default=256)
    parser.add_argument(
        "--rounds", type=POSITIVE_INT, default=6, help="interleaved rounds (ratios: median over rounds)"
    )
    parser.add_argument(
        "--processes",
        type=POSITIVE_INT,
        default=2,
        help="fresh processes per pair sharing the rounds, alternating which model is built first",
    )
    parser.add_argument(
        "--memory-runs", type=POSITIVE_INT, default=3, help="fresh processes per model for peak memory"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend")
    parser.add_argument(
        "--threads", type=POSITIVE_INT, default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu = this process's CPU time: less sensitive to other load (use with --threads 1)",
    )
    parser.add_argument(
        "--scopes",
        nargs="+",
        choices=SCOPES,
        default=list(SCOPES),
        help="which steps to time (default: both)",
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--profile", action="store_true", help="per-operator breakdown instead of timing")
    parser.add_argument("--_memory-of", dest="memory_of", help=argparse.SUPPRESS)
    parser.add_argument("--_pair-of", dest="pair_of", help=argparse.SUPPRESS)
    parser.add_argument("--_variant-first", dest="variant_first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        return measure_memory(args.memory_of, args)
    if args.pair_of:
        return time_pair(args.pair_of, args)
    names = ["none", *args.variants]
    if args.profile:
        models = {name: Steps(name, args) for name in names}
        for steps in models.values():  # warm-up
            steps.run("stack")
        return profile_rows(models, args)
    pairs = {name: pair_times(name, args) for name in args.variants}
    times = {(name, scope): pairs[name]["variant"][scope] for name in args.variants for scope in args.scopes}
    base = {(name, scope): pairs[name]["base"][scope] for name in args.variants for scope in args.scopes}
    for scope in args.scopes:  # LLaMA's own row: every pair's LLaMA steps
        times["none", scope] = base["none", scope] = [t for name in args.variants for t in base[name, scope]]

    memory = {} if args.no_memory else {name: peak_memory_mb(name, args) for name in names}
    nan = float("nan")
    print(
        f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads or args.heads} kv, "
        f"vocab {args.vocab}, {args.batch}x{args.seq} tokens, {args.dtype} on {args.device}"
        f"{' compiled' if args.compile else ''}, {torch.get_num_threads()} threads, {args.clock} clock, "
        f"{args.rounds} rounds, each variant in its own process with its own LLaMA; time x = median over "
        "rounds of the per-round ratio to that LLaMA, with its order-statistic confidence interval "
        f"(coverage {median_ci_rank(args.rounds)[1]:.1%} at {args.rounds} rounds, distribution-free); "
        "best x = fastest step over its LLaMA's fastest; target: met / missed when the interval lies "
        "below / above the issues' time target, else not resolved"
    )
    for scope in args.scopes:
        print(f"\n[{scope}] {'layer stack only' if scope == 'stack' else 'whole training step'}")
        print(
            f"{'row':<16} {'step s':>7} {'time x':>7} {'CI':>13} {'min-max':>13} {'best x':>7} "
            f"{'peak MB':>8} {'mem x':>6}  target"
        )
        base_m = memory.get("none", {}).get(scope, nan)
        for name in names:
            base_t = base[name, scope]  # the LLaMA of this variant's own process
            ratios = [t / b for t, b in zip(times[name, scope], base_t, strict=True)]
            m = memory.get(name, {}).get(scope, nan)
            # a rise below the RSS's resolution (a toy size) has no ratio
            mem_x = m / base_m if base_m > 0 else nan
            lo, hi, coverage = median_ci(ratios)
            median = statistics.median(ratios)
            print(
                f"{name:<16} {statistics.median(times[name, scope]):7.3f} {median:7.3f} "
                f"{lo:6.3f}-{hi:.3f} {min(ratios):6.3f}-{max(ratios):.3f} "
                f"{min(times[name, scope]) / min(base_t):7.3f} {m:8.1f} {mem_x:6.3f}  "
                f"{verdict(name, median, lo, hi, coverage, len(ratios))}"
            )


if __name__ == "__main__":
    main()
