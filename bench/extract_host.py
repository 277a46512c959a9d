"""The host's work to turn an extraction's landed rows into its result, at the 1B extraction's shape.

What `gpu_check`'s extract section hands the host per batch of the 1B GQA LIMe in bf16 (16 layers, values
and routed values, 4 windows of 2048 tokens: 32 tensors of 8192 x 512 bf16 rows), for ``--batches``
batches: each tensor's rows converted to float32 and the batches concatenated (the baseline, what
extraction did before `Assembly`), against `Assembly.place` putting each batch's rows in their final
place, converting on the way. No model runs: the rows stand for what landed in pinned memory. Rounds
alternate the two; the ratio is the median over rounds of placed / baseline in the same round, with the
median's distribution-free interval (``lime_probe.probes.stats.median_ci``). Both results are checked
equal first.

    OMP_NUM_THREADS=1 python bench/extract_host.py --threads 1     # one thread, as the CPU benches
    python bench/extract_host.py --threads 16                       # the device machine's 16 cores
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402
from lime_probe.extraction.assembly import Assembly  # noqa: E402
from lime_probe.probes.stats import median_ci  # noqa: E402


def landed_batches(
    batches: int, windows: int, seq: int, names: int, features: int
) -> list[dict[str, torch.Tensor]]:
    """Each batch's rows as they land: name -> (windows * seq, features) bf16."""
    gen = torch.Generator().manual_seed(0)
    return [
        {f"site/{k}": torch.randn(windows * seq, features, generator=gen).bfloat16() for k in range(names)}
        for _ in range(batches)
    ]


def baseline(landed: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each batch converted to float32, then the batches concatenated per name."""
    converted = [{name: x.to(torch.float32) for name, x in batch.items()} for batch in landed]
    return {name: torch.cat([batch[name] for batch in converted]) for name in landed[0]}


def placed(landed: list[dict[str, torch.Tensor]], windows: int, seq: int) -> dict[str, torch.Tensor]:
    """Every batch placed in one `Assembly` of all the windows."""
    seqs = [[0] * seq for _ in range(windows * len(landed))]
    result = Assembly(seqs, 0, "none", None)
    for b, batch in enumerate(landed):
        result.place(list(range(b * windows, (b + 1) * windows)), batch)
    return result.rows


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=POSITIVE_INT, default=4)
    parser.add_argument("--windows", type=POSITIVE_INT, default=4, help="sequences per batch")
    parser.add_argument("--seq", type=POSITIVE_INT, default=2048)
    parser.add_argument("--names", type=POSITIVE_INT, default=32, help="site/layer tensors per batch")
    parser.add_argument("--features", type=POSITIVE_INT, default=512)
    parser.add_argument("--rounds", type=POSITIVE_INT, default=11)
    parser.add_argument("--threads", type=POSITIVE_INT, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    landed = landed_batches(args.batches, args.windows, args.seq, args.names, args.features)
    want, got = baseline(landed), placed(landed, args.windows, args.seq)
    assert all(torch.equal(want[name], got[name]) for name in want), "the two results differ"
    del want, got
    runs = {"baseline": lambda: baseline(landed), "placed": lambda: placed(landed, args.windows, args.seq)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in sorted(runs, reverse=r % 2 == 1):
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
    ratios = [p / b for p, b in zip(seconds["placed"], seconds["baseline"], strict=True)]
    low, high, coverage = median_ci(ratios)
    gib = sum(x.numel() for batch in landed for x in batch.values()) * 4 / 2**30
    print(
        f"{args.batches} batches x {args.names} tensors x {args.windows * args.seq} x {args.features} rows "
        f"(bf16 in, {gib:.2f} GiB float32 out), {torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    for name, values in seconds.items():
        print(f"  {name:8s} median {statistics.median(values) * 1e3:8.1f} ms")
    print(
        f"  placed / baseline: {statistics.median(ratios):.3f} [{low:.3f}-{high:.3f}] ({coverage:.1%} interval)"
    )


if __name__ == "__main__":
    main()
