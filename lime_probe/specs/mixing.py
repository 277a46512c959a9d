"""The mixing null of the value analyses (entropy, separability): a model's values (W_V output) mixed across
its layers by a routing checkpoint's learned routers (`lime_probe.probes.router_weights.mix_by_router`), as
LIMe's heads would read them. Given LLaMA's values and a LIMe run of the same seed, it asks how much of
LIMe's difference in its routed values the mixing alone gives."""

from __future__ import annotations

from typing import Any

from .base import Checkpoint, option

MIXED = "router_mixed_values"  # the rows' site of the mixing null (--mix-router)


def mix_router_option(what: str) -> Any:
    """The ``mix_router`` field of an analysis that reports the ``what`` of the mixed values."""
    return option(
        None,
        "the mixing null: a routing checkpoint (a LIMe run) whose learned routers mix this model's values "
        f"(W_V output) across its layers, as LIMe's heads would read them; the {what} of those mixed values "
        f"is reported as site {MIXED!r} instead of the model's own sites (the two models must share "
        "heads and head size; static routing only)",
        metavar="CKPT",
    )


def check_mix_site(mix_router: str | None, site: str | None) -> None:
    """ValueError, one line, when the mixing null is asked for at a site other than the values."""
    if mix_router is not None and site not in (None, "values"):
        raise ValueError(f"--mix-router mixes the values; --site {site} cannot go with it")


def mixing_router(ck: Checkpoint, router_ckpt: str) -> Any:
    """The model of ``router_ckpt`` (loaded), checked before any extraction from ``ck``: ValueError, one
    line, where it is not a LIMe with static routing or its layers are not as many as ``ck``'s."""
    from lime_probe.extraction.loading import load
    from lime_probe.probes.router_weights import mixing_layers

    router_model, _ = load(router_ckpt)
    try:
        layers = mixing_layers(router_model)
    except ValueError as e:
        raise ValueError(f"--mix-router {router_ckpt}: {e}") from None
    own = ck.config.num_hidden_layers
    if layers != own:
        raise ValueError(
            f"--mix-router {router_ckpt} has {layers} layers and {ck.label} {own}: its routers mix the "
            "values of a model of its own depth"
        )
    return router_model
