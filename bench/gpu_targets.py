"""The GPU check's targets read off its JSON: each one, what was measured and the verdict, as a table.

The targets (ours): every Table 17 row measured; LIMe's compiled step over LLaMA's at most 1.010x with
full routing at the 1B GQA shape, 1.08x at the MHA shape, 1.01x with first-4 at the GQA shape (App. I's
Table 17 gives LIMe at +1.16 % with GQA and +10.49 % with full attention in Inductor's reduced-overhead
mode, +1.57 % and +10.46 % in its default mode, and has no first-4 row); bf16 extraction at most 1.15x a
plain forward; ``lime-model plan`` within 5 % of the allocator's peak for each memory row and the FSDP2
step. A ratio with an interval is met when the interval lies at or below its target, missed when above,
else not resolved; an interval of less than 95 % coverage (too few rounds) says so. A plan's ratio is
one measurement.

    python bench/gpu_targets.py bench/gpu/gpu_check-h100-2026-12-05.json \\
        bench/gpu/gpu_check-h100-2026-12-05-dilated-8.json bench/gpu/gpu_check-h100-2026-12-05-fsdp-memory-probes.json

Several JSONs of one device (a run, then calls that ran what it skipped) read as one: a later file's
section replaces an earlier one's unless it failed, and the step and memory rows join by name, the later
kept. ``bench/gpu_check.py`` prints the same table at the end of a run. Below the targets, one choice the
run decides: whether the compiled read's backward keeps each source's fused pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from gpu_sections import VARIANTS  # noqa: E402
from step_overhead import against  # noqa: E402

from lime_model.command_line import OneLineParser  # noqa: E402

STEP_TARGETS = {("gqa", "full"): 1.010, ("mha", "full"): 1.08, ("gqa", "first-4"): 1.01}
EXTRACT_TARGET = 1.15
PLAN_TOLERANCE = 0.05
SHAPES = ("gqa", "mha")
ROW_KEYS = {"step": ("shape", "variant"), "memory": ("recipe", "model")}


def merged(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """``checks`` (in the order they ran) as one: later sections over earlier ones unless they failed,
    step and memory rows joined by name."""
    out = {**checks[0], "sections": {}, "step_calls": sum("step" in c["sections"] for c in checks)}
    for check in checks:
        for name, body in check["sections"].items():
            earlier = out["sections"].get(name)
            if earlier is None or "error" not in body:
                out["sections"][name] = _joined(name, earlier, body)
    return out


def _joined(name: str, earlier: dict[str, Any] | None, body: dict[str, Any]) -> dict[str, Any]:
    if name not in ROW_KEYS or earlier is None or "error" in earlier:
        return body
    key = ROW_KEYS[name]
    rows = {tuple(r[k] for k in key): r for r in earlier["rows"] + body["rows"]}
    return {**body, "rows": list(rows.values())}


def readings(check: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(target, measured, verdict)`` per target, in the order above."""
    sections = check["sections"]
    step = sections.get("step")
    rows = {} if step is None or _failed(step) else {(r["shape"], r["variant"]): r for r in step["rows"]}
    out = [
        ("every Table 17 row measured in one run", *_rows_measured(step, rows, check.get("step_calls", 1)))
    ]
    for (shape, variant), target in STEP_TARGETS.items():
        name = f"{shape.upper()} {variant} step / LLaMA's <= {target:.3f}"
        out.append((name, *_ratio(rows.get((shape, variant)), "ratio", target)))
    name = f"bf16 extraction / plain forward <= {EXTRACT_TARGET:.2f}"
    out.append((name, *_ratio(sections.get("extract"), "extract_over_plain_time", EXTRACT_TARGET)))
    memory = sections.get("memory")
    if memory is None or _failed(memory):
        out.append(("plan within 5 %, memory rows", *_plan(memory)))
    else:
        out += [(f"plan within 5 %, {r['recipe']} {r['model']}", *_plan(r)) for r in memory["rows"]]
    out.append(("plan within 5 %, FSDP2 step", *_plan(sections.get("fsdp"))))
    return out + _backward_choice(sections.get("kernel"))


def _backward_choice(kernel: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """Not a target, a choice: per shape, the compiled read's backward with each source's fused pass
    (Triton) over the readers computing their own weight gradients; where the latter is faster, it
    should be the default on CUDA (``KVBuffer.defers_weight_grads``)."""
    name = "routed backward, compiled, {}: the sources' fused pass / the readers' own"
    if kernel is None or _failed(kernel) or not kernel.get("compiled_rows"):
        return [(name.format("both shapes"), "", _failed(kernel) or "not run")]
    out = []
    for row in kernel["compiled_rows"]:
        fused = next((r for r in row["result"]["rows"] if r["variant"] == "source, triton"), None)
        if fused is None:
            out.append((name.format(row["shape"].upper()), "", "no Triton kernel ran"))
            continue
        lo, hi = fused["ci"]
        verdict = {
            "met": "the fused pass is faster: keep it",
            "missed": "the readers' own is faster: make it the CUDA default",
        }
        state = against(1.0, lo, hi)
        out.append(
            (
                name.format(row["shape"].upper()),
                f"{fused['x_readers']:.3f} [{lo:.3f}, {hi:.3f}]",
                verdict.get(state, state),
            )
        )
    return out


def _rows_measured(
    step: dict[str, Any] | None, rows: dict[tuple[str, str], Any], calls: int
) -> tuple[str, str]:
    if step is None or _failed(step):
        return "", _failed(step) or "not run"
    wanted = [f"{shape} {v}" for v in VARIANTS for shape in SHAPES]
    missing = [row for row in wanted if tuple(row.split()) not in rows]
    measured = f"{len(wanted) - len(missing)} of {len(wanted)}" + (f" in {calls} calls" if calls > 1 else "")
    if missing:
        return measured, f"missed: not {', '.join(missing)}"
    return measured, "met" if calls == 1 else "missed: not in one run"


def _failed(body: dict[str, Any] | None) -> str:
    return f"failed: {body['error'][:100]}" if body is not None and "error" in body else ""


def _ratio(body: dict[str, Any] | None, key: str, target: float) -> tuple[str, str]:
    if body is None or _failed(body):
        return "", _failed(body) or "not run"
    lo, hi = body["ci"]
    state = against(target, lo, hi)
    if body["coverage"] < 0.95:
        state += f" (a {100 * body['coverage']:.0f} % interval: too few rounds for 95 %)"
    return f"{body[key]:.3f} [{lo:.3f}, {hi:.3f}]", state


def _plan(body: dict[str, Any] | None) -> tuple[str, str]:
    if body is None or _failed(body):
        return "", _failed(body) or "not run"
    ratio = body["measured_over_planned"]
    return f"{ratio:.5f}", "met" if abs(ratio - 1) <= PLAN_TOLERANCE else "missed"


def table(check: dict[str, Any]) -> str:
    """The readings as a markdown table, headed by the device."""
    lines = [
        f"{check['device_name']}: the GPU targets",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    return "\n".join(lines + [f"| {t} | {m} | {v} |" for t, m, v in readings(check)])


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", type=Path, nargs="+", help="GPU checks' JSONs, in the order they ran")
    args = parser.parse_args()
    checks = []
    for path in args.checks:
        try:
            checks.append(json.loads(path.read_text()))
            checks[-1]["sections"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            parser.error(f"{path}: not a GPU check's JSON ({type(err).__name__}: {err})")
    print(table(merged(checks)))


if __name__ == "__main__":
    main()
