"""The 150M study (figures/lime-150m/PROTOCOL.md): LIMe against LLaMA at recipe lime-150m on FineWeb-Edu,
5 seeds, with lm-cpu-fair's instruments plus BLiMP, and what its amendment adds (amendment_150m.py);
trained on GPUs outside the runner (figures/lime-150m/run.sh)."""

from __future__ import annotations

from dataclasses import replace

from .amendment_150m import amendment_claims, amendment_measures
from .lm_cpu import LM_MEASURES, LM_TINY, PERPLEXITY, blimp, entropy, lm_study, separability
from .lm_tuned import FAIR_MEASURES, converged_separability, mixing_claims, official_site_converged
from .parts import LIME, LLAMA, per_layer
from .study import Claim

MEASURES_150M = {
    **FAIR_MEASURES,
    "blimp": LM_MEASURES["blimp"],
    **amendment_measures(FAIR_MEASURES["separability-converged"]),
}


def _claims_150m() -> tuple[Claim, ...]:
    """One primary (held-out perplexity, LIMe - LLaMA, two-sided); the paper's representation claims and
    the mixing nulls secondary (Holm over the eleven: the protocol's nine, the amendment's two); the
    held-out loss trajectory and the per-layer readings exploratory."""
    values, routed = entropy(), entropy("routed_values")
    secondary = (
        Claim("LIMe", "LLaMA", values, "secondary", +1, "value entropy on the W_V output (Fig. 2a)"),
        *mixing_claims(values, routed),
        Claim("LIMe", "LLaMA", separability(), "secondary", +1, "the official one-epoch probe (Fig. 2b)"),
        Claim("LIMe", "LLaMA", converged_separability(), "secondary", +1, "the converged probe (Fig. 2b)"),
        official_site_converged(),
        Claim("LIMe", "LLaMA", blimp("values"), "secondary", +1, "BLiMP probes on values (Table 2)"),
        Claim("LIMe", "LLaMA", blimp("hidden"), "secondary", +1, "BLiMP probes on hidden states (Table 2)"),
    )
    return (
        Claim("LIMe", "LLaMA", PERPLEXITY, "primary", None, "held-out perplexity on FineWeb-Edu (Sec. 5.1)"),
        *secondary,
        *amendment_claims(converged_separability(), converged_separability("routed_values")),
        *per_layer([("LIMe", "LLaMA")], [values, separability(), converged_separability()]),
        # LLaMA has no routed values: LIMe's are read against LLaMA's values, as in the secondary
        Claim("LIMe", "LLaMA", routed, "exploratory", per="layer", reference_endpoint=values),
    )


# the smoke size: the tests' tiny model on a small text, its own BPE (lime-150m names a hub tokenizer)
TINY_150M = {
    **LM_TINY,
    "overrides": {
        **LM_TINY["overrides"],
        "tokenizer": None,
        "model.num_attention_heads": 4,
        "model.num_key_value_heads": 4,
        # held-out rows evaluated at every step, so the trajectory's two evaluations exist
        "eval_holdout": 0.1,
        "eval_every": 1,
    },
    "measures": {
        "entropy": {"params": {"num_windows": 8}},
        "entropy-mixed": {"params": {"num_windows": 8}},
        "blimp": {"params": {"max_pairs": 20}},
    },
}

LIME_150M = replace(
    lm_study(
        "lime-150m",
        "At 150M parameters on FineWeb-Edu (GPUs, 5 seeds), is LIMe's held-out perplexity different "
        "from LLaMA's, and do the paper's value-entropy, separability and BLiMP findings hold?",
        {"LIMe": LIME, "LLaMA": LLAMA},
        range(5),
        _claims_150m(),
    ),
    recipe="lime-150m",
    data="fineweb-edu",
    measures=MEASURES_150M,
    tiny=TINY_150M,
)
