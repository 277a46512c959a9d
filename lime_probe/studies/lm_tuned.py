"""The language-model studies at the learning-rate sweep's choice (the sweep: sweep.py and
sweep_extension.py): lm-cpu-fair, and lm-cpu-fair again at the extended sweep's choice
(lm-cpu-fair-interior), at CPU scale on WikiText-2; and the parts of their protocol that route-ablation
(reads.py), upcycling (upcycling.py) and lime-150m declare with (their arms, the mixing null, the
converged probe)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .lm_cpu import LM_MEASURES, LM_TINY, PERPLEXITY, entropy, lm_study, separability
from .parts import mixing_split, per_layer
from .study import Claim, Effect, Endpoint, Measure, Study
from .sweep import SWEEP_MODELS, sweep_label
from .sweep_extension import LR_SWEEP_EXT

# figures/lm-cpu-fair/PROTOCOL.md: each model at the setting lm-cpu-lr-sweep chose (its selection.csv;
# a test holds the two equal), the 2 x 2 of routing x k/v init around them, and LIMe at the router
# multiplier the sweep did not choose.
FAIR_LIME = SWEEP_MODELS[sweep_label("LIMe", 3e-3, 10)]
FAIR_LLAMA = SWEEP_MODELS[sweep_label("LLaMA", 3e-3)]


def fair_models(lime: Mapping[str, Any], llama: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The five arms of figures/lm-cpu-fair/PROTOCOL.md around the chosen ``lime`` and ``llama``
    settings: both, LIMe at router multiplier 1, and each at the other family's k/v init."""
    return {
        "LIMe": lime,
        "LLaMA": llama,
        "LIMe-router-x1": {**lime, "router_lr_mult": 1},
        "LIMe-LLaMA-kv-init": {**lime, "model.kv_proj_init": "normal"},
        "LLaMA-torch-kv-init": {**llama, "model.kv_proj_init": "torch"},
    }


MIXED_ENTROPY = Endpoint(
    "value entropy",
    "entropy-mixed",
    "entropy_mean",
    {"site": "router_mixed_values"},
    over=("layer",),
    unit="nats",
)


def converged_separability(site: str = "values") -> Endpoint:
    return Endpoint(
        "separability, converged probe",
        "separability-converged",
        "accuracy_mean",
        {"site": site},
        over=("layer",),
        part="upper half",
    )


VALUE_NORM = Endpoint(
    "value norm", "separability-converged", "feature_norm", {"site": "values"}, over=("layer",)
)
FAIR_MEASURES = {
    "perplexity": LM_MEASURES["perplexity"],
    "entropy": LM_MEASURES["entropy"],
    # the mixing null: LLaMA's values mixed across its layers by the same seed's LIMe routers
    "entropy-mixed": Measure(
        "entropy", {"num_windows": 256, "mix_router": "{run:LIMe}"}, data="test", models=("LLaMA",)
    ),
    "separability": LM_MEASURES["separability"],  # the official one-epoch probe: fidelity
    "separability-converged": Measure(
        "separability", {"allow_small_samples": True, "method": "logreg"}, data="test-windows"
    ),
    "router": LM_MEASURES["router"],
}


def mixing_claims(values: Endpoint, routed: Endpoint) -> tuple[Claim, ...]:
    """The official analysis's entropy comparison (LIMe's routed values against LLaMA's values) split by
    the mixing null: how much of it LLaMA's own values mixed by LIMe's routers give, and LIMe beyond that
    (secondary, two of them without a stated sign)."""
    return (
        Claim(
            "LIMe",
            "LLaMA",
            routed,
            "secondary",
            +1,
            "the official analysis's comparison: LIMe's routed values against LLaMA's values (Fig. 2a)",
            reference_endpoint=values,
        ),
        *mixing_split(
            values,
            routed,
            MIXED_ENTROPY,
            "the mixing null: LLaMA's values mixed by LIMe's routers against LLaMA's values",
        ),
    )


def official_site_converged() -> Claim:
    """The converged probe on the site the official analysis records for LIMe (its routed values) against
    LLaMA's values (secondary)."""
    return Claim(
        "LIMe",
        "LLaMA",
        converged_separability("routed_values"),
        "secondary",
        +1,
        "the official site comparison on the converged probe",
        reference_endpoint=converged_separability(),
    )


def _fair_claims() -> tuple[Claim, ...]:
    """figures/lm-cpu-fair/PROTOCOL.md: one primary (perplexity, tuned LIMe - tuned LLaMA, two-sided);
    twelve secondaries (Holm over them); per-layer readings exploratory."""
    values, routed = entropy(), entropy("routed_values")
    secondary = (
        Claim("LIMe-router-x1", "LIMe", PERPLEXITY, "secondary", None, "router multiplier 1 against 10"),
        Claim(
            "LLaMA-torch-kv-init", "LLaMA", PERPLEXITY, "secondary", None, "PyTorch's k/v init, no routing"
        ),
        Claim("LIMe-LLaMA-kv-init", "LLaMA", PERPLEXITY, "secondary", None, "routing at LLaMA's k/v init"),
        Claim(
            Effect("routing at PyTorch's init", "LIMe", "LLaMA-torch-kv-init"),
            Effect("routing at LLaMA's init", "LIMe-LLaMA-kv-init", "LLaMA"),
            PERPLEXITY,
            "secondary",
            None,
            "routing x k/v init",
        ),
        Claim("LIMe", "LLaMA", values, "secondary", +1, "value entropy on the W_V output (Fig. 2a)"),
        Claim(
            "LIMe-LLaMA-kv-init", "LLaMA", values, "secondary", None, "routing at LLaMA's init, W_V output"
        ),
        *mixing_claims(values, routed),
        Claim("LIMe", "LLaMA", separability(), "secondary", +1, "the official one-epoch probe (fidelity)"),
        Claim(
            "LIMe",
            "LLaMA",
            converged_separability(),
            "secondary",
            +1,
            "the converged standardised probe (the separability reading; Fig. 2b)",
        ),
        official_site_converged(),
    )
    exploratory = per_layer(
        [("LIMe", "LLaMA")], [values, separability(), converged_separability(), VALUE_NORM]
    )
    return (
        Claim("LIMe", "LLaMA", PERPLEXITY, "primary", None, "held-out perplexity, tuned LIMe - tuned LLaMA"),
        *secondary,
        *exploratory,
    )


def fair_study(name: str, question: str, lime: Mapping[str, Any], llama: Mapping[str, Any]) -> Study:
    """figures/lm-cpu-fair/PROTOCOL.md's study (arms, seeds 0-9, measures, claims) at the chosen
    ``lime`` and ``llama`` settings."""
    return replace(
        lm_study(name, question, fair_models(lime, llama), range(10), _fair_claims()),
        measures=FAIR_MEASURES,
        tiny={
            **LM_TINY,
            "measures": {
                "entropy": {"params": {"num_windows": 8}},
                "entropy-mixed": {"params": {"num_windows": 8}},
            },
        },
    )


LM_CPU_FAIR = fair_study(
    "lm-cpu-fair",
    "At each model's tuned learning rate, is LIMe's held-out perplexity different from LLaMA's? "
    "And do entropy and separability, read on instruments that measure what they name, differ?",
    FAIR_LIME,
    FAIR_LLAMA,
)
# figures/lm-cpu-fair-interior/PROTOCOL.md: lm-cpu-fair's protocol unchanged at the extended sweep's
# choice, both models at base rate 5e-3 and LIMe's router at x10 (a test holds it equal to
# extended_choice over the two sweep folders).
INTERIOR_LIME = LR_SWEEP_EXT.models[sweep_label("LIMe", 5e-3, 10)]
INTERIOR_LLAMA = LR_SWEEP_EXT.models[sweep_label("LLaMA", 5e-3)]
LM_CPU_FAIR_INTERIOR = fair_study(
    "lm-cpu-fair-interior",
    "lm-cpu-fair again at the extended sweep's interior optimum (both models at base rate 5e-3, LIMe's "
    "router at x10): is LIMe's held-out perplexity different from LLaMA's?",
    INTERIOR_LIME,
    INTERIOR_LLAMA,
)
