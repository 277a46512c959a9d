"""The upcycling study (figures/upcycling/PROTOCOL.md): a trained LLaMA continued N steps as itself and as
a LIMe upcycled from it (routers at self-only routing), paired by seed; declared from the language-model
studies' parts (its LLaMA arm, measures and smoke size), which `lime_probe.studies.lm_tuned` passes in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from .study import Claim, Endpoint, Measure, Study

# The further steps (the base run's length again: the protocol says why); the base run is the recipe's 300.
CONTINUE_STEPS = 300
BASE, CONTINUED, UPCYCLED = "LLaMA-base", "LLaMA-continued", "LIMe-upcycled"


def upcycling_models(llama: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The three models, in training order: ``llama`` (recipe overrides of the LLaMA arm), then two runs
    of ``CONTINUE_STEPS`` that start from it (``init``): on as a LLaMA, and as a LIMe with full routing and
    the router at 10 x the rate (``train`` upcycles a LLaMA for a routed recipe). Every model states the
    k/v init of the weights it starts from (the LLaMA's normal(0, 0.02))."""
    base = {**llama, "model.kv_proj_init": "normal"}
    continued = {**base, "init": "{run:" + BASE + "}", "steps": CONTINUE_STEPS}
    return {
        BASE: base,
        CONTINUED: continued,
        UPCYCLED: {**continued, "routing": "full", "router_lr_mult": 10},
    }


def upcycling_claims(perplexity: Endpoint, entropy: Endpoint, per_layer: Callable) -> tuple[Claim, ...]:
    """One primary (perplexity, upcycled LIMe - LLaMA continued, two-sided), three secondaries (Holm over
    them), value entropy per layer exploratory (``per_layer``: the studies' `per_layer`)."""
    return (
        Claim(
            UPCYCLED,
            CONTINUED,
            perplexity,
            "primary",
            None,
            "held-out perplexity, upcycled LIMe - LLaMA trained on",
        ),
        Claim(UPCYCLED, BASE, perplexity, "secondary", None, "the upcycled continuation against its start"),
        Claim(CONTINUED, BASE, perplexity, "secondary", None, "the LLaMA's continuation against its start"),
        Claim(UPCYCLED, CONTINUED, entropy, "secondary", +1, "value entropy on the W_V output (Fig. 2a)"),
        *per_layer([(UPCYCLED, CONTINUED)], [entropy]),
    )


def upcycling_study(
    declare: Callable[..., Study],
    llama: Mapping[str, Any],
    measures: Mapping[str, Measure],
    perplexity: Endpoint,
    entropy: Endpoint,
    per_layer: Callable,
) -> Study:
    """The study, declared with ``declare`` (`lm_study`: the LM recipe, measures, data and
    smoke size), LLaMA arm ``llama``, LM ``measures`` and endpoints."""
    study = declare(
        "upcycling",
        "Given a trained LLaMA and N more steps, is held-out perplexity lower when they train it as a LIMe "
        "upcycled from it (routers starting at self-only routing) than as the LLaMA?",
        upcycling_models(llama),
        range(10),
        upcycling_claims(perplexity, entropy, per_layer),
    )
    steps = study.tiny["overrides"]["steps"]  # the smoke size's length, for the continued runs too
    return replace(
        study,
        measures={
            "perplexity": measures["perplexity"],
            "entropy": measures["entropy"],
            "router": Measure("router", data="none", per="seed", models=(UPCYCLED,)),
        },
        tiny={
            **study.tiny,
            "measures": {"entropy": {"params": {"num_windows": 8}}},
            "models": {CONTINUED: {"steps": steps}, UPCYCLED: {"steps": steps}},
        },
    )
