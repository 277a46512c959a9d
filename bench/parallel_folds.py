"""Speed-up of fitting the probes' folds in parallel (``n_jobs``) over the serial run, on this machine.

Synthetic features shaped as the two commands' workloads, both probes (``adam-linear``, the official one-epoch
probe; ``logreg``, the converged logistic regression):

- ``separability``: 4 words x ``--per-class`` occurrences (the paper has 1,668), ``--layers`` layers of
  width ``--dim``, 5 folds (`token_separability`);
- ``blimp``: one paradigm, ``--pairs`` good/bad pairs (BLiMP has 1,000), the paper's 7 probed layers, 5
  folds grouped by pair (`blimp_probe`).

Each round times the serial run (``n_jobs=1``) and the parallel one (``--jobs``) on the same data in this
process, in alternating order, by wall clock (the parallel run's work is in other processes), and checks
that their fold accuracies are identical. The worker processes start once, before the rounds (their
start-up, importing torch, is printed apart). Prints the median over rounds of serial / parallel time
(the speed-up; > 1 is faster), the serial run's share of one core (its process CPU time over its wall
time: below 100 % the machine is busy), the cores and the load average before and after. Other busy
processes take cores from the workers, and the speed-up with them.

    python bench/parallel_folds.py                       # full size (a few minutes on 2 cores)
    python bench/parallel_folds.py --per-class 200 --pairs 200 --layers 4 --dim 32 --rounds 1   # toy
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from lime_model.command_line import POSITIVE_INT, OneLineParser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--jobs", type=POSITIVE_INT, default=2, help="processes of the parallel run (default: %(default)s)"
    )
    p.add_argument(
        "--per-class",
        type=POSITIVE_INT,
        default=1668,
        help="separability rows per word (default: %(default)s)",
    )
    p.add_argument("--pairs", type=POSITIVE_INT, default=1000, help="BLiMP pairs (default: %(default)s)")
    p.add_argument(
        "--layers", type=POSITIVE_INT, default=16, help="separability layers (default: %(default)s)"
    )
    p.add_argument("--dim", type=POSITIVE_INT, default=256, help="feature width (default: %(default)s)")
    p.add_argument("--rounds", type=POSITIVE_INT, default=3, help="timed rounds (default: %(default)s)")
    p.add_argument(
        "--methods", nargs="+", default=["adam-linear", "logreg"], choices=["adam-linear", "logreg"]
    )
    return p.parse_args(argv)


def features(n_classes: int, n_per_class: int, layers: int, dim: int, seed: int) -> tuple[dict, np.ndarray]:
    """{layer: (n, dim) float32} of Gaussian classes whose means separate more with depth, labels (n,)."""
    g = np.random.default_rng(seed)
    y = np.repeat(np.arange(n_classes), n_per_class)
    means = g.standard_normal((n_classes, dim))
    return {
        la: (0.05 * (la + 1) * means[y] + g.standard_normal((len(y), dim))).astype(np.float32)
        for la in range(layers)
    }, y


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    from lime_probe.probes.blimp import blimp_probe
    from lime_probe.probes.separability import token_separability

    torch.set_num_threads(1)
    sep, words = features(4, args.per_class, args.layers, args.dim, seed=0)
    good, _ = features(1, args.pairs, 7, args.dim, seed=1)
    bad = {la: X + 0.02 * (la + 1) for la, X in features(1, args.pairs, 7, args.dim, seed=2)[0].items()}
    pair_ids = np.arange(args.pairs)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"cores: {cores}; load average before: {os.getloadavg()[0]:.2f}; parallel run: n_jobs={args.jobs}")

    def run(command: str, method: str, n_jobs: int) -> np.ndarray:
        if command == "separability":
            res = token_separability(sep, words, method=method, progress=False, n_jobs=n_jobs)
        else:
            res = blimp_probe(good, bad, pair_ids, method=method, progress=False, n_jobs=n_jobs)
        return res.fold_accuracy

    t = time.perf_counter()
    run("blimp", "logreg", args.jobs)  # starts the workers (kept for the later calls)
    print(f"worker start-up and a first parallel call: {time.perf_counter() - t:.1f} s")
    print(
        f"{'command':<13} {'method':<12} {'serial s':>9} {'parallel s':>10} {'speed-up':>9} {'serial CPU':>10}"
    )
    for command in ("separability", "blimp"):
        for method in args.methods:
            times: dict[int, list[float]] = {1: [], args.jobs: []}
            share = []
            for r in range(args.rounds):
                results = {}
                for n_jobs in (1, args.jobs) if r % 2 == 0 else (args.jobs, 1):
                    t, cpu = time.perf_counter(), time.process_time()
                    results[n_jobs] = run(command, method, n_jobs)
                    times[n_jobs].append(time.perf_counter() - t)
                    if n_jobs == 1:
                        share.append((time.process_time() - cpu) / times[1][-1])
                if not np.array_equal(results[1], results[args.jobs]):
                    raise SystemExit(f"{command} {method}: parallel folds differ from the serial run")
            ratio = statistics.median(s / p for s, p in zip(times[1], times[args.jobs], strict=True))
            print(
                f"{command:<13} {method:<12} {statistics.median(times[1]):>9.2f} "
                f"{statistics.median(times[args.jobs]):>10.2f} {ratio:>8.2f}x {statistics.median(share):>10.0%}"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f} (fold accuracies identical in every round)")


if __name__ == "__main__":
    main()
