"""Linear-probe separability of word occurrences per layer (paper Sec. 5.3, Figures 2b, 7b).

Words may be several tokens each (numbers such as ' 100' ' 101' ' 102' ' 103' under most tokenizers, Fig.
4a/8): each whole-word occurrence (`separability.word_spans`) gives one row, its last sub-token's
representation or the mean over its sub-tokens (``subtoken``). When every word is a single token, every
occurrence of that token is a row (the positions alone are extracted, so large data stays cheap).

The probe by default is the official code's (``method="adam-linear"``): a linear layer trained for one epoch,
so its accuracy is a one-epoch linear probe's (how readily the words separate), not the best linear
separation; ``method="logreg"`` is a converged logistic regression. By default the values are probed twice
for a model that routes: the W_V output (the paper's values) and the routed values its heads attend to (the
official analysis's); other models have the first only (``base.value_sites``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.sites import DEFAULT_WORDS
from lime_probe.protocol import defaults

if TYPE_CHECKING:
    from lime_probe.probes.separability import Method, SubToken

from .base import (
    Checkpoint,
    Result,
    Spec,
    check_class_counts,
    check_probe_sample,
    check_words,
    extract_site,
    option,
    routing_note,
    seed_option,
    site_curves,
    sites_text,
    slug,
    value_site_option,
    value_sites,
)
from .mixing import MIXED, check_mix_site, mix_router_option, mixing_router

METHODS = ("logreg", "adam-linear")
SUBTOKENS = ("last", "mean")
PROTOCOL = defaults("separability")
N_SPLITS = 5  # the folds of token_separability's cross-validation
# What each probe's accuracy is, for the result's text.
PROBES = {
    "adam-linear": "a one-epoch linear probe (the official code's: a linear layer on the raw features, one "
    "epoch of Adam, lr 1e-2, batch 64; 5 shuffled folds; accuracy averaged over test batches)",
    "logreg": "a standardised logistic regression fitted to convergence (5 stratified folds)",
}
# Its short name, for the printed table's "probe" column and the figure's title.
PROBE_NAMES = {
    "adam-linear": "one-epoch linear probe (official code's)",
    "logreg": "converged logistic regression",
}


def jobs_option():
    """The ``jobs`` field of the fold-fitting probes (separability, BLiMP)."""
    return option(
        1,
        "processes fitting the probe's folds (layer by fold) in parallel; the accuracies are identical for "
        "every value. Default 1 (ours): each process starts its own Python and torch (seconds) and it pays "
        "only on idle cores; on a busy 2-core machine 2 processes ran no faster than 1",
        metavar="N",
        positive=True,
    )


def subtoken_option():
    """The ``subtoken`` field shared by the word probes (separability, t-SNE)."""
    return option(
        PROTOCOL["subtoken"],
        "representation of a word of several tokens: its last sub-token or the mean over its sub-tokens",
        choices=SUBTOKENS,
    )


@dataclass(frozen=True)
class SeparabilityParams:
    site: str | None = value_site_option()
    words: tuple[str, ...] = option(
        DEFAULT_WORDS,
        "words to tell apart, leading spaces included, one or several tokens each "
        "(default: ' is' ' are' ' was' ' were')",
        metavar="WORD",
    )
    method: str = option(
        PROTOCOL["method"],
        "probe (the paper names none): the official code's one-epoch linear probe (a linear layer on the raw "
        "features, one epoch of Adam, lr 1e-2, batch 64; its accuracy is a one-epoch probe's, not the best "
        "linear separation) or a converged standardised logistic regression",
        choices=METHODS,
    )
    subtoken: str = subtoken_option()
    seed: int = seed_option()
    allow_small_samples: bool = option(
        False,
        "probe even when the balanced sample holds fewer than 10 occurrences per word in each of the 5 test "
        "folds (default: refused, as such accuracies mean little)",
    )
    jobs: int = jobs_option()
    mix_router: str | None = mix_router_option("separability")

    def __post_init__(self):
        check_words(self.words)
        check_mix_site(self.mix_router, self.site)


def count_words_first(
    ck: Checkpoint, texts: Sequence[str], ids: dict[str, int], extraction: Extraction | None, minimum: int
) -> None:
    """`check_class_counts` on the tokens of `texts` as the extraction will cut them (its ``max_length``, capped
    at the model's positions), before any forward pass: a word too rare in the whole data is refused in a
    second rather than after the extraction. A stream is counted by the extraction itself."""
    import numpy as np

    from lime_probe.extraction.tracing import tokenize_texts

    if not isinstance(texts, Sequence) or not texts:
        return
    settings = extraction or Extraction()
    positions = getattr(ck.config, "max_position_embeddings", None)
    max_length = min(settings.max_length, positions or 512)
    pretokenized = not isinstance(texts[0], str)
    word_of = {i: w for w, i in ids.items()}
    labels = [
        word_of[t]
        for seq in tokenize_texts(ck.tokenizer, texts, max_length, settings.max_tokens, pretokenized)
        for t in seq
        if t in word_of
    ]
    check_class_counts(np.asarray(labels), list(ids), minimum, f"{ck.label}: words")


def word_features(
    ck: Checkpoint,
    texts: Sequence[str],
    sites: Sequence[str],
    words: Sequence[str],
    extraction: Extraction | None = None,
    minimum: int = 5,
    subtoken: str = "last",
) -> dict[str, tuple[dict, object]]:
    """Representations of every occurrence of ``words`` at each of ``sites`` (one extraction pass):
    {site: ({layer: (n, d)}, labels (n,))}.

    Single-token words: every occurrence of the token. Otherwise whole-word occurrences
    (``word_spans``), pooled over their sub-tokens as ``subtoken`` says ("last" or "mean").
    ValueError if a word occurs fewer than ``minimum`` times in ``texts``.
    """
    from lime_probe.probes.separability import pool_spans, word_pieces, word_rows, word_spans

    pieces = word_pieces(ck.tokenizer, words)
    if all(len(ids) == 1 for ids in pieces.values()):
        ids = {w: i[0] for w, i in pieces.items()}
        count_words_first(ck, texts, ids, extraction, minimum)
        acts = extract_site(ck, texts, sites, extraction, token_ids=list(ids.values()))
        rows, y = word_rows(acts.token_ids, ids)
        check_class_counts(y, list(words), minimum, f"{ck.label}: words")
        return {s: ({layer: acts[s][layer][rows] for layer in acts[s]}, y) for s in sites}
    acts = extract_site(ck, texts, sites, extraction)
    spans, y = word_spans(acts.token_ids, acts.offsets, ck.tokenizer, words)
    check_class_counts(y, list(words), minimum, f"{ck.label}: words")
    return {
        s: ({layer: pool_spans(acts[s][layer], spans, cast("SubToken", subtoken)) for layer in acts[s]}, y)
        for s in sites
    }


def separability_rows(
    features: Mapping[str, tuple[dict, Any]],
    *,
    site: str,
    classes: Sequence,
    method: str = PROTOCOL["method"],
    seed: int = 0,
    subtoken: str | None = None,
    jobs: int = 1,
) -> list[dict]:
    """One row per model and layer from {label: ({layer: (n, d)}, labels (n,))} at ``site``; ``classes``
    in the given order (the official probe's output units); ``subtoken`` recorded when given; the folds
    fitted in ``jobs`` processes. Each row also holds ``feature_norm``, the mean L2 norm of the layer's
    rows: the one-epoch probe on raw features is sensitive to their scale, the converged one is not."""
    import numpy as np

    from lime_probe.probes.separability import token_separability

    rows = []
    for label, (per_layer, y) in features.items():
        res = token_separability(
            per_layer,
            y,
            method=cast("Method", method),  # one of the option's choices
            seed=seed,
            classes=list(classes),
            n_splits=N_SPLITS,
            n_jobs=jobs,
        )
        for layer, m, s in zip(res.layers, res.accuracy_mean, res.accuracy_std, strict=True):
            X = per_layer[layer]
            X = (
                X.double().cpu().numpy() if hasattr(X, "double") else np.asarray(X, dtype=np.float64)
            )  # torch or numpy
            norm = float(np.linalg.norm(X, axis=1).mean())
            rows.append(
                {
                    "model": label,
                    "site": site,
                    "layer": layer,
                    "accuracy_mean": float(m),
                    "accuracy_std": float(s),
                    "majority_baseline": res.majority_baseline,
                    "feature_norm": norm,
                    "n_rows": res.n_rows,
                    "method": res.method,
                    "probe": PROBE_NAMES[res.method],
                    **({"subtoken": subtoken} if subtoken else {}),
                }
            )
    return rows


def _result(
    rows: list[dict],
    *,
    classes: Sequence,
    name: str,
    what: str,
    method: str,
    subtoken: str | None,
    default: bool,
) -> Result:
    shown = [str(c) for c in classes]
    return Result(
        "separability",
        name,
        f"Separability of {what}",
        rows,
        text=(
            f"Cross-validated accuracy (mean ± std over 5 folds) of {PROBES[method]} telling apart the "
            f"{sites_text(rows)} representations of {', '.join(repr(c) for c in shown)} at each layer, "
            "classes balanced. Chance is the majority-class rate; collapsed layers fall towards it."
            + (
                f" Words of several tokens are represented by the {subtoken} of their sub-tokens."
                if subtoken
                else ""
            )
            + routing_note(rows, default)
        ),
        context={"classes": shown},
        columns=("model", "site", "layer", "probe", "accuracy_mean", "accuracy_std", "majority_baseline"),
    )


def from_features(
    features: Mapping[str, tuple[dict, Any]],
    *,
    site: str,
    classes: Sequence,
    name: str,
    what: str,
    method: str = PROTOCOL["method"],
    seed: int = 0,
    subtoken: str | None = None,
    jobs: int = 1,
) -> Result:
    """Separability per layer for each model, from {label: ({layer: (n, d)}, labels (n,))} at ``site``;
    ``subtoken`` (how multi-token words were pooled) is recorded in the rows when given; the folds fitted in
    ``jobs`` processes."""
    rows = separability_rows(
        features, site=site, classes=classes, method=method, seed=seed, subtoken=subtoken, jobs=jobs
    )
    return _result(
        rows, classes=classes, name=name, what=what, method=method, subtoken=subtoken, default=False
    )


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: SeparabilityParams, extraction: Extraction
) -> Result:
    """Separability of the occurrences of ``p.words`` in ``texts`` at ``p.site`` (default: `value_sites`);
    with ``p.mix_router``, of the values mixed by its routers instead (site `MIXED`, `mixed_features`)."""
    rows = []
    for ck in cks:
        router = None if p.mix_router is None else mixing_router(ck, p.mix_router)
        sites = value_sites(ck, p.site) if router is None else ["values"]
        features = word_features(ck, texts, sites, p.words, extraction, subtoken=p.subtoken)
        check_probe_sample(features[sites[0]][1], N_SPLITS, p.allow_small_samples, ck.label)
        if router is not None:
            features, sites = {MIXED: mixed_features(features["values"], router)}, [MIXED]
        for site in sites:
            rows += separability_rows(
                {ck.label: features[site]},
                site=site,
                classes=p.words,
                method=p.method,
                seed=p.seed,
                subtoken=p.subtoken,
                jobs=p.jobs,
            )
    if p.mix_router is not None:
        for r in rows:
            r["mix_router"] = p.mix_router
    return _result(
        rows,
        classes=p.words,
        name=f"separability_{slug(p.site or 'values')}",
        what="words",
        method=p.method,
        subtoken=p.subtoken,
        default=p.site is None,
    )


def mixed_features(features: tuple[dict, Any], router_model: Any) -> tuple[dict, Any]:
    """``({layer: (n, d)}, labels (n,))`` of the values with each layer's rows mixed across layers by
    ``router_model``'s routers (`mix_by_router`). The mixing is linear and per token, so mixing the rows
    of a word (a token, or its sub-tokens pooled by their mean or last) equals pooling the mixed tokens."""
    from lime_probe.probes.router_weights import mix_by_router

    per_layer, y = features
    return mix_by_router(router_model, per_layer), y


def plot(result: Result) -> dict:
    from lime_probe.output import charts as C
    from lime_probe.output import plots as F

    rows = result.rows
    fig = C.plot_separability(
        site_curves(rows, "accuracy_mean", std="accuracy_std"),
        site=rows[0]["site"],
        words=result.context["classes"],
        chance=rows[-1]["majority_baseline"],
    )
    ax = fig.axes[0]
    with F.style():  # the probe in the title: its accuracy is that probe's
        ax.set_title(f"{ax.get_title()}\n{PROBE_NAMES[rows[0]['method']]}")
    return {result.name: fig}


SPEC = Spec(
    name="separability",
    help="linear-probe separability of word occurrences per layer (paper Figures 2b/7b)",
    example="lime-probe separability --ckpt runs/lime --ckpt runs/llama --data data/wikitext-2 \\\n"
    "    --words ' is' ' are' ' was' ' were' --site values --max-sequences 5000 --out out/sep\n"
    "# few numbers in text: the cpu-tiny runs read 22 of each in both files (64 tokens a document)\n"
    "lime-probe separability --ckpt runs/lime --data data/wikitext-2 --max-sequences 5000 \\\n"
    "    --words ' 1' ' 2' ' 3' ' 4' --subtoken mean --allow-small-samples --out out/sep-numbers",
    params=SeparabilityParams,
    compute=compute,
    plot=plot,
    notebook="separability",
    max_sequences=1000,
)
