"""Linear CKA between layers and effective rank per layer (beyond the paper)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.extraction.sites import SITES

from .base import Checkpoint, Result, Spec, curve, extract_site, group, option, slug


@dataclass(frozen=True)
class CkaParams:
    site: str = option("hidden", "representation to probe", choices=SITES)


def compute(cks: Sequence[Checkpoint], texts: Sequence[str], p: CkaParams, extract_kw: dict | None) -> Result:
    """Linear CKA between every pair of layers (extra: the matrices) and the centred effective rank of each
    layer (rows)."""
    from lime_probe.probes.similarity import cka_matrix, effective_ranks

    rows, extra = [], {}
    for ck in cks:
        acts = extract_site(ck, texts, p.site, extract_kw)
        layers = acts.layers(p.site)
        feats = {layer: acts[p.site][layer] for layer in layers}
        cka = cka_matrix(feats, progress=False)
        er = effective_ranks(feats, center=True, progress=False)
        for k, layer in enumerate(layers):
            rows.append(
                {
                    "model": ck.label,
                    "site": p.site,
                    "layer": layer,
                    "effective_rank": float(er[k]),
                    "cka_with_previous": float(cka[k, k - 1]) if k else None,
                    "n_tokens": int(feats[layer].shape[0]),
                }
            )
        extra[ck.label] = {"layers": layers, "cka": cka, "effective_rank": er}
    return Result(
        "cka",
        f"cka_{p.site}",
        f"Layer similarity (CKA) and effective rank of {p.site}",
        rows,
        text=(
            "Linear CKA between the token representations of every pair of layers (1 = the same up to rotation "
            "and scale), and the effective rank (exp of the entropy of the singular values) of each layer's "
            "centred token cloud."
        ),
        extra={"cka": extra},
        columns=("model", "layer", "effective_rank", "cka_with_previous"),
    )


def plot(result: Result) -> dict:
    from lime_probe.output import plots as F

    site = result.rows[0]["site"]
    figures = {}
    for label, m in result.extra["cka"].items():
        figures[f"cka_{site}_{slug(label)}"] = F.plot_heatmap(
            m["cka"],
            row_labels=m["layers"],
            col_labels=m["layers"],
            xlabel="layer",
            ylabel="layer",
            vmin=0.0,
            vmax=1.0,
            title=f"{label}: linear CKA between layers ({site})",
            cbar_label="linear CKA",
        )
    ranks = {m: curve(rs, "effective_rank") for m, rs in group(result.rows, "model").items()}
    figures[f"effective_rank_{site}"] = F.plot_layer_curves(
        ranks, ylabel="effective rank (centred)", title=f"Effective rank of {site} per layer"
    )
    return figures


SPEC = Spec(
    name="cka",
    help="linear CKA between layers and effective rank per layer",
    example="lime-probe cka --ckpt runs/lime --data ../shared/data/wikitext-2/valid.txt --site hidden --max-tokens 2000 "
    "--out out/cka",
    params=CkaParams,
    compute=compute,
    plot=plot,
    notebook="cka",
)
