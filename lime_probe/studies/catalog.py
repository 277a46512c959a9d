"""The studies this repository runs, each a declaration (`Study`); ``lime-probe reproduce --study NAME``.

Each study's protocol, written before its runs, is in its results folder under figures/; its claims
below are that protocol's endpoints. The language-model studies measure with today's protocol (the
paper's Appendix D BLiMP tasks, the official separability probe, raw and routed values); the three
3-seed ones were first measured under an earlier one, which their folders describe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .reads import route_ablation_claims, route_ablation_measures, route_ablation_tiny
from .study import LARGEST, Claim, Effect, Endpoint, Measure, Role, Selection, Study
from .sweep_extension import sweep_extension
from .upcycling import upcycling_study

LIME = {"routing": "full"}
LLAMA = {"routing": "none"}
# the k/v-init ablation's cells: LIMe with LLaMA's k/v init (normal(0, 0.02)) instead of the official
# code's PyTorch default, and LLaMA with LIMe's
LIME_LLAMA_KV = {"routing": "full", "model.kv_proj_init": "normal"}
LLAMA_TORCH_KV = {"routing": "none", "model.kv_proj_init": "torch"}
BASELINES = {
    "DenseFormer": {"routing": "none", "model.arch": "denseformer"},
    "ResFormer": {"routing": "none", "model.arch": "resformer"},
    "HyperConnections": {"routing": "none", "model.arch": "hyperconnections"},
}

# --------------------------------------------------------------------------- language model

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


def per_layer(pairs: Iterable[tuple[str, str]], endpoints: Iterable[Endpoint]) -> tuple[Claim, ...]:
    """Exploratory: each endpoint per layer for each (model, reference) pair."""
    endpoints = list(endpoints)  # every layer, not the upper half a summary may average
    return tuple(
        Claim(m, r, replace(e, part="all"), "exploratory", per="layer") for m, r in pairs for e in endpoints
    )


def study(
    name: str, question: str, models: Mapping[str, Mapping[str, Any]], seeds, claims, lm: bool
) -> Study:
    """A study of this repository: the language-model recipe and measures on WikiText-2 and BLiMP
    (``lm``), else the arithmetic ones; protocol and results in ``figures/NAME``."""
    return Study(
        name=name,
        question=question,
        recipe="wikitext-cpu" if lm else "arithmetic-cpu",
        models=models,
        seeds=tuple(seeds),
        measures=LM_MEASURES if lm else ARITHMETIC_MEASURES,
        claims=tuple(claims),
        data="wikitext" if lm else None,
        protocol=f"figures/{name}/PROTOCOL.md",
        results=f"figures/{name}",
        tiny=LM_TINY if lm else ARITHMETIC_TINY,
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


# --------------------------------------------------------------------------- the learning-rate sweep

# figures/lm-cpu-lr-sweep/PROTOCOL.md: base learning rates x LIMe's router multipliers, each model family
# at its own k/v init stated explicitly (the defaults may change; the sweep's meaning must not).
SWEEP_LRS = (1e-3, 3e-3, 1e-2)
SWEEP_ROUTER_MULTS = (1, 10)
SWEEP_HOLDOUT = 0.1  # the last 10 % of the training text's packed rows: never trained on, never test.txt
VALIDATION_LOSS = Endpoint("validation loss", "curves", "val_loss", {"step": LARGEST}, unit="nats per token")


def lr_setting(lr: float, router_mult: float | None = None) -> dict[str, Any]:
    """Recipe overrides for base rate ``lr``: ``min_lr`` scales with it (the recipe's lr / 10), and the
    router's multiplier when given."""
    out: dict[str, Any] = {"lr": lr, "min_lr": round(lr / 10, 12)}
    return out if router_mult is None else {**out, "router_lr_mult": router_mult}


def sweep_label(model: str, lr: float, router_mult: float | None = None) -> str:
    return f"{model}-lr{lr:.0e}".replace("e-0", "e-") + ("" if router_mult is None else f"-r{router_mult:g}")


SWEEP_MODELS = {
    **{
        sweep_label("LLaMA", lr): {**LLAMA, "model.kv_proj_init": "normal", **lr_setting(lr)}
        for lr in SWEEP_LRS
    },
    **{
        sweep_label("LIMe", lr, r): {**LIME, "model.kv_proj_init": "torch", **lr_setting(lr, r)}
        for lr in SWEEP_LRS
        for r in SWEEP_ROUTER_MULTS
    },
}
SWEEP = Selection(
    VALIDATION_LOSS,
    {family: tuple(x for x in SWEEP_MODELS if x.startswith(family + "-")) for family in ("LLaMA", "LIMe")},
)

LR_SWEEP = replace(
    study(
        "lm-cpu-lr-sweep",
        "Which base learning rate (and, for LIMe, router multiplier) gives each model its lowest "
        "validation loss on held-out training text at CPU scale?",
        SWEEP_MODELS,
        (100, 101, 102),  # apart from the evaluation seeds 0-9 of the study that uses the choice
        (),
        lm=True,
    ),
    select=SWEEP,
    overrides={"eval_holdout": SWEEP_HOLDOUT},
    measures={"curves": Measure("training-curves", data="none")},
    tiny={**LM_TINY, "measures": {}},
)

# --------------------------------------------------------------------------- the fair comparison

# figures/lm-cpu-fair/PROTOCOL.md: each model at the setting lm-cpu-lr-sweep chose (its selection.csv;
# a test holds the two equal), the 2 x 2 of routing x k/v init around them, and LIMe at the router
# multiplier the sweep did not choose.
FAIR_LIME = SWEEP_MODELS[sweep_label("LIMe", 3e-3, 10)]
FAIR_LLAMA = SWEEP_MODELS[sweep_label("LLaMA", 3e-3)]
FAIR_MODELS = {
    "LIMe": FAIR_LIME,
    "LLaMA": FAIR_LLAMA,
    "LIMe-router-x1": {**FAIR_LIME, "router_lr_mult": 1},
    "LIMe-LLaMA-kv-init": {**FAIR_LIME, "model.kv_proj_init": "normal"},
    "LLaMA-torch-kv-init": {**FAIR_LLAMA, "model.kv_proj_init": "torch"},
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


def _mixing_claims(values: Endpoint, routed: Endpoint) -> tuple[Claim, ...]:
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
        Claim(
            "LLaMA",
            "LLaMA",
            MIXED_ENTROPY,
            "secondary",
            None,
            "the mixing null: LLaMA's values mixed by LIMe's routers against LLaMA's values",
            reference_endpoint=values,
        ),
        Claim(
            "LIMe",
            "LLaMA",
            routed,
            "secondary",
            None,
            "beyond mixing: LIMe's routed values against LLaMA's values mixed by the same routers",
            reference_endpoint=MIXED_ENTROPY,
        ),
    )


def _official_site_converged() -> Claim:
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
        *_mixing_claims(values, routed),
        Claim("LIMe", "LLaMA", separability(), "secondary", +1, "the official one-epoch probe (fidelity)"),
        Claim(
            "LIMe",
            "LLaMA",
            converged_separability(),
            "secondary",
            +1,
            "the converged standardised probe (the separability reading; Fig. 2b)",
        ),
        _official_site_converged(),
    )
    exploratory = per_layer(
        [("LIMe", "LLaMA")], [values, separability(), converged_separability(), VALUE_NORM]
    )
    return (
        Claim("LIMe", "LLaMA", PERPLEXITY, "primary", None, "held-out perplexity, tuned LIMe - tuned LLaMA"),
        *secondary,
        *exploratory,
    )


# --------------------------------------------------------------------------- the 150M study (GPUs)

# figures/lime-150m/PROTOCOL.md: LIMe against LLaMA at recipe lime-150m on FineWeb-Edu, 5 seeds, the
# fair comparison's instruments plus BLiMP; trained on GPUs outside the runner (figures/lime-150m/run.sh).
MEASURES_150M = {**FAIR_MEASURES, "blimp": LM_MEASURES["blimp"]}


def _claims_150m() -> tuple[Claim, ...]:
    """One primary (held-out perplexity, LIMe - LLaMA, two-sided); the paper's representation claims and
    the mixing null secondary (Holm over them); per-layer readings exploratory."""
    values, routed = entropy(), entropy("routed_values")
    secondary = (
        Claim("LIMe", "LLaMA", values, "secondary", +1, "value entropy on the W_V output (Fig. 2a)"),
        *_mixing_claims(values, routed),
        Claim("LIMe", "LLaMA", separability(), "secondary", +1, "the official one-epoch probe (Fig. 2b)"),
        Claim("LIMe", "LLaMA", converged_separability(), "secondary", +1, "the converged probe (Fig. 2b)"),
        _official_site_converged(),
        Claim("LIMe", "LLaMA", blimp("values"), "secondary", +1, "BLiMP probes on values (Table 2)"),
        Claim("LIMe", "LLaMA", blimp("hidden"), "secondary", +1, "BLiMP probes on hidden states (Table 2)"),
    )
    return (
        Claim("LIMe", "LLaMA", PERPLEXITY, "primary", None, "held-out perplexity on FineWeb-Edu (Sec. 5.1)"),
        *secondary,
        *per_layer([("LIMe", "LLaMA")], [values, routed, separability(), converged_separability()]),
    )


# the smoke size: the tests' tiny model on a small text, its own BPE (lime-150m names a hub tokenizer)
TINY_150M = {
    **LM_TINY,
    "overrides": {
        **LM_TINY["overrides"],
        "tokenizer": None,
        "model.num_attention_heads": 4,
        "model.num_key_value_heads": 4,
    },
    "measures": {
        "entropy": {"params": {"num_windows": 8}},
        "entropy-mixed": {"params": {"num_windows": 8}},
        "blimp": {"params": {"max_pairs": 20}},
    },
}

# --------------------------------------------------------------------------- arithmetic

ACCURACY = Endpoint("accuracy", "accuracy", "accuracy", {"n_operators": LARGEST}, scale=100, unit="points")
ACCURACY_2 = Endpoint("accuracy", "accuracy", "accuracy", {"n_operators": 2}, scale=100, unit="points")
ARITHMETIC_ENTROPY = Endpoint(
    "value entropy", "entropy", "entropy_mean", {"site": "values"}, over=("layer",), unit="nats"
)
ARITHMETIC_MEASURES = {
    "accuracy": Measure("arithmetic-accuracy", data="none"),  # greedy, as the trainer measured it
    # the W_V output of the first 128 test expressions, one per sequence, as the demo measures it
    "entropy": Measure("entropy", {"site": "values", "unit": "documents"}, data="expressions", max_texts=128),
}
ARITHMETIC_TINY: dict[str, Any] = {
    "seeds": (0, 1, 2),
    "overrides": {
        "steps": 150,
        "warmup_steps": 5,
        "log_every": 10,
        "arithmetic.operators": [1, 2],
        "arithmetic.train_per_tier": 150,
        "arithmetic.test_per_tier": 30,
        "model.hidden_size": 32,
        "model.intermediate_size": 64,
        "model.num_hidden_layers": 2,
        "model.num_attention_heads": 2,
        "model.num_key_value_heads": 2,
        "seq_len": 24,
    },
    "measures": {"entropy": {"max_texts": 16}},
}


def arithmetic_claims(model: str, reference: str, role: Role) -> tuple[Claim, ...]:
    """The hardest tier at ``role``; the 2-operator tier and the mean value entropy secondary; value
    entropy per layer exploratory. Every sign is +1 (the model higher), as the protocols state."""
    return (
        Claim(model, reference, ACCURACY, role, +1),
        Claim(model, reference, ACCURACY_2, "secondary", +1),
        Claim(model, reference, ARITHMETIC_ENTROPY, "secondary", +1),
        *per_layer([(model, reference)], [ARITHMETIC_ENTROPY]),
    )


KV_2X2 = {
    "LIMe": LIME,
    "LLaMA": LLAMA,
    "LIMe-LLaMA-kv-init": LIME_LLAMA_KV,
    "LLaMA-torch-kv-init": LLAMA_TORCH_KV,
}
INTERACTION = Claim(
    Effect("routing at torch init", "LIMe", "LLaMA-torch-kv-init"),
    Effect("routing at LLaMA init", "LIMe-LLaMA-kv-init", "LLaMA"),
    ACCURACY,
    "secondary",
    +1,
    "the routing effect at PyTorch's k/v init minus the one at LLaMA's",
)

# --------------------------------------------------------------------------- arithmetic dose-response

# figures/arithmetic-dose-response/PROTOCOL.md: the clean routing contrast (both at LLaMA's k/v init) at
# two training lengths and three tiers; 4 operators need 53 characters with BOS and EOS, so 56 positions.
DOSE_TIERS = (2, 3, 4)
DOSE_STEPS = {"1k": 1000, "4k": 4000}
DOSE_DATA = {"arithmetic.operators": list(DOSE_TIERS), "arithmetic.test_per_tier": 500, "seq_len": 56}
DOSE_MODELS = {
    f"{label}-{k}": {**cell, "model.kv_proj_init": "normal", "steps": steps}
    for k, steps in DOSE_STEPS.items()
    for label, cell in (("LIMe-LLaMA-kv-init", LIME), ("LLaMA", LLAMA))
}


def accuracy_at(n_operators: int) -> Endpoint:
    return Endpoint(
        "accuracy", "accuracy", "accuracy", {"n_operators": n_operators}, scale=100, unit="points"
    )


def routing_effect(k: str) -> Effect:
    return Effect(f"routing at {DOSE_STEPS[k]:,} steps", f"LIMe-LLaMA-kv-init-{k}", f"LLaMA-{k}")


def _dose_claims() -> tuple[Claim, ...]:
    """One primary endpoint: routing x steps at the hardest tier. Secondary: the routing effect at each
    length and tier, the interaction at the easier tiers, routing x tier (hardest minus easiest) at each
    length, value entropy at each length; Holm over the secondaries."""
    hardest, easiest = accuracy_at(max(DOSE_TIERS)), accuracy_at(min(DOSE_TIERS))
    primary = Claim(
        routing_effect("4k"),
        routing_effect("1k"),
        hardest,
        "primary",
        None,
        "routing x steps at the hardest tier: does LIMe's gain shrink with training (faster learning) or not?",
    )
    secondary = [
        Claim(f"LIMe-LLaMA-kv-init-{k}", f"LLaMA-{k}", accuracy_at(n), "secondary", None)
        for k in DOSE_STEPS
        for n in DOSE_TIERS
    ]
    secondary += [
        Claim(routing_effect("4k"), routing_effect("1k"), accuracy_at(n), "secondary", None)
        for n in DOSE_TIERS
        if n != max(DOSE_TIERS)
    ]
    secondary += [
        Claim(
            routing_effect(k),
            routing_effect(k),
            hardest,
            "secondary",
            None,
            f"routing x tier at {DOSE_STEPS[k]:,} steps: the gain at the hardest tier minus the easiest",
            reference_endpoint=easiest,
        )
        for k in DOSE_STEPS
    ]
    secondary += [
        Claim(f"LIMe-LLaMA-kv-init-{k}", f"LLaMA-{k}", ARITHMETIC_ENTROPY, "secondary", None)
        for k in DOSE_STEPS
    ]
    return (primary, *secondary)


# --------------------------------------------------------------------------- the registry

# Studies whose committed results were trained before the reproducible mode existed: they run without it,
# so that their finished runs are reused (a run is reused only in the mode it was trained in). Every study
# declared after the mode runs in it.
BEFORE_THE_MODE = frozenset(
    {
        "lm-cpu",
        "lm-cpu-baselines",
        "lm-cpu-kv-init",
        "lm-cpu-10-seeds",
        "lm-cpu-lr-sweep",
        "lm-cpu-fair",
        "arithmetic-seeds",
        "arithmetic-kv-init",
    }
)

# Studies trained on GPUs by `accelerate launch` (their folder's run.sh), outside the mode: it pins CPU
# kernels and one thread, and makes CUDA's algorithms deterministic at a cost the study does not need.
ON_GPUS = frozenset({"lime-150m"})

STUDIES: dict[str, Study] = {
    s.name: replace(s, reproducible=s.name not in BEFORE_THE_MODE | ON_GPUS)
    for s in (
        study(
            "lm-cpu",
            "Do the paper's language-model findings hold for LIMe vs LLaMA at CPU scale (16 x 64, 3 seeds)?",
            {"LIMe": LIME, "LLaMA": LLAMA},
            (0, 1, 2),
            _vs_llama([]),
            lm=True,
        ),
        study(
            "lm-cpu-baselines",
            "The same, with the paper's cross-layer baselines (DenseFormer, ResFormer, HyperConnections) vs LLaMA.",
            {"LIMe": LIME, "LLaMA": LLAMA, **BASELINES},
            (0, 1, 2),
            _vs_llama(BASELINES),
            lm=True,
        ),
        study(
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
            lm=True,
        ),
        study(
            "lm-cpu-10-seeds",
            "The paper's two language-model claims at 10 seeds, and routing vs k/v init (LIMe, LLaMA, LIMe at LLaMA's init).",
            TEN_SEEDS_MODELS,
            range(10),
            _ten_seeds_claims(),
            lm=True,
        ),
        LR_SWEEP,
        sweep_extension(LR_SWEEP, SWEEP_LRS, SWEEP_ROUTER_MULTS, sweep_label, lr_setting),
        replace(
            study(
                "lm-cpu-fair",
                "At each model's tuned learning rate, is LIMe's held-out perplexity different from LLaMA's? "
                "And do entropy and separability, read on instruments that measure what they name, differ?",
                FAIR_MODELS,
                range(10),
                _fair_claims(),
                lm=True,
            ),
            measures=FAIR_MEASURES,
            tiny={
                **LM_TINY,
                "measures": {
                    "entropy": {"params": {"num_windows": 8}},
                    "entropy-mixed": {"params": {"num_windows": 8}},
                },
            },
        ),
        replace(
            study(
                "route-ablation",
                "Does a trained LIMe use its reads of earlier layers? Held-out loss with every cross-layer read "
                "cut against its own, per seed, with the mixing null beside it (lm-cpu-fair's LIMe and LLaMA)",
                {"LIMe": FAIR_LIME, "LLaMA": FAIR_LLAMA},
                range(5),
                route_ablation_claims(entropy(), MIXED_ENTROPY),
                lm=True,
            ),
            measures=route_ablation_measures(FAIR_MEASURES["entropy"], FAIR_MEASURES["entropy-mixed"]),
            tiny=route_ablation_tiny(LM_TINY),
        ),
        replace(
            study(
                "lime-150m",
                "At 150M parameters on FineWeb-Edu (GPUs, 5 seeds), is LIMe's held-out perplexity different "
                "from LLaMA's, and do the paper's value-entropy, separability and BLiMP findings hold?",
                {"LIMe": LIME, "LLaMA": LLAMA},
                range(5),
                _claims_150m(),
                lm=True,
            ),
            recipe="lime-150m",
            data="fineweb-edu",
            measures=MEASURES_150M,
            tiny=TINY_150M,
        ),
        upcycling_study(study, FAIR_LLAMA, LM_MEASURES, PERPLEXITY, entropy(), per_layer),
        study(
            "arithmetic-seeds",
            "Is LIMe more accurate than LLaMA on the Arithmetic Expression Task (Fig. 4b), over 5 seeds?",
            {"LIMe": LIME, "LLaMA": LLAMA},
            range(5),
            arithmetic_claims("LIMe", "LLaMA", "primary"),
            lm=False,
        ),
        study(
            "arithmetic-kv-init",
            "Is LIMe's arithmetic gain routing, its k/v init, or both? (a 2 x 2 over 10 seeds)",
            KV_2X2,
            range(10),
            (
                *arithmetic_claims("LIMe-LLaMA-kv-init", "LLaMA", "primary"),  # routing at LLaMA's init
                *arithmetic_claims("LLaMA-torch-kv-init", "LLaMA", "primary"),  # PyTorch's init, no routing
                *arithmetic_claims("LIMe", "LLaMA-torch-kv-init", "secondary"),  # routing at PyTorch's init
                *arithmetic_claims("LIMe", "LIMe-LLaMA-kv-init", "secondary"),  # PyTorch's init with routing
                *arithmetic_claims("LIMe", "LLaMA", "secondary"),  # both
                INTERACTION,
            ),
            lm=False,
        ),
        replace(
            study(
                "arithmetic-dose-response",
                "Is LIMe's arithmetic gain faster learning or capacity? Routing at LLaMA's init, at 1,000 and "
                "4,000 steps, on 2-, 3- and 4-operator expressions",
                DOSE_MODELS,
                range(10),
                _dose_claims(),
                lm=False,
            ),
            overrides=DOSE_DATA,
            tiny={
                **ARITHMETIC_TINY,
                "seeds": (0, 1),
                "overrides": {
                    **ARITHMETIC_TINY["overrides"],
                    "arithmetic.operators": [1, 2, 3],
                    "arithmetic.train_per_tier": 100,
                    "seq_len": 40,
                },
                # each model sets its own length, so the smoke size shortens each
                "models": {m: {"steps": 30 if m.endswith("-1k") else 60} for m in DOSE_MODELS},
            },
        ),
    )
}
