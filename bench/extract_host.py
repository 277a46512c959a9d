"""The host's work to turn an extraction's landed rows into its result, at the 1B extraction's shape.

What `gpu_check`'s extract section hands the host per batch of the 1B GQA LIMe in bf16 (16 layers, values
and routed values, 4 windows of 2048 tokens: 32 tensors of 8192 x 512 bf16 rows), for ``--batches``
batches: each tensor's rows converted to float32 and the batches concatenated (the baseline, what
extraction did before `Assembly`), against `Assembly.place` putting each batch's rows in their final
place, as float32 (converting on the way, as it did before rows were held in the model's dtype) and as
extraction holds them now (bf16, widened as they are read: `Activations`). No model runs: the rows stand
for what landed in pinned memory. Each round runs the three in a rotating order; a ratio is the median
over rounds of a placement's time over the baseline's in the same round, with the median's
distribution-free interval (``lime_probe.probes.stats.median_ci``). The results are checked equal first.

    OMP_NUM_THREADS=1 python bench/extract_host.py --threads 1     # one thread, as the CPU benches
    python bench/extract_host.py --threads 16                       # the device machine's 16 cores
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402
from lime_probe.extraction import assembly  # noqa: E402
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


def placed(
    landed: list[dict[str, torch.Tensor]], windows: int, seq: int, float32: bool = False
) -> dict[str, torch.Tensor]:
    """Every batch placed in one `Assembly` of all the windows: held as they landed, or as float32."""
    seqs = [[0] * seq for _ in range(windows * len(landed))]
    as_float32 = mock.patch.object(assembly, "host_dtype", lambda dtype: torch.float32)
    with as_float32 if float32 else nullcontext():
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
    runs = {
        "baseline": lambda: baseline(landed),
        "placed, float32": lambda: placed(landed, args.windows, args.seq, float32=True),
        "placed, held": lambda: placed(landed, args.windows, args.seq),
    }
    want = runs["baseline"]()
    for name in list(runs)[1:]:
        got = runs[name]()
        assert all(torch.equal(want[n], got[n].float()) for n in want), f"{name} differs from the baseline"
    del want, got
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        order = list(runs)[r % 3 :] + list(runs)[: r % 3]
        for name in order:
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
    gib = sum(x.numel() for batch in landed for x in batch.values()) * 4 / 2**30
    print(
        f"{args.batches} batches x {args.names} tensors x {args.windows * args.seq} x {args.features} rows "
        f"(bf16 in, {gib:.2f} GiB as float32), {torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    for name, values in seconds.items():
        line = f"  {name:16s} median {statistics.median(values) * 1e3:8.1f} ms"
        if name != "baseline":
            ratios = [p / b for p, b in zip(values, seconds["baseline"], strict=True)]
            low, high, coverage = median_ci(ratios)
            line += f"   / baseline {statistics.median(ratios):.3f} [{low:.3f}-{high:.3f}] ({coverage:.1%} interval)"
        print(line)


if __name__ == "__main__":
    main()
