"""t-SNE maps of word occurrences, models x layers (paper Figures 3, 8).

By default the values are mapped twice for a model that routes: the W_V output (the paper's values) and the
routed values its heads attend to (the official analysis's), one row of panels each; other models have the
first only (``base.value_sites``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.sites import DEFAULT_WORDS
from lime_probe.protocol import defaults

from .base import (
    Checkpoint,
    Result,
    Spec,
    check_words,
    group,
    option,
    routing_note,
    seed_option,
    site_label,
    sites_text,
    slug,
    value_site_option,
    value_sites,
)
from .separability import subtoken_option, word_features

PROTOCOL = defaults("tsne")


@dataclass(frozen=True)
class TsneParams:
    site: str | None = value_site_option()
    words: tuple[str, ...] = option(
        DEFAULT_WORDS,
        "words to map, leading spaces included, one or several tokens each "
        "(default: ' is' ' are' ' was' ' were')",
        metavar="WORD",
    )
    per_word: int = option(100, "points per word in each map", metavar="N", positive=True)
    perplexity: float = option(PROTOCOL["perplexity"], "t-SNE perplexity")
    l2_normalize: bool = option(
        PROTOCOL["l2_normalize"],
        "embed the raw rows (default: each row L2-normalised first, as the official code)",
    )
    subtoken: str = subtoken_option()
    seed: int = seed_option()

    def __post_init__(self):
        from lime_model.checks import check_positive  # here: `import lime_model` registers the models

        check_words(self.words)
        check_positive(self.perplexity, "--perplexity")


def tsne_rows(
    features: Mapping[str, tuple[dict, Any]],
    *,
    site: str,
    per_class: int = 100,
    perplexity: float = 30.0,
    seed: int = 0,
    l2_normalize: bool = True,
) -> tuple[list[dict], list[dict]]:
    """t-SNE maps per model and layer from {label: ({layer: (n, d)}, labels (n,))} at ``site``, at most
    ``per_class`` points of each class (seeded subsample, the same rows at every layer): (one row per point,
    one summary row per model)."""
    import warnings

    import numpy as np

    from lime_probe.extraction.windows import DataWarning
    from lime_probe.probes.separability import balance_classes
    from lime_probe.probes.tsne import tsne_layers

    rows, summary = [], []
    for label, (per_layer, y) in features.items():
        y = np.asarray(y)
        classes, counts = np.unique(y, return_counts=True)
        n = min(per_class, int(counts.min()))
        if n < per_class:  # fewer points than asked: said, not silent
            warnings.warn(
                f"{label}: {classes[counts.argmin()]!r} occurs {n} times, so each map has {n} points per word, "
                f"not {per_class}; give more data (--data, --max-sequences) for more",
                DataWarning,
                stacklevel=2,
            )
        keep = balance_classes(y, seed=seed, n_per_class=n)
        emb = tsne_layers(
            {layer: X[keep] for layer, X in per_layer.items()},
            perplexity=perplexity,
            seed=seed,
            l2_normalize=l2_normalize,
        )
        tokens = [str(v) for v in y[keep]]
        for layer, xy in emb.items():
            rows += [
                {
                    "model": label,
                    "site": site,
                    "layer": layer,
                    "point": k,
                    "token": tokens[k],
                    "x": float(p[0]),
                    "y": float(p[1]),
                    "l2_normalize": l2_normalize,
                }
                for k, p in enumerate(xy)
            ]
        summary.append(
            {
                "model": label,
                "site": site,
                "layers": ",".join(str(la) for la in emb),
                "points_per_map": len(tokens),
                "tokens": " ".join(sorted(set(tokens))),
            }
        )
    return rows, summary


def _result(
    rows: list[dict],
    summary: list[dict],
    *,
    name: str,
    what: str,
    perplexity: float,
    seed: int,
    default: bool,
) -> Result:
    normalised = "L2-normalised " if rows[0]["l2_normalize"] else ""
    return Result(
        "tsne",
        name,
        f"t-SNE of {what}",
        rows,
        text=(
            f"openTSNE maps (perplexity {perplexity:g}, seed {seed}) of the {normalised}"
            f"{sites_text(rows)} representations of {what}, one panel per model, site and layer, the "
            "same points in every panel. Separate clusters mean the layer keeps the tokens apart; a collapsed "
            "layer mixes them." + routing_note(rows, default)
        ),
        summary=summary,
    )


def from_features(
    features: Mapping[str, tuple[dict, Any]],
    *,
    site: str,
    name: str,
    what: str,
    per_class: int = 100,
    perplexity: float = 30.0,
    seed: int = 0,
    l2_normalize: bool = True,
) -> Result:
    """t-SNE maps per model and layer from {label: ({layer: (n, d)}, labels (n,))} (`tsne_rows`)."""
    rows, summary = tsne_rows(
        features, site=site, per_class=per_class, perplexity=perplexity, seed=seed, l2_normalize=l2_normalize
    )
    return _result(rows, summary, name=name, what=what, perplexity=perplexity, seed=seed, default=False)


def compute(cks: Sequence[Checkpoint], texts: Sequence[str], p: TsneParams, extraction: Extraction) -> Result:
    """t-SNE of the occurrences of ``p.words`` in ``texts`` per layer at ``p.site`` (default: `value_sites`)."""
    rows: list[dict] = []
    summary: list[dict] = []
    for ck in cks:
        sites = value_sites(ck, p.site)
        features = word_features(ck, texts, sites, p.words, extraction, subtoken=p.subtoken)
        for site in sites:
            r, s = tsne_rows(
                {ck.label: features[site]},
                site=site,
                per_class=p.per_word,
                perplexity=p.perplexity,
                seed=p.seed,
                l2_normalize=p.l2_normalize,
            )
            rows, summary = rows + r, summary + s
    return _result(
        rows,
        summary,
        name=f"tsne_{slug(p.site or 'values')}",
        what="words",
        perplexity=p.perplexity,
        seed=p.seed,
        default=p.site is None,
    )


def plot(result: Result) -> dict:
    """One row of panels per model, or per model and site (site by site) when the rows hold several sites."""
    import textwrap

    import numpy as np

    from lime_probe.output import plots as F

    by_site = group(result.rows, "site")
    embeddings, tokens = {}, {}
    for site, in_site in by_site.items():
        for m, mine in group(in_site, "model").items():
            key = (
                m if len(by_site) == 1 else textwrap.fill(f"{m}: {site_label(site)}", 24)
            )  # a panel's ylabel
            maps = group(mine, "layer")
            embeddings[key] = {la: np.array([[r["x"], r["y"]] for r in rs]) for la, rs in maps.items()}
            tokens[key] = [r["token"] for r in next(iter(maps.values()))]
    return {result.name: F.plot_tsne_grid(embeddings, tokens, site=result.rows[0]["site"])}


SPEC = Spec(
    name="tsne",
    help="t-SNE maps of word occurrences, models x layers (paper Figures 3/8)",
    example="lime-probe tsne --ckpt runs/lime --ckpt runs/llama --data data/wikitext-2/valid.txt --layers 0,1 \\\n"
    "    --per-word 150 --perplexity 10 --out out/tsne",
    params=TsneParams,
    compute=compute,
    plot=plot,
    notebook="tsne",
    max_sequences=1000,
)
