"""LIMe router weights, layer x buffered layer and per head (paper Figures 5, 9).

The numbers are `lime_probe.router.router_weights`; this module only tabulates and draws them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .base import Checkpoint, Result, Spec, extract_site, slug


@dataclass(frozen=True)
class RouterParams:
    """No options: the weights are read from the checkpoint (and, for routing "dynamic", from --data)."""


def has_routers(ck: Checkpoint) -> bool:
    """Whether ``ck`` is a LIMe checkpoint with routers (the analysis applies to no other)."""
    return getattr(ck.config, "routing", None) not in (None, "none")


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str] | None, p: RouterParams, extract_kw: dict | None
) -> Result:
    """Normalised |router weight| of each layer over its sources (rows) and per head (extra).

    ``texts`` are needed only for routing "dynamic", whose weights depend on the token.
    """
    from lime_probe.router import router_weights

    rows, extra = [], {}
    for ck in cks:
        routing = getattr(ck.config, "routing", None)
        if not has_routers(ck):
            raise ValueError(
                f"{ck.label} ({ck.source}) has no LIMe routers (routing {routing!r}); "
                "the router analysis applies to LIMe checkpoints only"
            )
        hidden = None
        if routing == "dynamic":
            if not texts:
                raise ValueError(f"{ck.label}: routing 'dynamic' depends on the input; give --data")
            acts = extract_site(ck, texts, "hidden", {**(extract_kw or {}), "layers": None})
            hidden = {layer: acts["hidden"][layer] for layer in acts["hidden"]}
        res = router_weights(ck.model, hidden)
        for i, src in enumerate(res.sources):
            for j in src:
                rows.append(
                    {
                        "model": ck.label,
                        "routing": res.routing,
                        "layer": i,
                        "source_layer": j,
                        "weight_share": float(res.per_layer[i, j]),
                    }
                )
        extra[ck.label] = {
            "routing": res.routing,
            "per_layer": res.per_layer,
            "per_head": res.per_head,
            "sources": res.sources,
        }
    return Result(
        "router",
        "router",
        "Router weights",
        rows,
        text=(
            "Normalised |router weight| of each layer over the buffered layers it reads (rows sum to 1), averaged "
            "over heads (first figure per model) and per KV head. Mass off the diagonal means the layer reads "
            "keys/values of earlier layers."
        ),
        extra={"routers": extra},
        columns=("model", "layer", "source_layer", "weight_share"),
    )


def plot(result: Result) -> dict:
    from lime_probe import figures as F

    figures = {}
    for label, r in result.extra["routers"].items():
        name = f"{label} ({r['routing']})"
        figures[f"router_{slug(label)}"] = F.plot_router(r["per_layer"], label=name)
        figures[f"router_heads_{slug(label)}"] = F.plot_router_heads(r["per_head"], label=name)
    return figures


SPEC = Spec(
    name="router",
    help="LIMe router weights, layer x buffered layer and per head (paper Figures 5/9)",
    example="lime-probe router --ckpt runs/lime --label LIMe --out out/router",
    params=RouterParams,
    compute=compute,
    plot=plot,
    data_kind="optional-texts",
    notebook="routers",
    applies=has_routers,
)
