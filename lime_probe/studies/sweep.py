"""The learning-rate sweep (lm-cpu-lr-sweep, figures/lm-cpu-lr-sweep/PROTOCOL.md): base learning rates x
LIMe's router multipliers at CPU scale on WikiText-2, each family's lowest validation loss on held-out
training text chosen. Its grid, labels and settings are what its extension (sweep_extension.py) and the
studies at its choice (lm_tuned.py) declare with."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .lm_cpu import LM_TINY, lm_study
from .parts import LIME, LLAMA
from .study import LARGEST, Endpoint, Measure, Selection

# Each model family at its own k/v init stated explicitly (the defaults may change; the sweep's meaning
# must not).
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
    """A sweep setting's model label: ``LIMe-lr3e-3-r10`` (family, base rate, router multiplier if any)."""
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
    lm_study(
        "lm-cpu-lr-sweep",
        "Which base learning rate (and, for LIMe, router multiplier) gives each model its lowest "
        "validation loss on held-out training text at CPU scale?",
        SWEEP_MODELS,
        (100, 101, 102),  # apart from the evaluation seeds 0-9 of the study that uses the choice
        (),
    ),
    select=SWEEP,
    overrides={"eval_holdout": SWEEP_HOLDOUT},
    measures={"curves": Measure("training-curves", data="none")},
    tiny={**LM_TINY, "measures": {}},
)
