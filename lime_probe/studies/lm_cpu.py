"""The language-model studies at CPU scale on WikiText-2 and BLiMP: what they share (endpoints, measures,
smoke size, the paper's claims) and the four that test the paper's findings (lm-cpu, lm-cpu-baselines,
lm-cpu-kv-init, lm-cpu-10-seeds). They measure with today's protocol (the paper's Appendix D BLiMP
tasks, the official separability probe, raw and routed values); the three 3-seed ones were first
measured under an earlier one, which their folders describe."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .parts import LIME, LIME_LLAMA_KV, LLAMA, LLAMA_TORCH_KV, declare, per_layer
from .study import Claim, Endpoint, Measure, Role, Study

BASELINES = {
    "DenseFormer": {"routing": "none", "model.arch": "denseformer"},
    "ResFormer": {"routing": "none", "model.arch": "resformer"},
    "HyperConnections": {"routing": "none", "model.arch": "hyperconnections"},
}


PERPLEXITY = Endpoint("perplexity", "perplexity", "perplexity")


def entropy(site: str = "values") -> Endpoint:
    return Endpoint("value entropy", "entropy", "entropy_mean", {"site": site}, over=("layer",), unit="nats")


def separability(site: str = "values") -> Endpoint:
    return Endpoint(
        "separability", "separability", "accuracy_mean", {"site": site}, over=("layer",), part="upper half"
    )


def blimp(site: str) -> Endpoint:
    return Endpoint(
        "BLiMP probe (Table 2)", "blimp", "probe_accuracy_mean", {"site": site}, over=("paradigm", "layer")
    )


LM_MEASURES = {
    "perplexity": Measure("perplexity", data="test"),
    # 256 windows of the model's 128 positions, seed 0 (ours: the number; the unit is the official code's)
    "entropy": Measure("entropy", {"num_windows": 256}, data="test"),
    # every is/are/was/were in every window of the held-out text
    "separability": Measure("separability", {"allow_small_samples": True}, data="test-windows"),
    "blimp": Measure("blimp", data="blimp"),  # Appendix D's ten paradigms, all 1,000 pairs
    "tsne": Measure("tsne", {"per_word": 150}, data="test-windows", per="seed", models=("LIMe", "LLaMA")),
    "router": Measure("router", data="none", per="seed", models=("LIMe",)),
}
LM_TINY: dict[str, Any] = {
    "seeds": (0, 1),
    "overrides": {
        "steps": 4,
        "warmup_steps": 1,
        "max_texts": 2000,
        "model.num_hidden_layers": 2,
        "model.hidden_size": 32,
        "model.intermediate_size": 64,
        "model.vocab_size": 2048,
        "seq_len": 64,
        "batch_size": 4,
        "micro_batch_size": 4,
    },
    "measures": {
        "entropy": {"params": {"num_windows": 8}},
        "blimp": {"params": {"max_pairs": 20}},
        "tsne": {"params": {"per_word": 12, "perplexity": 5.0}},
    },
}


def paper_claims(model: str = "LIMe", reference: str = "LLaMA", role: Role = "primary") -> tuple[Claim, ...]:
    """The paper's language-model claims as ``model`` minus ``reference``, each on its one endpoint; with
    ``role="secondary"`` (a model the paper makes no claim about) no sign."""
    sign = (lambda s: s) if role == "primary" else (lambda s: None)
    return (
        Claim(model, reference, PERPLEXITY, role, sign(-1), "lower held-out perplexity (Sec. 5.1, Fig. 1)"),
        Claim(
            model, reference, entropy(), role, sign(+1), "higher value entropy, mean over layers (Fig. 2a)"
        ),
        Claim(
            model,
            reference,
            separability(),
            role,
            sign(+1),
            "is/are/was/were more separable, upper layers (Fig. 2b)",
        ),
        Claim(model, reference, blimp("values"), role, sign(+1), "BLiMP probes on values (Table 2)"),
        Claim(model, reference, blimp("hidden"), role, sign(+1), "BLiMP probes on hidden states (Table 2)"),
    )


def lm_study(
    name: str,
    question: str,
    models: Mapping[str, Mapping[str, Any]],
    seeds: Iterable[int],
    claims: Iterable[Claim],
) -> Study:
    """A study with the language-model recipe and measures on WikiText-2 and BLiMP."""
    return declare(
        name,
        question,
        models,
        seeds,
        claims,
        recipe="wikitext-cpu",
        measures=LM_MEASURES,
        data="wikitext",
        tiny=LM_TINY,
    )


def _vs_llama(models: Iterable[str]) -> tuple[Claim, ...]:
    models = list(models)
    return (
        *paper_claims(),
        *(c for m in models for c in paper_claims(m, "LLaMA", "secondary")),
        *per_layer([(m, "LLaMA") for m in ["LIMe", *models]], [entropy(), separability()]),
    )


TEN_SEEDS_MODELS = {"LIMe": LIME, "LLaMA": LLAMA, "LIMe-LLaMA-kv-init": LIME_LLAMA_KV}
_ROUTING_PAIRS = (("LIMe", "LLaMA"), ("LIMe-LLaMA-kv-init", "LLaMA"), ("LIMe", "LIMe-LLaMA-kv-init"))


def _ten_seeds_claims() -> tuple[Claim, ...]:
    """figures/lm-cpu-10-seeds/PROTOCOL.md's claims: four primary endpoints, the secondary ones of each
    contrast (the paper's sign for LIMe - LLaMA only), routed values between the two routing models,
    and every per-layer difference as exploratory."""
    primary = (
        Claim(
            "LIMe", "LLaMA", entropy(), "primary", +1, "LIMe keeps higher value entropy than LLaMA (Fig. 2a)"
        ),
        Claim(
            "LIMe",
            "LLaMA",
            PERPLEXITY,
            "primary",
            -1,
            "LIMe reaches lower held-out perplexity (Sec. 5.1, Fig. 1)",
        ),
        Claim(
            "LIMe-LLaMA-kv-init",
            "LLaMA",
            entropy(),
            "primary",
            None,
            "routing at LLaMA's init changes value entropy",
        ),
        Claim(
            "LIMe",
            "LIMe-LLaMA-kv-init",
            entropy(),
            "primary",
            None,
            "the k/v init changes LIMe's value entropy",
        ),
    )
    secondary = []
    for model, ref in _ROUTING_PAIRS:
        sign = +1 if (model, ref) == ("LIMe", "LLaMA") else None
        if (model, ref) != ("LIMe", "LLaMA"):
            secondary.append(Claim(model, ref, PERPLEXITY, "secondary", None))
        secondary += [
            Claim(model, ref, separability(), "secondary", sign),
            Claim(model, ref, blimp("values"), "secondary", sign),
            Claim(model, ref, blimp("hidden"), "secondary", sign),
        ]
    routed = "routed_values"
    secondary += [
        Claim("LIMe", "LIMe-LLaMA-kv-init", e, "secondary")
        for e in (entropy(routed), separability(routed), blimp(routed))
    ]
    exploratory = per_layer(_ROUTING_PAIRS, [entropy(), separability()]) + per_layer(
        [("LIMe", "LIMe-LLaMA-kv-init")], [entropy(routed), separability(routed)]
    )
    return (*primary, *secondary, *exploratory)


LM_CPU = lm_study(
    "lm-cpu",
    "Do the paper's language-model findings hold for LIMe vs LLaMA at CPU scale (16 x 64, 3 seeds)?",
    {"LIMe": LIME, "LLaMA": LLAMA},
    (0, 1, 2),
    _vs_llama([]),
)
LM_CPU_BASELINES = lm_study(
    "lm-cpu-baselines",
    "The same, with the paper's cross-layer baselines (DenseFormer, ResFormer, HyperConnections) vs LLaMA.",
    {"LIMe": LIME, "LLaMA": LLAMA, **BASELINES},
    (0, 1, 2),
    _vs_llama(BASELINES),
)
LM_CPU_KV_INIT = lm_study(
    "lm-cpu-kv-init",
    "How much of LIMe's difference from LLaMA is its k/v init? (LIMe at LLaMA's init, LLaMA at LIMe's)",
    {
        "LIMe": LIME,
        "LLaMA": LLAMA,
        "LIMe-LLaMA-kv-init": LIME_LLAMA_KV,
        "LLaMA-torch-kv-init": LLAMA_TORCH_KV,
    },
    (0, 1, 2),
    (
        *_vs_llama(["LIMe-LLaMA-kv-init", "LLaMA-torch-kv-init"]),
        # the protocol's comparisons that are not against LLaMA (its comparison 2 and the addendum)
        *paper_claims("LIMe-LLaMA-kv-init", "LIMe", "secondary"),
        *paper_claims("LIMe", "LLaMA-torch-kv-init", "secondary"),
        *per_layer(
            [("LIMe-LLaMA-kv-init", "LIMe"), ("LIMe", "LLaMA-torch-kv-init")],
            [entropy(), separability()],
        ),
    ),
)
LM_CPU_10_SEEDS = lm_study(
    "lm-cpu-10-seeds",
    "The paper's two language-model claims at 10 seeds, and routing vs k/v init (LIMe, LLaMA, LIMe at LLaMA's init).",
    TEN_SEEDS_MODELS,
    range(10),
    _ten_seeds_claims(),
)
