"""Linear-probe separability of word occurrences per layer (paper Sec. 5.3, Figures 2b, 7b)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.sites import DEFAULT_WORDS, SITES

from .base import (
    Checkpoint,
    Result,
    Spec,
    check_class_counts,
    curve,
    extract_site,
    group,
    option,
    seed_option,
)

METHODS = ("logreg", "adam-linear")


@dataclass(frozen=True)
class SeparabilityParams:
    site: str = option("hidden", "representation to probe", choices=SITES)
    words: tuple[str, ...] = option(
        DEFAULT_WORDS,
        "single-token words to tell apart, leading spaces included (default: ' is' ' are' ' was' ' were')",
        metavar="WORD",
    )
    method: str = option(
        "logreg",
        "probe: converged logistic regression (paper text) or the official one-epoch Adam linear layer",
        choices=METHODS,
    )
    seed: int = seed_option()


def word_features(
    ck: Checkpoint,
    texts: Sequence[str],
    site: str,
    words: Sequence[str],
    extract_kw: dict | None = None,
    minimum: int = 5,
) -> tuple[dict, object]:
    """Representations of every occurrence of single-token ``words``: ({layer: (n, d)}, labels (n,)).

    ValueError if a word is not one token, or occurs fewer than ``minimum`` times in ``texts``.
    """
    from lime_probe.separability import word_rows, word_token_ids

    ids = word_token_ids(ck.tokenizer, words)
    acts = extract_site(ck, texts, site, extract_kw, token_ids=list(ids.values()))
    rows, y = word_rows(acts.token_ids, ids)
    check_class_counts(y, list(words), minimum, f"{ck.label}: words")
    return {layer: acts[site][layer][rows] for layer in acts[site]}, y


def from_features(
    features: dict[str, tuple[dict, object]],
    *,
    site: str,
    classes: Sequence,
    name: str,
    what: str,
    method: str = "logreg",
    seed: int = 0,
) -> Result:
    """Separability per layer for each model, from {label: ({layer: (n, d)}, labels (n,))}."""
    from lime_probe.separability import token_separability

    rows = []
    for label, (per_layer, y) in features.items():
        res = token_separability(per_layer, y, method=method, seed=seed)
        for layer, m, s in zip(res.layers, res.accuracy_mean, res.accuracy_std, strict=True):
            rows.append(
                {
                    "model": label,
                    "site": site,
                    "layer": layer,
                    "accuracy_mean": float(m),
                    "accuracy_std": float(s),
                    "majority_baseline": res.majority_baseline,
                    "n_rows": res.n_rows,
                    "method": res.method,
                }
            )
    shown = [str(c) for c in classes]
    return Result(
        "separability",
        name,
        f"Separability of {what}",
        rows,
        text=(
            f"Cross-validated accuracy (5 stratified folds, mean ± std) of a linear probe ({method}) telling apart "
            f"the {site} representations of {', '.join(repr(c) for c in shown)} at each layer, classes balanced. "
            "Chance is the majority-class rate; collapsed layers fall towards it."
        ),
        context={"classes": shown},
        columns=("model", "layer", "accuracy_mean", "accuracy_std", "majority_baseline"),
    )


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: SeparabilityParams, extract_kw: dict | None
) -> Result:
    """Separability of the occurrences of single-token ``p.words`` in ``texts``."""
    features = {ck.label: word_features(ck, texts, p.site, p.words, extract_kw) for ck in cks}
    return from_features(
        features,
        site=p.site,
        classes=p.words,
        name=f"separability_{p.site}",
        what="words",
        method=p.method,
        seed=p.seed,
    )


def plot(result: Result) -> dict:
    from lime_probe import figures as F

    rows = result.rows
    curves = {m: curve(rs, "accuracy_mean", std="accuracy_std") for m, rs in group(rows, "model").items()}
    return {
        result.name: F.plot_separability(
            curves,
            site=rows[0]["site"],
            words=result.context["classes"],
            chance=rows[-1]["majority_baseline"],
        )
    }


SPEC = Spec(
    name="separability",
    help="linear-probe separability of word occurrences per layer (paper Figures 2b/7b)",
    example="lime-probe separability --ckpt runs/lime --ckpt runs/llama --data wikitext-2/valid.txt \\\n"
    "    --words ' is' ' are' ' was' ' were' --site values --max-sequences 2000 --out out/sep",
    params=SeparabilityParams,
    compute=compute,
    plot=plot,
    notebook="separability",
    max_sequences=1000,
)
