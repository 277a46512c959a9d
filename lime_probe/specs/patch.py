"""Activation patching from clean into corrupt prompts, a heatmap of layer x position per checkpoint.

The data is a JSONL file of pairs, one object a line: ``{"clean": ..., "corrupt": ..., "answer": ...,
"wrong": ...}`` (prompts of equal token length, one-token answers). The score of a cell is the normalised
logit-difference recovery (`lime_probe.interventions.patching`): 0 = the corrupt run, 1 = the clean run.
With ``--attribution`` the same grid is also estimated by attribution patching (one backward pass), and the
direct logit attribution of each attention and MLP output is tabulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.sites import check_site

from .base import SITE_HELP, Checkpoint, Result, Spec, option, slug


@dataclass(frozen=True)
class PatchParams:
    site: str = option("hidden", f"the site patched: {SITE_HELP}", type=check_site, metavar="SITE")
    per_head: bool = option(
        False, "patch each kv head of a per-head site (values, keys, routed_*) on its own"
    )
    attribution: bool = option(
        False,
        "also estimate the grid by attribution patching (gradient x activation difference, one backward pass) "
        "and tabulate the direct logit attribution of each attention and MLP output",
    )


def compute(cks: Sequence[Checkpoint], pairs: Sequence, p: PatchParams, extraction: Extraction) -> Result:
    """The patching grid of every checkpoint: one row per model, site, layer, position (and head)."""
    from lime_probe.interventions.logit_attribution import direct_logit_attribution
    from lime_probe.interventions.patching import activation_patching, attribution_patching

    layers = None if extraction.layers is None else list(extraction.layers)
    batch = extraction.batch_size or 32
    rows: list[dict] = []
    tables: dict[str, list[dict]] = {}
    grids = {}
    for ck in cks:
        result = activation_patching(ck.model, ck.tokenizer, pairs, p.site, layers, p.per_head, batch)
        grids[ck.label] = result
        rows += [{"model": ck.label, "method": "activation"} | r for r in result.rows()]
        if p.attribution:
            estimate = attribution_patching(ck.model, ck.tokenizer, pairs, p.site, layers, batch)
            rows += [{"model": ck.label, "method": "attribution"} | r for r in estimate.rows()]
            dla = direct_logit_attribution(ck.model, ck.tokenizer, pairs, batch)
            tables.setdefault("logit_attribution", []).extend({"model": ck.label} | r for r in dla.rows())
    first = next(iter(grids.values()))
    text = (
        f"Activation patching of {p.site} over {len(pairs)} pairs: each cell's score is the normalised "
        "logit-difference recovery (LD_patched - LD_corrupt) / (LD_clean - LD_corrupt), logit differences "
        "averaged over the pairs (0 = the corrupt run, 1 = the clean run). "
        + " ".join(
            f"{label}: LD clean {g.clean_diff:+.3f}, corrupt {g.corrupt_diff:+.3f}."
            for label, g in grids.items()
        )
        + (" Attribution patching rows estimate the same cells to first order." if p.attribution else "")
    )
    return Result(
        "patch",
        "patching",
        f"Activation patching of {p.site}",
        rows,
        text=text,
        context={"tokens": first.tokens, "site": p.site},
        columns=("model", "method", "site", "layer", "position", "score"),
        summary=_summary(rows),
        tables=tables,
    )


def _summary(rows: list[dict]) -> list[dict]:
    """The cell of largest score per model, method and layer (the full grid is in the CSV and the heatmap)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["method"], r["layer"])
        if key not in best or r["score"] > best[key]["score"]:
            best[key] = r
    return [
        {k: r.get(k) for k in ("model", "method", "layer", "position", "token", "head", "score") if k in r}
        for r in best.values()
    ]


def plot(result: Result) -> dict:
    """One heatmap (layer x position) per model and method, one per head with ``--per-head``."""
    import numpy as np

    from lime_probe.output import plots as F

    figures = {}
    tokens = result.context["tokens"]
    groups: dict[tuple, list[dict]] = {}
    for r in result.rows:
        groups.setdefault((r["model"], r["method"], r.get("head")), []).append(r)
    for (model, method, head), rs in groups.items():
        layers = sorted({r["layer"] for r in rs})
        grid = np.full((len(layers), len(tokens)), np.nan)
        for r in rs:
            grid[layers.index(r["layer"]), r["position"]] = r["score"]
        stem = f"patching_{slug(model)}" + ("" if method == "activation" else f"_{method}")
        stem += "" if head is None else f"_head{head}"
        figures[stem] = F.plot_heatmap(
            grid,
            row_labels=layers,
            col_labels=[f"{i} {t!r}" for i, t in enumerate(tokens)],
            xlabel="position (corrupt prompt's token)",
            ylabel=F.layer_axis_label(result.context["site"]),
            title=f"{model}: {method} patching of {result.context['site']}"
            + ("" if head is None else f", head {head}"),
            cbar_label="logit-difference recovery (0 corrupt, 1 clean)",
            cmap="RdBu_r",
            vmin=-1.0,
            vmax=1.0,
        )
    return figures


SPEC = Spec(
    name="patch",
    help="activation patching from clean into corrupt prompts: a layer x position heatmap of logit-difference recovery",
    example="lime-probe patch --ckpt runs/lime --pairs pairs.jsonl --site hidden --out out/patch"
    "   # not run in tests: reads a pairs file of your own (tests/test_interventions_cli.py runs it)",
    params=PatchParams,
    compute=compute,
    plot=plot,
    data_kind="pairs",
    notebook="interventions",
    in_report=False,
)
