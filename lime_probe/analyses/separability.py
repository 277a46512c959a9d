"""Linear-probe separability of word occurrences per layer (paper Sec. 5.3, Figures 2b, 7b).

Words may be several tokens each (numbers such as ' 100' ' 101' ' 102' ' 103' under most tokenizers, Fig.
4a/8): each whole-word occurrence (`separability.word_spans`) gives one row, its last sub-token's
representation or the mean over its sub-tokens (``subtoken``). When every word is a single token, every
occurrence of that token is a row (the positions alone are extracted, so large data stays cheap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.protocol import defaults
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
SUBTOKENS = ("last", "mean")
PROTOCOL = defaults("separability")


def subtoken_option():
    """The ``subtoken`` field shared by the word probes (separability, t-SNE)."""
    return option(
        PROTOCOL["subtoken"],
        "representation of a word of several tokens: its last sub-token or the mean over its sub-tokens",
        choices=SUBTOKENS,
    )


@dataclass(frozen=True)
class SeparabilityParams:
    site: str = option(PROTOCOL["site"], "representation to probe", choices=SITES)
    words: tuple[str, ...] = option(
        DEFAULT_WORDS,
        "words to tell apart, leading spaces included, one or several tokens each "
        "(default: ' is' ' are' ' was' ' were')",
        metavar="WORD",
    )
    method: str = option(
        PROTOCOL["method"],
        "probe: a converged standardised logistic regression (our choice; the paper names no classifier) "
        "or the official code's one-epoch Adam linear layer",
        choices=METHODS,
    )
    subtoken: str = subtoken_option()
    seed: int = seed_option()


def word_features(
    ck: Checkpoint,
    texts: Sequence[str],
    site: str,
    words: Sequence[str],
    extract_kw: dict | None = None,
    minimum: int = 5,
    subtoken: str = "last",
) -> tuple[dict, object]:
    """Representations of every occurrence of ``words``: ({layer: (n, d)}, labels (n,)).

    Single-token words: every occurrence of the token. Otherwise whole-word occurrences
    (``word_spans``), pooled over their sub-tokens as ``subtoken`` says ("last" or "mean").
    ValueError if a word occurs fewer than ``minimum`` times in ``texts``.
    """
    from lime_probe.separability import pool_spans, word_pieces, word_rows, word_spans

    pieces = word_pieces(ck.tokenizer, words)
    if all(len(ids) == 1 for ids in pieces.values()):
        ids = {w: i[0] for w, i in pieces.items()}
        acts = extract_site(ck, texts, site, extract_kw, token_ids=list(ids.values()))
        rows, y = word_rows(acts.token_ids, ids)
        check_class_counts(y, list(words), minimum, f"{ck.label}: words")
        return {layer: acts[site][layer][rows] for layer in acts[site]}, y
    acts = extract_site(ck, texts, site, extract_kw)
    spans, y = word_spans(acts.token_ids, acts.offsets, ck.tokenizer, words)
    check_class_counts(y, list(words), minimum, f"{ck.label}: words")
    return {layer: pool_spans(acts[site][layer], spans, subtoken) for layer in acts[site]}, y


def from_features(
    features: dict[str, tuple[dict, object]],
    *,
    site: str,
    classes: Sequence,
    name: str,
    what: str,
    method: str = "logreg",
    seed: int = 0,
    subtoken: str | None = None,
) -> Result:
    """Separability per layer for each model, from {label: ({layer: (n, d)}, labels (n,))};
    ``subtoken`` (how multi-token words were pooled) is recorded in the rows when given."""
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
                    **({"subtoken": subtoken} if subtoken else {}),
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
            + (
                f" Words of several tokens are represented by the {subtoken} of their sub-tokens."
                if subtoken
                else ""
            )
        ),
        context={"classes": shown},
        columns=("model", "layer", "accuracy_mean", "accuracy_std", "majority_baseline"),
    )


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: SeparabilityParams, extract_kw: dict | None
) -> Result:
    """Separability of the occurrences of ``p.words`` in ``texts``."""
    features = {
        ck.label: word_features(ck, texts, p.site, p.words, extract_kw, subtoken=p.subtoken) for ck in cks
    }
    return from_features(
        features,
        site=p.site,
        classes=p.words,
        name=f"separability_{p.site}",
        what="words",
        method=p.method,
        seed=p.seed,
        subtoken=p.subtoken,
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
    example="lime-probe separability --ckpt runs/lime --ckpt runs/llama --data ../shared/data/wikitext-2/valid.txt \\\n"
    "    --words ' is' ' are' ' was' ' were' --site values --max-sequences 2000 --out out/sep\n"
    "lime-probe separability --ckpt runs/lime --data ../shared/data/wikitext-2/valid.txt \\\n"
    "    --words ' 1' ' 2' ' 3' ' 4' --subtoken mean --max-sequences 2000 --out out/sep-numbers",
    params=SeparabilityParams,
    compute=compute,
    plot=plot,
    notebook="separability",
    max_sequences=1000,
)
