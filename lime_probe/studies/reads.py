"""The route-ablation study (figures/route-ablation/PROTOCOL.md): does a trained LIMe use its reads of
earlier layers? Its models are lm-cpu-fair's LIMe and LLaMA, with lm-cpu-fair's mixing null beside the
cuts (lm_tuned.py)."""

from __future__ import annotations

from dataclasses import replace

from .lm_cpu import LM_TINY, entropy, lm_study
from .lm_tuned import FAIR_LIME, FAIR_LLAMA, FAIR_MEASURES, MIXED_ENTROPY
from .study import Claim, Endpoint, Measure

# Every layer's cross-layer reads cut at once (plain or renormalised), read from `ablate-routes`' rows.
ALL_CUT = {"layer": "all", "source": "all"}


def cut_endpoints(renormalized: bool) -> tuple[Endpoint, Endpoint]:
    """(LIMe's held-out loss with every cross-layer read cut, its own loss on the same windows)."""
    where = {**ALL_CUT, "renormalized": renormalized}
    how = "renormalised" if renormalized else "plain"
    return (
        Endpoint(
            f"held-out loss, every cross-layer read cut ({how})", "ablate-routes", "loss", where, unit="nats"
        ),
        Endpoint("held-out loss, unedited", "ablate-routes", "base_loss", where, unit="nats"),
    )


def layer_cut_endpoints() -> tuple[Endpoint, Endpoint]:
    """Per layer: LIMe's held-out loss with that layer's cross-layer reads cut (plain), and its own."""
    where = {"source": "cross-layer", "renormalized": False}
    return (
        Endpoint(
            "held-out loss, the layer's cross-layer reads cut", "ablate-routes", "loss", where, ("layer",)
        ),
        Endpoint("held-out loss, unedited", "ablate-routes", "base_loss", where, ("layer",)),
    )


def entropy_endpoints() -> tuple[Endpoint, Endpoint]:
    """(the mean routed-value entropy over the routed layers with every cross-layer read cut, without)."""
    where = {**ALL_CUT, "renormalized": False}
    return (
        Endpoint("routed-value entropy, every cross-layer read cut", "ablate-routes", "value_entropy", where),
        Endpoint("routed-value entropy, unedited", "ablate-routes", "base_value_entropy", where),
    )


def route_ablation_claims() -> tuple[Claim, ...]:
    """One primary (the loss rise of the plain cut of every cross-layer read, predicted positive), three
    secondaries (Holm over them) and the per-layer cuts (exploratory)."""
    cut, own = cut_endpoints(False)
    cut_renorm, own_renorm = cut_endpoints(True)
    cut_entropy, own_entropy = entropy_endpoints()
    layer_cut, layer_own = layer_cut_endpoints()
    return (
        Claim(
            "LIMe",
            "LIMe",
            cut,
            "primary",
            +1,
            "uses its reads: loss with every cross-layer read cut minus its own",
            reference_endpoint=own,
        ),  # fmt: skip
        Claim(
            "LIMe",
            "LIMe",
            cut_renorm,
            "secondary",
            +1,
            "the same cut, renormalised",
            reference_endpoint=own_renorm,
        ),  # fmt: skip
        Claim(
            "LIMe",
            "LIMe",
            cut_entropy,
            "secondary",
            None,
            "routed-value entropy with every cross-layer read cut",
            reference_endpoint=own_entropy,
        ),  # fmt: skip
        Claim(
            "LLaMA",
            "LLaMA",
            MIXED_ENTROPY,
            "secondary",
            None,
            "the mixing null beside it: LLaMA's values mixed by the same seed's LIMe routers against its own",
            reference_endpoint=entropy(),
        ),  # fmt: skip
        Claim("LIMe", "LIMe", layer_cut, "exploratory", per="layer", reference_endpoint=layer_own),
    )


ROUTE_ABLATION = replace(
    lm_study(
        "route-ablation",
        "Does a trained LIMe use its reads of earlier layers? Held-out loss with every cross-layer read "
        "cut against its own, per seed, with the mixing null beside it (lm-cpu-fair's LIMe and LLaMA)",
        {"LIMe": FAIR_LIME, "LLaMA": FAIR_LLAMA},
        range(5),
        route_ablation_claims(),
    ),
    # the cuts on LIMe (64 windows of its 128 positions from the held-out text, seed 0), beside the mixing
    # null's two entropy measures on LLaMA (lm-cpu-fair's)
    measures={
        "ablate-routes": Measure(
            "ablate-routes",
            {"window": 128, "num_windows": 64, "renormalize": "both"},
            data="test",
            models=("LIMe",),
        ),
        "entropy": FAIR_MEASURES["entropy"],
        "entropy-mixed": FAIR_MEASURES["entropy-mixed"],
    },
    # the smoke size: the language-model studies' tiny models, few windows of their 64 positions
    tiny={
        **LM_TINY,
        "measures": {
            "ablate-routes": {"params": {"window": 16, "num_windows": 4}},
            "entropy": {"params": {"num_windows": 8}},
            "entropy-mixed": {"params": {"num_windows": 8}},
        },
    },
)
