"""A gpu_check JSON's memory rows against ``lime-model plan`` at this tree, with the earlier rows' models.

Each row of the memory section measured one training step of one model; until the section collected the
earlier rows' models first, a model trained under mixed precision outlived its row in a reference cycle
(accelerate's autocast wrapper of its forward, set on the model itself), so its fp32 parameters counted in
the next row's allocator peak. This prints, per row: the measured peak, today's plan, their gap, the
parameter bytes of the row before it, the measured peak over the plan with and without those bytes, and
what is left without them.
Rows measured with the collection record ``allocated_before`` (what was allocated when the row started),
shown when present. Builds the models on the meta device: no GPU, no weights.

    python bench/memory_rows.py bench/gpu/gpu_check-h200-2026-12-04.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402
import gpu_sections  # noqa: E402

from lime_model.command_line import OneLineParser  # noqa: E402

GiB = 2**30


def parameter_bytes(recipe) -> int:
    """The bytes of ``recipe``'s model's parameters in their own dtype (fp32 as trained)."""
    from transformers import AutoModelForCausalLM

    from lime_model.plan import stand_in_tokenizer
    from lime_model.train import model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(recipe, stand_in_tokenizer(recipe)))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rows_against_plan(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The memory rows of a gpu_check ``result``, in the order they ran, each with today's plan, the
    bytes of the previous row's parameters and the two ratios."""
    from lime_model.plan import step_memory

    s = gpu_check.settings(result["dry_run"])
    shapes = {name: shape for shape, name in gpu_sections.RECIPES.items()}
    out, previous = [], 0
    for row in result["sections"]["memory"]["rows"]:
        routing = "full" if row["model"] == "LIMe" else "none"
        recipe = gpu_sections.recipe_for(s, shapes[row["recipe"]], routing, result["dry_run"])
        plan = step_memory(recipe, gpu=s["device"] == "cuda", micro_batches=1).total
        measured = row["measured_bytes"]
        out.append(
            {
                "row": f"{row['recipe']}, {row['model']}",
                "measured": measured,
                "plan": plan,
                "previous_parameters": previous,
                "allocated_before": row.get("allocated_before"),
                "over_plan": measured / plan,
                "without_previous_over_plan": (measured - previous) / plan,
            }
        )
        previous = parameter_bytes(recipe)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="a gpu_check JSON with a memory section")
    args = parser.parse_args(argv)
    try:
        result = json.loads(args.json.read_text())
        result["sections"]["memory"]["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(
            f"memory_rows: {args.json}: no gpu_check memory rows ({type(err).__name__}: {err})",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    print(
        "| row | measured | plan now | gap | previous row's parameters | allocated at the row's start "
        "| measured / plan | (measured - previous) / plan | left |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows_against_plan(result):
        before = "not recorded" if r["allocated_before"] is None else f"{r['allocated_before'] / GiB:.3f} GiB"
        print(
            f"| {r['row']} | {r['measured'] / GiB:.3f} GiB | {r['plan'] / GiB:.3f} GiB "
            f"| {(r['measured'] - r['plan']) / GiB:+.3f} GiB | {r['previous_parameters'] / GiB:.3f} GiB | {before} "
            f"| {r['over_plan']:.4f} | {r['without_previous_over_plan']:.4f} "
            f"| {(r['measured'] - r['previous_parameters'] - r['plan']) / 2**20:+.2f} MiB |"
        )


if __name__ == "__main__":
    main()
