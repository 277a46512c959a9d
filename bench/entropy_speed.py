"""Matrix entropy ("lime" preset) against the official per-sequence float64 t x t loop, side by side.

The baseline is written here from the official analysis code (src/analysis/entropy.py): global per-feature
z-score in float64, then for every sequence K = Z Z^T (t x t), eigvalsh, negative eigenvalues clamped,
p = eig / trace, log(sum p^alpha) / (1 - alpha). Ours is `lime_probe.probes.entropy.stream_entropy`, the code
`lime-probe entropy` runs (two streamed passes: feature moments, then entropies through the smaller Gram,
batched), fed the sequences as one batch. Both see the same float32 data in the same process.

    python bench/entropy_speed.py            # the target shape: 64 x 2048 x 512 (baseline takes minutes)
    python bench/entropy_speed.py --quick    # 4 sequences of the target shape, plus the other shapes

    python bench/entropy_speed.py --threads 1   # stable timings on a busy shared machine

Prints, per shape, both wall times, the speed-up ratio and the max abs difference of per-sequence entropies.
Targets: >= 10x at 64 x 2048 x 512 with max abs diff <= 1e-6; ratio >= 1 at every shape. Where t <= d both
use the same t x t Gram, so the expected ratio there is about 1 (batching and fewer passes give the rest).
On an oversubscribed CPU, multi-threaded BLAS/LAPACK calls stall unpredictably (seen: 10-40x slower and
noisy with 2 threads while other jobs ran); `--threads 1` measures both sides under the same stable regime.
"""

from __future__ import annotations

import argparse
import time

import torch

from lime_model.command_line import POSITIVE_INT, OneLineParser
from lime_probe.probes.entropy import stream_entropy

ALPHA, EPS = 0.5, 1e-5


def official_loop(x: torch.Tensor, alpha: float = ALPHA, eps: float = EPS) -> torch.Tensor:
    """x (n, t, d) -> (n,) entropies the way the official analysis code computes them."""
    x = x.to(torch.float64)
    z = (x - x.mean(dim=(0, 1), keepdim=True)) / (x.std(dim=(0, 1), keepdim=True) + eps)
    out = []
    for seq in z:
        k = seq @ seq.T
        eig = torch.linalg.eigvalsh(k).clamp_(min=0)
        out.append(torch.log(((eig / torch.trace(k)) ** alpha).sum()) / (1 - alpha))
    return torch.stack(out)


def make_data(n: int, t: int, d: int, seed: int = 0) -> torch.Tensor:
    """Activations-like data: a decaying spectrum, anisotropic feature scales and a non-zero mean."""
    g = torch.Generator().manual_seed(seed)
    rank = min(t, d)
    basis = torch.randn(rank, d, generator=g) * torch.linspace(1.0, 0.05, rank).unsqueeze(1)
    x = torch.randn(n, t, rank, generator=g) @ basis + 0.1 * torch.randn(n, t, d, generator=g)
    return (x * torch.rand(d, generator=g) * 3 + torch.randn(d, generator=g)).float()


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def run(n: int, t: int, d: int, repeats: int) -> None:
    x = make_data(n, t, d)
    t_base, base = timed(lambda: official_loop(x), repeats)
    seqs = list(x)
    t_ours, ours = timed(
        lambda: torch.from_numpy(stream_entropy(lambda: [seqs], "lime", n_boot=1).values), repeats
    )
    diff = (base - ours).abs().max().item()
    print(
        f"{n:>5} x {t:>5} x {d:>4} | baseline {t_base:9.3f} s | ours {t_ours:8.3f} s | "
        f"ratio {t_base / t_ours:7.1f}x | max |diff| {diff:.2e}",
        flush=True,
    )


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="4 sequences at the target shape (minutes -> seconds)"
    )
    parser.add_argument("--no-others", action="store_true", help="only the target shape")
    parser.add_argument(
        "--threads", type=POSITIVE_INT, default=None, help="torch threads (default: torch's own choice)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, alpha={ALPHA}, float64")
    run(4 if args.quick else 64, 2048, 512, repeats=1)
    if not args.no_others:
        # t < d, t = d, small t with many sequences, short sequences of wide models.
        for n, t, d, repeats in [(64, 128, 512, 3), (16, 512, 512, 3), (512, 16, 512, 3), (256, 32, 64, 3)]:
            run(n, t, d, repeats)


if __name__ == "__main__":
    main()
