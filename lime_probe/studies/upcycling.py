"""The upcycling study (figures/upcycling/PROTOCOL.md): a trained LLaMA continued N steps as itself and as
a LIMe upcycled from it (routers at self-only routing), paired by seed, with the language-model studies'
measures and smoke size; its LLaMA is lm-cpu-fair's (lm_tuned.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .lm_cpu import LM_MEASURES, LM_TINY, PERPLEXITY, entropy, lm_study
from .lm_tuned import FAIR_LLAMA
from .parts import per_layer
from .study import Claim, Measure

# The further steps (the base run's length again: the protocol says why); the base run is the recipe's 300.
CONTINUE_STEPS = 300
BASE, CONTINUED, UPCYCLED = "LLaMA-base", "LLaMA-continued", "LIMe-upcycled"


def upcycling_models() -> dict[str, dict[str, Any]]:
    """The three models, in training order: lm-cpu-fair's LLaMA (`FAIR_LLAMA`), then two runs of
    ``CONTINUE_STEPS`` that start from it (``init``): on as a LLaMA, and as a LIMe with full routing and
    the router at 10 x the rate (``train`` upcycles a LLaMA for a routed recipe). Every model states the
    k/v init of the weights it starts from (the LLaMA's normal(0, 0.02))."""
    base = {**FAIR_LLAMA, "model.kv_proj_init": "normal"}
    continued = {**base, "init": "{run:" + BASE + "}", "steps": CONTINUE_STEPS}
    return {
        BASE: base,
        CONTINUED: continued,
        UPCYCLED: {**continued, "routing": "full", "router_lr_mult": 10},
    }


def upcycling_claims() -> tuple[Claim, ...]:
    """One primary (perplexity, upcycled LIMe - LLaMA continued, two-sided), three secondaries (Holm over
    them), value entropy per layer exploratory."""
    return (
        Claim(
            UPCYCLED,
            CONTINUED,
            PERPLEXITY,
            "primary",
            None,
            "held-out perplexity, upcycled LIMe - LLaMA trained on",
        ),
        Claim(UPCYCLED, BASE, PERPLEXITY, "secondary", None, "the upcycled continuation against its start"),
        Claim(CONTINUED, BASE, PERPLEXITY, "secondary", None, "the LLaMA's continuation against its start"),
        Claim(UPCYCLED, CONTINUED, entropy(), "secondary", +1, "value entropy on the W_V output (Fig. 2a)"),
        *per_layer([(UPCYCLED, CONTINUED)], [entropy()]),
    )


UPCYCLING = replace(
    lm_study(
        "upcycling",
        "Given a trained LLaMA and N more steps, is held-out perplexity lower when they train it as a LIMe "
        "upcycled from it (routers starting at self-only routing) than as the LLaMA?",
        upcycling_models(),
        range(10),
        upcycling_claims(),
    ),
    measures={
        "perplexity": LM_MEASURES["perplexity"],
        "entropy": LM_MEASURES["entropy"],
        "router": Measure("router", data="none", per="seed", models=(UPCYCLED,)),
    },
    tiny={
        **LM_TINY,
        "measures": {"entropy": {"params": {"num_windows": 8}}},
        # the smoke size's length, for the continued runs too
        "models": {m: {"steps": LM_TINY["overrides"]["steps"]} for m in (CONTINUED, UPCYCLED)},
    },
)
