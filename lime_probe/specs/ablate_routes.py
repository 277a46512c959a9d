"""Route ablation of LIMe: the loss and value-entropy change when a layer's reads of an earlier layer are cut.

For every routed layer and source layer (and every layer's cross-layer reads at once, and every layer's), the
router weights are zeroed, plain and renormalised (`lime_probe.interventions.route_ablation`), over token
windows packed from --data as the entropy analysis packs them. A heatmap of the loss rise (layer x source)
is drawn beside the router's own weight shares. A model without routes is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.sites import routes

from .base import Checkpoint, Result, Spec, option, seed_option, slug

DEFAULT_WINDOW = 128  # ours: the CPU language models' length; longer windows cost every cut a longer pass
RENORMALIZE = {"both": (False, True), "plain": (False,), "renormalized": (True,)}


@dataclass(frozen=True)
class RouteAblationParams:
    window: int | None = option(
        None,
        f"tokens per window (default: the model's positions, at most {DEFAULT_WINDOW})",
        metavar="T",
        positive=True,
    )
    num_windows: int = option(16, "windows drawn (seeded, without replacement)", metavar="N", positive=True)
    renormalize: str = option(
        "both",
        "cut the weights plainly, renormalise each routed head's remaining weights to their L1 mass before "
        "the cut (ours), or both",
        choices=tuple(RENORMALIZE),
    )
    seed: int = seed_option()


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: RouteAblationParams, extraction: Extraction
) -> Result:
    """One row per model and cut: layer, source, renormalized, loss, delta_loss, value_entropy,
    delta_value_entropy."""
    from lime_model.checks import check_window
    from lime_probe.extraction.windows import max_positions, token_windows
    from lime_probe.interventions.route_ablation import route_ablation
    from lime_probe.probes.router_weights import router_weights

    plain = [ck.label for ck in cks if not routes(ck.config)]
    if plain:
        raise ValueError(
            f"ablate-routes needs LIMe checkpoints that route; {', '.join(plain)} has no routers"
        )
    rows, shares = [], {}
    for ck in cks:
        if p.window is None:
            window = min(DEFAULT_WINDOW, max_positions(ck.model) or DEFAULT_WINDOW)
        else:
            check_window(p.window, ck.config, ck.label, minimum=2)
            window = p.window
        windows = token_windows(texts, ck.tokenizer, window, p.num_windows, seed=p.seed)
        cut_rows = route_ablation(
            ck.model, ck.tokenizer, windows, RENORMALIZE[p.renormalize], extraction.batch_size, p.seed
        )
        rows += [{"model": ck.label, "window": window, "num_windows": len(windows)} | r for r in cut_rows]
        shares[ck.label] = router_weights(ck.model).per_layer
    return Result(
        "ablate-routes",
        "route_ablation",
        "Route ablation",
        rows,
        text=(
            "Each routed layer's weights on one source layer set to zero (every routed head), plain and renormalised "
            "(each head's remaining weights rescaled to their L1 mass before the cut); source 'cross-layer' cuts "
            "every read but the layer's own, layer and source 'all' every layer's. delta_loss: the mean next-token loss "
            "(nats per token) minus the unedited model's, over the same windows; delta_value_entropy: the change "
            "of the matrix entropy of the cut layer's routed values (layer 'all': the mean over the routed layers)."
        ),
        extra={"router_shares": shares},
        columns=("model", "layer", "source", "renormalized", "delta_loss", "delta_value_entropy"),
    )


def plot(result: Result) -> dict:
    """Per model: the loss rise of each single cut (layer x source; plain and renormalised) beside the
    router's normalised weight shares."""
    import numpy as np

    from lime_probe.output import plots as F

    figures = {}
    for model, shares in result.extra["router_shares"].items():
        shares = np.asarray(shares, dtype=float)
        n = shares.shape[0]
        panels = []
        for renorm in sorted({r["renormalized"] for r in result.rows}):
            grid = np.full((n, n), np.nan)
            for r in result.rows:
                if r["model"] == model and r["renormalized"] == renorm and isinstance(r["source"], int):
                    grid[r["layer"], r["source"]] = r["delta_loss"]
            panels.append(
                {"matrix": grid, "row_labels": range(n), "col_labels": range(n), "xlabel": "source layer cut",
                 "ylabel": "block l (reading layer)", "title": "renormalised cut" if renorm else "plain cut", "fmt": ".2g",
                 "cbar_label": "loss rise (nats/token)", "cmap": "RdBu_r",
                 "vmin": -float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else None,
                 "vmax": float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else None}
            )  # fmt: skip
        panels.append(
            {"matrix": np.where(np.tril(np.ones_like(shares)) > 0, shares, np.nan), "row_labels": range(n),
             "col_labels": range(n), "xlabel": "source layer", "ylabel": "block l (reading layer)",
             "title": "router weight share", "cbar_label": "normalised |weight|", "vmin": 0.0, "vmax": 1.0}
        )  # fmt: skip
        figures[f"route_ablation_{slug(model)}"] = F.plot_heatmaps(panels, title=f"{model}: route ablation")
    return figures


SPEC = Spec(
    name="ablate-routes",
    help="LIMe route ablation: the loss and value-entropy change when each layer's read of each earlier layer is cut",
    example="lime-probe ablate-routes --ckpt runs/lime --data data/wikitext-2/test.txt --out out/ablate-routes",
    params=RouteAblationParams,
    compute=compute,
    plot=plot,
    notebook="interventions",
    applies=lambda ck: routes(ck.config),
    in_report=False,
    max_sequences=400,
)
