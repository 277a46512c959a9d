"""LIMe router weights, layer x buffered layer and per head (paper Figures 5, 9), and the learned mixing
weights of the cross-layer baselines (DenseFormer's DWA weights, ResFormer's value lambdas, ...).

LIMe's numbers are `lime_probe.probes.router_weights.router_weights`; a baseline's are its base model's
``mixing_weights()`` (title -> 2-D tensor, destination x source), drawn one heatmap per entry. This module
only tabulates and draws them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.sites import routes

from .base import Checkpoint, Result, Spec, extract_site, slug


@dataclass(frozen=True)
class RouterParams:
    """No options: the weights are read from the checkpoint (and, for routing "dynamic", from --data)."""


def has_routers(ck: Checkpoint) -> bool:
    """Whether ``ck`` is a LIMe checkpoint with routers."""
    return routes(ck.config)


def _base(ck: Checkpoint):
    from lime_probe.probes.router_weights import unwrap_model

    module = unwrap_model(ck.model)
    return getattr(module, "base_model", module)


def mixing_weights(ck: Checkpoint) -> dict | None:
    """A baseline's learned cross-layer weights, ``{title: (rows, cols) tensor}``, or None (no such method).
    A model offloaded by a device map reads them from its offload store (its weights brought in for the
    read: these baselines are small)."""
    from lime_probe.extraction.loading import onloaded

    base = _base(ck)
    if not callable(getattr(base, "mixing_weights", None)):
        return None
    with onloaded(base):
        return base.mixing_weights()


def has_weights(ck: Checkpoint) -> bool:
    """Whether the analysis applies: LIMe routers or a baseline's mixing weights."""
    return has_routers(ck) or callable(getattr(_base(ck), "mixing_weights", None))


ROUTER_TEXT = (
    "Normalised |router weight| of each layer over the buffered layers it reads (rows sum to 1), averaged "
    "over heads (first figure per model: trained, initial, and the change) and per KV head. Mass off the "
    "diagonal means the layer reads keys/values of earlier layers; the router starts with much of it "
    "(identity on its own heads, uniform elsewhere), so the change from the initial map (weight_share_initial: "
    "the run's own step 0, rebuilt from its seed, where the checkpoint is a lime-model run folder; else the "
    "init's expected map) is what training did. Baselines: their learned mixing weights as they are (rows: "
    "destination layer, columns: source; table router_mixing_weights)."
)


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str] | None, p: RouterParams, extraction: Extraction
) -> Result:
    """Normalised |router weight| of each LIMe layer over its sources (rows) and per head (extra); each
    baseline's ``mixing_weights()`` as they are (extra ``mixing_weights``, table ``router_mixing_weights``).

    ``texts`` are needed only for routing "dynamic", whose weights depend on the token. Checkpoints with
    neither (LLaMA) are skipped with a note, unless no checkpoint has any (ValueError).
    """
    rows, extra, mixing, skipped = [], {}, {}, []
    for ck in cks:
        if has_routers(ck):
            ck_rows, extra[ck.label] = _router_shares(ck, texts, extraction)
            rows += ck_rows
        elif (weights := mixing_weights(ck)) is not None:
            mixing[ck.label] = {title: w.detach().float().cpu().numpy() for title, w in weights.items()}
        else:
            skipped.append(ck)
    if len(skipped) == len(cks):
        ck = skipped[0]
        raise ValueError(
            f"{ck.label} ({ck.source}) has no LIMe routers (routing {getattr(ck.config, 'routing', None)!r}) "
            "and no cross-layer mixing weights; the router analysis applies to LIMe and the cross-layer baselines"
        )
    mixing_rows = _mixing_rows(mixing)
    note = (
        f" Without cross-layer weights (skipped): {', '.join(ck.label for ck in skipped)}." if skipped else ""
    )
    return Result(
        "router",
        "router",
        "Router weights",
        rows,
        text=ROUTER_TEXT + note,
        extra={"routers": extra, "mixing_weights": mixing},
        columns=("model", "layer", "source_layer", "weight_share", "weight_share_initial"),
        tables={"router_mixing_weights": mixing_rows} if mixing_rows else {},
        summary=_summary(rows, mixing_rows) if mixing_rows else None,
    )


def _router_shares(
    ck: Checkpoint, texts: Sequence[str] | None, extraction: Extraction
) -> tuple[list[dict], dict]:
    """One LIMe checkpoint's rows (a share per layer and source, trained and initial) and its maps: per
    layer (layers, sources), per head, the sources each layer reads and the initial map with what it is."""
    from lime_probe.probes.router_weights import initial_weights, router_weights

    hidden = None
    if ck.config.routing_spec.input_dependent:
        if not texts:
            raise ValueError(f"{ck.label}: routing 'dynamic' depends on the input; give --data")
        acts = extract_site(ck, texts, "hidden", replace(extraction, layers=None))
        hidden = {layer: acts["hidden"][layer] for layer in acts["hidden"]}
    res = router_weights(ck.model, hidden)
    init, init_what = initial_weights(ck.model, ck.source, hidden)
    rows = [
        {
            "model": ck.label,
            "routing": res.routing,
            "layer": i,
            "source_layer": j,
            "weight_share": float(res.per_layer[i, j]),
            "weight_share_initial": float(init.per_layer[i, j]),
        }
        for i, src in enumerate(res.sources)
        for j in src
    ]
    maps = {
        "routing": res.routing,
        "per_layer": res.per_layer,
        "per_head": res.per_head,
        "sources": res.sources,
        "initial_per_layer": init.per_layer,
        "initial": init_what,
    }
    return rows, maps


def _mixing_rows(mixing: dict[str, dict]) -> list[dict]:
    """The baselines' weights as rows, one per finite entry: ``{label: {title: (rows, cols) array}}``."""
    return [
        {"model": label, "weights": title, "layer": i, "source": j, "weight": float(w[i, j])}
        for label, matrices in mixing.items()
        for title, w in matrices.items()
        for i in range(w.shape[0])
        for j in range(w.shape[1])
        if math.isfinite(w[i, j])
    ]


def _summary(router_rows: list[dict], mixing_rows: list[dict]) -> list[dict]:
    """One compact table for LIMe's shares and the baselines' raw weights side by side."""
    shares = [
        {"model": r["model"], "weights": "router share", "layer": r["layer"], "source": r["source_layer"],
         "value": r["weight_share"]}
        for r in router_rows
    ]  # fmt: skip
    return shares + [{**r, "value": r.pop("weight")} for r in map(dict, mixing_rows)]


def plot(result: Result) -> dict:
    from lime_probe.output import plots as F

    figures = {}
    for label, r in result.extra["routers"].items():
        name = f"{label} ({r['routing']})"
        figures[f"router_{slug(label)}"] = F.plot_router_beside_initial(
            r["per_layer"], r["initial_per_layer"], label=name, initial_label=f"initial: {r['initial']}"
        )
        figures[f"router_heads_{slug(label)}"] = F.plot_router_heads(r["per_head"], label=name)
    for label, matrices in result.extra.get("mixing_weights", {}).items():
        for title, w in matrices.items():
            figures[f"mixing_{slug(label)}_{slug(title)}"] = F.plot_mixing_weights(
                w, label=label, title=title
            )
    return figures


SPEC = Spec(
    name="router",
    help="LIMe router weights, layer x buffered layer and per head (paper Figures 5/9); baselines' mixing weights",
    example="lime-probe router --ckpt runs/lime --label LIMe --out out/router",
    params=RouterParams,
    compute=compute,
    plot=plot,
    data_kind="optional-texts",
    notebook="routers",
    applies=has_weights,
    applies_to="LIMe checkpoints with routers and the cross-layer baselines",
)
