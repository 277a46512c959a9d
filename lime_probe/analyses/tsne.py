"""t-SNE maps of word occurrences, models x layers (paper Figures 3, 8)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.protocol import defaults
from lime_probe.sites import DEFAULT_WORDS, SITES

from .base import Checkpoint, Result, Spec, group, option, seed_option
from .separability import subtoken_option, word_features

PROTOCOL = defaults("tsne")


@dataclass(frozen=True)
class TsneParams:
    site: str = option(PROTOCOL["site"], "representation to probe", choices=SITES)
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


def from_features(
    features: dict[str, tuple[dict, object]],
    *,
    site: str,
    name: str,
    what: str,
    per_class: int = 100,
    perplexity: float = 30.0,
    seed: int = 0,
    l2_normalize: bool = True,
) -> Result:
    """t-SNE maps per model and layer from {label: ({layer: (n, d)}, labels (n,))}, at most ``per_class``
    points of each class (seeded subsample, the same rows at every layer): one row per point."""
    import numpy as np

    from lime_probe.separability import balance_classes
    from lime_probe.tsne import tsne_layers

    rows, summary = [], []
    for label, (per_layer, y) in features.items():
        y = np.asarray(y)
        n = min(per_class, int(np.unique(y, return_counts=True)[1].min()))
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
                "layers": ",".join(str(la) for la in emb),
                "points_per_map": len(tokens),
                "tokens": " ".join(sorted(set(tokens))),
            }
        )
    return Result(
        "tsne",
        name,
        f"t-SNE of {what}",
        rows,
        text=(
            f"openTSNE maps (perplexity {perplexity:g}, seed {seed}) of the "
            f"{'L2-normalised ' if l2_normalize else ''}{site} representations of {what}, "
            "one panel per model and layer, the same points in every panel. Separate clusters mean the layer "
            "keeps the tokens apart; a collapsed layer mixes them."
        ),
        summary=summary,
    )


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: TsneParams, extract_kw: dict | None
) -> Result:
    """t-SNE of the occurrences of ``p.words`` in ``texts`` per layer."""
    features = {
        ck.label: word_features(ck, texts, p.site, p.words, extract_kw, subtoken=p.subtoken) for ck in cks
    }
    return from_features(
        features,
        site=p.site,
        name=f"tsne_{p.site}",
        what="words",
        per_class=p.per_word,
        perplexity=p.perplexity,
        seed=p.seed,
        l2_normalize=p.l2_normalize,
    )


def plot(result: Result) -> dict:
    import numpy as np

    from lime_probe import figures as F

    embeddings, tokens = {}, {}
    for m, mine in group(result.rows, "model").items():
        maps = group(mine, "layer")
        embeddings[m] = {la: np.array([[r["x"], r["y"]] for r in rs]) for la, rs in maps.items()}
        tokens[m] = [r["token"] for r in next(iter(maps.values()))]
    return {result.name: F.plot_tsne_grid(embeddings, tokens, site=result.rows[0]["site"])}


SPEC = Spec(
    name="tsne",
    help="t-SNE maps of word occurrences, models x layers (paper Figures 3/8)",
    example="lime-probe tsne --ckpt runs/lime --ckpt runs/llama --data ../shared/data/wikitext-2/valid.txt --layers 0,1 \\\n"
    "    --per-word 150 --perplexity 10 --out out/tsne",
    params=TsneParams,
    compute=compute,
    plot=plot,
    notebook="tsne",
    max_sequences=1000,
)
