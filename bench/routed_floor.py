"""How low the routed read's step overhead can go on a GPU: the least memory traffic LIMe's read adds to
LLaMA's step, at the device's peak bandwidth, over LLaMA's measured step (a GPU check's JSON).

The count, in units U of one layer's keys (kv x tokens x head_dim x 2 bytes in bf16), for keys and values
each: every reader reads each of its other sources once forward; backward, each source reads each other
reader's kept gradient once for its raw gradient (the same pairs), and its own K/V once for its readers'
weight gradients, in one pass with the first (what ``lime_model.kv_kernels`` does). Nothing else: not the
routed K/V's write, not the own layer's read, not the weight gradients' partial sums. It is a floor for
any implementation that materialises the routed K/V, whatever its kernels: one that hides the read under
compute (a second stream) or fuses it into attention is not bound by it. Per Table 17 row it prints the
floor ratio at peak bandwidth and the share of peak the row's target needs: above about 90 %, no
memory-bound kernel reaches it.

    python bench/routed_floor.py bench/gpu/gpu_check-h100-2026-12-05.json
    python bench/routed_floor.py check.json --bandwidth 4.8    # TB/s, where the device is not listed
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from gpu_targets import STEP_TARGETS  # noqa: E402

from lime_model.command_line import OneLineParser  # noqa: E402
from lime_model.routing import parse_routing  # noqa: E402

# peak HBM bandwidth in TB/s by the device's name (the vendors' data sheets)
PEAK_TB_S = {"H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H200": 4.8}


def pair_counts(routing: str, layers: int) -> tuple[int, int]:
    """``(pairs, sources)``: the (reader, other source) pairs of ``routing`` over ``layers`` layers, and
    the layers that some reader other than themselves reads."""
    spec = parse_routing(routing)
    pairs, read = 0, set()
    for layer in range(layers):
        others = [s for s in spec.sources(layer) if s != layer]
        pairs += len(others)
        read.update(others)
    return pairs, len(read)


def floor_units(routing: str, layers: int) -> int:
    """The least extra traffic of one step in U (keys and values): twice each pair, once each source read."""
    pairs, sources = pair_counts(routing, layers)
    return 2 * (2 * pairs + sources)


def rows(check: dict[str, Any], bandwidth_tb_s: float) -> list[dict[str, Any]]:
    """Each Table 17 row of a GPU check's step section with its floor and what its target needs."""
    s = check["settings"]
    out = []
    for row in check["sections"]["step"]["rows"]:
        shape, routing = row["shape"], row["variant"]
        unit = s["kv"][shape] * s["batch"] * s["seq"] * (s["hidden"] // s["heads"]) * 2
        floor_s = floor_units(routing, s["layers"]) * unit / (bandwidth_tb_s * 1e12)
        target = STEP_TARGETS.get((shape, routing))
        need = None if target is None else floor_s / ((target - 1) * row["llama_step_s"]) * bandwidth_tb_s
        out.append(
            {
                "row": f"{shape} {routing}",
                "measured": row["ratio"],
                "floor_ms": 1e3 * floor_s,
                "floor_ratio": 1 + floor_s / row["llama_step_s"],
                "target": target,
                "needs_tb_s": need,
            }
        )
    return out


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", type=Path, help="a GPU check's JSON with a step section")
    parser.add_argument("--bandwidth", type=float, default=None, help="peak TB/s (default: by device name)")
    args = parser.parse_args()
    if args.bandwidth is not None and args.bandwidth <= 0:
        parser.error(f"--bandwidth {args.bandwidth}: must be a positive number of TB/s")
    try:
        check = json.loads(args.check.read_text())
        name = check["device_name"]
        check["sections"]["step"]["rows"]
    except (OSError, ValueError, KeyError) as err:
        parser.error(
            f"{args.check}: not a GPU check's JSON with a step section ({type(err).__name__}: {err})"
        )
    bandwidth = args.bandwidth or next((v for k, v in PEAK_TB_S.items() if k in name), None)
    if bandwidth is None:
        parser.error(f"no peak bandwidth known for {name!r}: give --bandwidth (TB/s)")
    print(f"{name}, peak {bandwidth} TB/s; ratios over LLaMA's measured step")
    print(f"{'row':<16} {'measured':>8} {'floor ms':>8} {'floor x':>8} {'target':>6} {'target needs':>18}")
    for r in rows(check, bandwidth):
        need = (
            ""
            if r["needs_tb_s"] is None
            else f"{r['needs_tb_s']:.2f} TB/s ({r['needs_tb_s'] / bandwidth:.0%})"
        )
        target = "" if r["target"] is None else f"{r['target']:.3f}"
        print(
            f"{r['row']:<16} {r['measured']:>8.3f} {r['floor_ms']:>8.2f} {r['floor_ratio']:>8.4f} {target:>6} {need:>18}"
        )


if __name__ == "__main__":
    main()
