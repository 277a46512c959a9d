"""What the lime-150m protocol's amendment adds to the study (figures/lime-150m/PROTOCOL.md, "Amendment,
2026-12-04", A5), declared before any run: the separability mixing null, two secondaries that join the
protocol's nine (Holm over the eleven), and the held-out loss trajectory's endpoint (exploratory, outside
the Holm families)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .parts import mixing_split
from .study import LARGEST, Claim, Effect, Endpoint, Measure, OfLargest

MIXED_SITE = "router_mixed_values"  # the separability spec's site of the mixed values (--mix-router)


def held_out_loss(step: Any) -> Endpoint:
    """The held-out loss a run logged at ``step`` (a value, `LARGEST` or `OfLargest`) of its metrics.jsonl."""
    return Endpoint("held-out loss", "curves", "val_loss", {"step": step}, unit="nats per token")


def amendment_measures(converged: Measure) -> dict[str, Measure]:
    """The ``converged`` separability measure on LLaMA's values mixed by the same seed's LIMe routers, and
    the runs' logged curves (their held-out evaluations)."""
    return {
        "separability-mixed": replace(
            converged, params={**converged.params, "mix_router": "{run:LIMe}"}, models=("LLaMA",)
        ),
        "curves": Measure("training-curves", data="none"),
    }


def amendment_claims(values: Endpoint, routed: Endpoint) -> tuple[Claim, ...]:
    """Secondaries 10 and 11 on the converged probe's upper half (``values``: its endpoint on the W_V
    output, ``routed``: on LIMe's routed values), both two-sided, then the trajectory's endpoint."""
    mixed = replace(values, measure="separability-mixed", where={**values.where, "site": MIXED_SITE})
    return (
        *mixing_split(
            values,
            routed,
            mixed,
            "the separability mixing null: LLaMA's values mixed across layers by the same seed's LIMe "
            "routers against LLaMA's values",
        ),
        Claim(
            Effect("gap at the last evaluation", "LIMe", "LLaMA"),
            Effect("gap at three quarters", "LIMe", "LLaMA"),
            held_out_loss(LARGEST),
            "exploratory",
            None,
            "the held-out loss gap's change over the last quarter (step 20,000 against 15,000): 'still "
            "closing' where the interval excludes 0 towards a smaller gap, 'still opening' the other way",
            reference_endpoint=held_out_loss(OfLargest(0.75)),
        ),
    )
