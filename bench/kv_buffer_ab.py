"""The routed reads alone, this tree's (``lime_model/kv_*.py``) against an earlier revision's.

A whole training step spends ~90 % of its time outside the router, so on a shared CPU its noise hides a
change to the K/V buffer. This times only what the buffer does: every layer's routed read of keys and
values, forward and backward, at the size of ``step_overhead.py`` (16 layers, hidden 256, 8 heads MHA,
8 x 256 tokens, fp32), with the routers' real weights. The earlier modules are read with ``git show`` and
loaded next to the current ones, both run interleaved in one process, and each round's time ratio is
reported (median, its distribution-free confidence interval and min-max over rounds) with a check that both give the same values and close
gradients. ``MB moved`` is the least memory traffic of this tree's reads (every GEMM operand read and
every result written once) and ``GB/s`` that traffic over its time, next to the process's measured
read bandwidth: how far the reads are from being memory-bound. (Under ``torch.compile`` the same read
runs inside custom operators.)

    python bench/kv_buffer_ab.py --against dbd2689 --threads 1
    python bench/kv_buffer_ab.py --against HEAD~1 --variants full dynamic --rounds 20
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from lime_model import config_for, kv_buffer, kv_read
from lime_model.command_line import POSITIVE_INT, OneLineParser
from lime_model.router import buffer_layout, build_router
from lime_probe.probes.stats import median_ci, median_ci_rank

ROOT = Path(__file__).resolve().parent.parent


CURRENT = SimpleNamespace(KVBuffer=kv_buffer.KVBuffer, routed_read=kv_read.routed_read)


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"--against: {err.stderr.strip()}") from None


def load_revision(rev: str) -> SimpleNamespace:
    """The routed read as of git revision ``rev``: its ``lime_model/kv_*.py`` imported as a separate
    package (earlier revisions kept the read in ``kv_buffer.py``, later ones in ``kv_read.py``)."""
    package = Path(tempfile.mkdtemp()) / "kv_earlier"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for path in git("ls-tree", "--name-only", rev, "lime_model/").split():
        if Path(path).name.startswith("kv_") and path.endswith(".py"):
            (package / Path(path).name).write_text(git("show", f"{rev}:{path}"))
    sys.path.insert(0, str(package.parent))
    buffer = importlib.import_module("kv_earlier.kv_buffer")
    read = importlib.import_module("kv_earlier.kv_read") if (package / "kv_read.py").exists() else buffer
    return SimpleNamespace(KVBuffer=buffer.KVBuffer, routed_read=read.routed_read)


class Chain:
    """One routing variant's routers and fixed inputs: raw K/V ``(B, T, hidden)`` per layer."""

    def __init__(self, routing: str, args: argparse.Namespace) -> None:
        cfg = config_for(
            "lime",
            routing=routing,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            intermediate_size=4 * args.hidden,
            vocab_size=128,
        )
        torch.manual_seed(0)
        self.routers = [build_router(cfg, i) for i in range(args.layers)]
        gen = torch.Generator().manual_seed(1)
        shape = (args.batch, args.seq, args.hidden)
        self.x = torch.randn(*shape, generator=gen)
        self.raw = [torch.randn(*shape, generator=gen) for _ in range(2 * args.layers)]
        head_dim = args.hidden // args.heads
        # the loss's gradient w.r.t. the routed heads in CPU SDPA's (B, T, heads, head_dim) memory,
        # as the model's attention hands it back
        self.probe = torch.randn(args.batch, args.seq, args.heads, head_dim, generator=gen).transpose(1, 2)
        self.sizes = (args.layers, args.heads, head_dim)

    def traffic_bytes(self) -> int:
        """Bytes the routed reads of one forward + backward move at least: every operand of every
        GEMM read once and every result written once, for keys and values. Per layer with ``S``
        source heads (``kv`` own), in heads of ``B*T*head_dim`` floats: forward writes the raw heads
        (read kv, write kv) and mixes (read S, write kv); backward computes the weight gradient (read
        S sources and the kv routed-head gradients) and, at each source, mixes the readers' kept
        gradients back (read S in all, write kv); a layer reading only itself has no weight gradient.
        Per-position weights (``B*T*kv*S`` floats) are read
        by all three GEMMs; static weights are negligible."""
        layers, kv, head_dim = self.sizes
        positions = self.x.shape[0] * self.x.shape[1]
        floats = 0
        for router in self.routers:
            S, mixed = len(router.sources) * kv, len(router.sources) > 1
            floats += positions * head_dim * (2 * kv + (S + kv) * (3 if mixed else 2))
            if router.input_dependent and mixed:
                floats += 3 * positions * kv * S
        return 2 * 4 * floats  # keys and values, fp32

    def run(self, module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Forward and backward through every layer's routed read of ``module``; returns outputs and
        input gradients."""
        buffer = module.KVBuffer(*self.sizes)
        raw = [t.clone().requires_grad_() for t in self.raw]
        outs, loss = [], 0
        for i, router in enumerate(self.routers):
            weight, mode = None, router.own_only_mode
            if len(router.sources) > 1:
                weight, mode = buffer_layout(router.coefficients(self.x), router.input_dependent)
            k, v = module.routed_read(
                buffer, i, raw[i], raw[len(self.routers) + i], weight, router.sources, mode
            )
            outs += [k.detach(), v.detach()]
            loss = loss + (k * self.probe).sum() + (v * self.probe).sum()
        # autograd.grad hands back the gradients as computed (.grad would copy strided ones, which
        # the model's k_proj/v_proj backward reads as they are)
        return outs, list(torch.autograd.grad(loss, raw))


def read_bandwidth(megabytes: int = 512, reps: int = 5) -> float:
    """This process's memory read bandwidth in GB/s: the best of ``reps`` sums over a fresh
    ``megabytes`` tensor, far larger than any cache (process CPU time, as the rounds)."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        x.sum()
        best = min(best, time.process_time() - start)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="git revision whose kv_buffer.py is the baseline")
    parser.add_argument(
        "--variants", nargs="+", default=["full", "first-4", "dilated-8", "per-dim", "dynamic"]
    )
    parser.add_argument("--rounds", type=POSITIVE_INT, default=10)
    parser.add_argument("--layers", type=POSITIVE_INT, default=16)
    parser.add_argument("--hidden", type=POSITIVE_INT, default=256)
    parser.add_argument("--heads", type=POSITIVE_INT, default=8)
    parser.add_argument("--batch", type=POSITIVE_INT, default=8)
    parser.add_argument("--seq", type=POSITIVE_INT, default=256)
    parser.add_argument(
        "--threads", type=POSITIVE_INT, default=None, help="torch CPU threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    earlier = load_revision(args.against)
    chains = {}
    for name in args.variants:
        try:
            chains[name] = Chain(name, args)
        except ValueError as err:
            raise SystemExit(f"{name}: {err}") from None
    print(
        f"routed reads only, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"{args.batch}x{args.seq} tokens, {torch.get_num_threads()} threads, process CPU "
        f"time, {args.rounds} rounds; "
        f"CI = the median ratio's order-statistic interval ({median_ci_rank(args.rounds)[1]:.1%} coverage)"
    )
    bandwidth = read_bandwidth()
    print(
        f"memory read bandwidth {bandwidth:.1f} GB/s; 'GB/s' = the reads' least traffic (Chain.traffic_bytes) "
        "over this tree's median time, so a value near the bandwidth means the reads are memory-bound there"
    )
    print(
        f"{'routing':<12} {args.against[:10]:>10} {'this tree':>10} {'earlier/this':>13} {'CI':>11} {'min-max':>11} "
        f"{'MB moved':>9} {'GB/s':>5}  agreement"
    )
    for name, chain in chains.items():
        # warm-up and check
        (out_a, grad_a), (out_b, grad_b) = chain.run(earlier), chain.run(CURRENT)
        same = all(torch.equal(a, b) for a, b in zip(out_a, out_b, strict=True))
        gap_out = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(out_a, out_b, strict=True))
        gap = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(grad_a, grad_b, strict=True))
        modules = {"earlier": earlier, "this": CURRENT}
        times: dict[str, list[float]] = {"earlier": [], "this": []}
        for _ in range(args.rounds):
            for key, module in modules.items():
                start = time.process_time()
                chain.run(module)
                times[key].append(time.process_time() - start)
        ratios = [a / b for a, b in zip(times["earlier"], times["this"], strict=True)]
        moved, this = chain.traffic_bytes(), statistics.median(times["this"])
        lo, hi, _ = median_ci(ratios)
        print(
            f"{name:<12} {statistics.median(times['earlier']):9.3f}s {this:9.3f}s "
            f"{statistics.median(ratios):13.2f} {lo:5.2f}-{hi:.2f} {min(ratios):5.2f}-{max(ratios):.2f} "
            f"{moved / 1e6:9.0f} {moved / this / 1e9:5.1f}  "
            f"values {'bit-identical' if same else f'max rel diff {gap_out:.1e}'}, gradients max rel diff {gap:.1e}"
        )


if __name__ == "__main__":
    main()
