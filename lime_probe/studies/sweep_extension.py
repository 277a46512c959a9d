"""The learning-rate sweep's extension (figures/lm-cpu-lr-sweep/PROTOCOL.md, its amendment): one more base
rate for both families and one more router multiplier for LIMe at every base rate, on the sweep's budget,
declared as a study of its own whose runs are exactly the new settings' (the sweep's own runs are not
repeated), and the sweep's rule applied over the old and the new settings together."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .study import Selection, Study
from .sweep import LR_SWEEP, SWEEP_LRS, SWEEP_ROUTER_MULTS, lr_setting, sweep_label

NAME = "lm-cpu-lr-sweep-ext"
# 5e-3: between the grid's best base rate (3e-3, both families) and 1e-2, where the parabolas through
# the three means put each family's best (LIMe near 5e-3, LLaMA near 4e-3)
EXTRA_LRS = (5e-3,)
EXTRA_ROUTER_MULTS = (30,)  # x10, LIMe's best, is the edge of {1, 10}: one step of the same ratio past it
FAMILIES = ("LLaMA", "LIMe")


def extension_models() -> dict[str, dict[str, Any]]:
    """The settings of the extended grid that the sweep (`LR_SWEEP`) did not train: LLaMA at each base
    rate of ``EXTRA_LRS``, LIMe at every (base rate, multiplier) of (``SWEEP_LRS`` + ``EXTRA_LRS``) x
    (``SWEEP_ROUTER_MULTS`` + ``EXTRA_ROUTER_MULTS``) not in the sweep. Each is a sweep setting of its
    family with the base rate (`lr_setting`) changed, so k/v init and routing stay the sweep's."""
    llama = LR_SWEEP.models[sweep_label("LLaMA", SWEEP_LRS[0])]
    lime = LR_SWEEP.models[sweep_label("LIMe", SWEEP_LRS[0], SWEEP_ROUTER_MULTS[0])]
    new = {sweep_label("LLaMA", lr): {**llama, **lr_setting(lr)} for lr in EXTRA_LRS}
    for lr in sorted((*SWEEP_LRS, *EXTRA_LRS)):
        for r in (*SWEEP_ROUTER_MULTS, *EXTRA_ROUTER_MULTS):
            if sweep_label("LIMe", lr, r) not in LR_SWEEP.models:
                new[sweep_label("LIMe", lr, r)] = {**lime, **lr_setting(lr, r)}
    return new


def family_selection(sweep: Study, labels: Sequence[str], families: Sequence[str] = FAMILIES) -> Selection:
    """``sweep``'s rule (its endpoint, lowest mean per family) over ``labels``, in their order."""
    assert sweep.select is not None  # the sweep exists to select
    return Selection(
        sweep.select.endpoint, {f: tuple(x for x in labels if x.startswith(f + "-")) for f in families}
    )


# The extension as a study: the sweep (seeds, budget, held-out split, measures, protocol) with only the new
# settings. Its own selection ranks LIMe's new settings (LLaMA has one); the choice is `extended_choice`'s,
# over both grids.
EXTENSION_MODELS = extension_models()
LR_SWEEP_EXT = replace(
    LR_SWEEP,
    name=NAME,
    question="Beyond the sweep's best (one more base rate for both, router x30 for LIMe at every rate): "
    "does either model's lowest validation loss move, and is its best setting interior?",
    models=EXTENSION_MODELS,
    select=family_selection(LR_SWEEP, list(EXTENSION_MODELS), ("LIMe",)),
    results=f"figures/{NAME}",
)


def extended_choice(sweep: Study, extension: Study, folders: Sequence[str | Path]) -> dict[str, str]:
    """``{family: chosen label}`` by the sweep's rule over the sweep's and the extension's settings
    together, each run's endpoint read from the folders' per-run ``curves.csv`` (the sweep's folder
    first: a tie goes to its setting). ValueError naming a setting with no run in the folders."""
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for folder in folders:
        with open(Path(folder) / "curves.csv") as f:
            for r in csv.DictReader(f):
                if r["val_loss"]:
                    row = {"step": float(r["step"]), "val_loss": float(r["val_loss"])}
                    runs.setdefault(r["model"], {}).setdefault(r["seed"], []).append(row)
    labels = [*sweep.models, *extension.models]
    missing = [x for x in labels if x not in runs]
    if missing:
        raise ValueError(f"no validation loss for {', '.join(missing)} in {', '.join(map(str, folders))}")
    rule = family_selection(sweep, labels)
    means = {x: statistics.mean(rule.endpoint.of(rows) for rows in runs[x].values()) for x in labels}
    return rule.choose(means)
