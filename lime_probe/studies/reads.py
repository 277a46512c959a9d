"""The route-ablation study's claims and measures (figures/route-ablation/PROTOCOL.md): does a trained LIMe
use its reads of earlier layers? Its models are lm-cpu-fair's LIMe and LLaMA, so the declaration takes
them, and the mixing null's measures, from lm_tuned.py, which declares it."""

from __future__ import annotations

from collections.abc import Mapping

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


def route_ablation_measures(entropy: Measure, mixed: Measure) -> dict[str, Measure]:
    """The cuts on LIMe (64 windows of its 128 positions from the held-out text, seed 0), beside the mixing
    null's two entropy measures on LLaMA (lm-cpu-fair's)."""
    return {
        "ablate-routes": Measure(
            "ablate-routes",
            {"window": 128, "num_windows": 64, "renormalize": "both"},
            data="test",
            models=("LIMe",),
        ),
        "entropy": entropy,
        "entropy-mixed": mixed,
    }


def route_ablation_claims(values: Endpoint, mixed: Endpoint) -> tuple[Claim, ...]:
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
            mixed,
            "secondary",
            None,
            "the mixing null beside it: LLaMA's values mixed by the same seed's LIMe routers against its own",
            reference_endpoint=values,
        ),  # fmt: skip
        Claim("LIMe", "LIMe", layer_cut, "exploratory", per="layer", reference_endpoint=layer_own),
    )


def route_ablation_tiny(tiny: Mapping) -> dict:
    """The smoke size: the language-model studies' tiny models, few windows of their 64 positions."""
    return {
        **tiny,
        "measures": {
            "ablate-routes": {"params": {"window": 16, "num_windows": 4}},
            "entropy": {"params": {"num_windows": 8}},
            "entropy-mixed": {"params": {"num_windows": 8}},
        },
    }
