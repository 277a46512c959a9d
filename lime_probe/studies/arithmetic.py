"""The arithmetic studies on the Arithmetic Expression Task (Fig. 4b), each recipe making its own data:
arithmetic-seeds, arithmetic-kv-init (a 2 x 2 of routing x k/v init) and arithmetic-dose-response."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .parts import LIME, LIME_LLAMA_KV, LLAMA, LLAMA_TORCH_KV, declare, per_layer
from .study import LARGEST, Claim, Effect, Endpoint, Measure, Role, Study

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


def arithmetic_study(
    name: str,
    question: str,
    models: Mapping[str, Mapping[str, Any]],
    seeds: Iterable[int],
    claims: Iterable[Claim],
) -> Study:
    """A study with the arithmetic recipe and measures."""
    return declare(
        name,
        question,
        models,
        seeds,
        claims,
        recipe="arithmetic-cpu",
        measures=ARITHMETIC_MEASURES,
        tiny=ARITHMETIC_TINY,
    )


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


ARITHMETIC_SEEDS = arithmetic_study(
    "arithmetic-seeds",
    "Is LIMe more accurate than LLaMA on the Arithmetic Expression Task (Fig. 4b), over 5 seeds?",
    {"LIMe": LIME, "LLaMA": LLAMA},
    range(5),
    arithmetic_claims("LIMe", "LLaMA", "primary"),
)
ARITHMETIC_KV_INIT = arithmetic_study(
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
)
ARITHMETIC_DOSE_RESPONSE = replace(
    arithmetic_study(
        "arithmetic-dose-response",
        "Is LIMe's arithmetic gain faster learning or capacity? Routing at LLaMA's init, at 1,000 and "
        "4,000 steps, on 2-, 3- and 4-operator expressions",
        DOSE_MODELS,
        range(10),
        _dose_claims(),
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
)
