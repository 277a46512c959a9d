"""What every family of studies declares with: the model cells (recipe overrides), the per-layer
exploratory claims, and `declare`, which places a study's protocol and results under ``figures/NAME``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .study import Claim, Endpoint, Study

LIME = {"routing": "full"}
LLAMA = {"routing": "none"}
# the k/v-init ablation's cells: LIMe with LLaMA's k/v init (normal(0, 0.02)) instead of the official
# code's PyTorch default, and LLaMA with LIMe's
LIME_LLAMA_KV = {"routing": "full", "model.kv_proj_init": "normal"}
LLAMA_TORCH_KV = {"routing": "none", "model.kv_proj_init": "torch"}


def mixing_split(values: Endpoint, routed: Endpoint, mixed: Endpoint, null: str) -> tuple[Claim, Claim]:
    """LIMe's routed values against LLaMA's values split by the mixing null (``mixed``: LLaMA's values
    mixed by the same seed's LIMe routers): the null against LLaMA's values (worded ``null``), and LIMe
    beyond it; both secondary, two-sided."""
    return (
        Claim("LLaMA", "LLaMA", mixed, "secondary", None, null, reference_endpoint=values),
        Claim(
            "LIMe",
            "LLaMA",
            routed,
            "secondary",
            None,
            "beyond mixing: LIMe's routed values against LLaMA's values mixed by the same routers",
            reference_endpoint=mixed,
        ),
    )


def per_layer(pairs: Iterable[tuple[str, str]], endpoints: Iterable[Endpoint]) -> tuple[Claim, ...]:
    """Exploratory: each endpoint per layer for each (model, reference) pair."""
    endpoints = list(endpoints)  # every layer, not the upper half a summary may average
    return tuple(
        Claim(m, r, replace(e, part="all"), "exploratory", per="layer") for m, r in pairs for e in endpoints
    )


def declare(
    name: str,
    question: str,
    models: Mapping[str, Mapping[str, Any]],
    seeds: Iterable[int],
    claims: Iterable[Claim],
    **fields: Any,
) -> Study:
    """A study of this repository, its protocol and results in ``figures/NAME``; ``fields``: the rest of
    its `Study` fields (recipe, measures, data, smoke size)."""
    return Study(
        name=name,
        question=question,
        models=models,
        seeds=tuple(seeds),
        claims=tuple(claims),
        protocol=f"figures/{name}/PROTOCOL.md",
        results=f"figures/{name}",
        **fields,
    )
