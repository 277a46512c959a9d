"""The analyses behind ``lime-probe`` and its demo: checkpoints and data in, an ``Analysis`` out.

    cks = load_checkpoints(["runs/lime", "runs/llama"], ["LIMe", "LLaMA"], device="cpu")
    a = entropy_analysis(cks, texts, site="values", extract_kw={"max_length": 256})
    a.rows, a.table(), a.figures                     # flat table, compact table, {stem: Figure}
    write_analysis(a, out_dir, meta)                  # JSON + CSV + PNG + PDF

Each ``*_analysis`` extracts what it needs with ``extract_site`` (``extract_kw`` holds the size
limits, cache and layers as ``lime_probe.extract`` keywords), runs its probe per checkpoint and
returns the rows, figures and a summary text; ``*_from_features`` variants take representations
already picked out (the demo's numbers). Nothing here parses arguments or prints.

Each analysis imports the probes it uses when it runs, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from lime_probe import figures as F
from lime_probe.report import Section, Table
from lime_probe.results import write_results
from lime_probe.sites import DEFAULT_WORDS, SITES

# --------------------------------------------------------------------------- checkpoints


@dataclass
class Checkpoint:
    """A loaded checkpoint: its label in tables and legends, its path or hub id, model and tokenizer."""

    label: str
    source: str
    model: object
    tokenizer: object

    @property
    def config(self):
        """The Hugging Face config (``model`` may be an nnsight wrapper)."""
        return getattr(self.model, "_module", self.model).config


def labels_for(ckpts: Sequence[str], labels: Sequence[str] | None) -> list[str]:
    """One label per checkpoint: the given ones, or each path's last component; must be unique."""
    if labels and len(labels) != len(ckpts):
        raise ValueError(
            f"got {len(labels)} --label for {len(ckpts)} --ckpt; give one label per checkpoint or none"
        )
    out = list(labels) if labels else [Path(c.rstrip("/")).name or c for c in ckpts]
    dupes = sorted({x for x in out if out.count(x) > 1})
    if dupes:
        raise ValueError(f"checkpoint labels must be unique, {dupes} repeats; name them with --label")
    return out


def load_checkpoints(ckpts: Sequence[str], labels: Sequence[str] | None, device: str) -> list[Checkpoint]:
    """Load every checkpoint with ``lime_probe.load`` (errors name the offending path)."""
    names = labels_for(ckpts, labels)
    from lime_probe.loading import load

    out = []
    for label, ckpt in zip(names, ckpts, strict=True):
        model, tok = load(ckpt, device=device)
        out.append(Checkpoint(label, ckpt, model, tok))
    return out


# --------------------------------------------------------------------------- analyses


@dataclass
class Analysis:
    """What one analysis produced: the flat table, structured extras, figures, and a summary."""

    name: str  # file stem of its results, e.g. "entropy_values"
    title: str
    rows: list[dict]
    text: str = ""
    extra: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)  # stem -> Figure
    columns: tuple[str, ...] = ()  # shown in the compact table (default: all)
    summary: list[dict] | None = None  # the compact table itself, where rows are too many to show

    def table(self) -> list[dict]:
        """The rows shown on the terminal and in the report."""
        if self.summary is not None:
            return self.summary
        return [{c: r.get(c) for c in self.columns} for r in self.rows] if self.columns else self.rows


def extract_site(ck: Checkpoint, texts: Sequence[str], site: str, extract_kw: dict | None = None, **kw):
    """``lime_probe.extract`` of one site for one checkpoint; ``extract_kw`` holds the size limits,
    cache and layers (``layers``, ``max_length``, ``max_tokens``, ``batch_size``, ``cache_dir``)."""
    from lime_probe.extraction import extract

    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; choose from {', '.join(SITES)}")
    return extract(ck.model, ck.tokenizer, texts, sites=[site], **{**(extract_kw or {}), **kw})


def stream_entropy(
    acts, site: str, layer: int, preset: str = "lime", *, alpha: float | None = None, seed: int = 0
):
    """``layer_entropy`` of one extracted layer (``acts``: ``Activations``), fed to an ``EntropyAccumulator`` a
    chunk of sequences at a time (``Activations.iter_sequences``: one cache shard at a time), so memory does
    not grow with the data. Returns an ``EntropyResult`` (per-sequence values (n_seq,), mean, CI).

    The z-score of the "lime" preset needs the layer's global feature moments before any entropy: they are
    gathered in a first pass (``FeatureMoments``), then the second pass computes each entropy at once.
    """
    import torch

    from lime_probe.entropy import EntropyAccumulator, FeatureMoments, entropy_config

    config = entropy_config(preset, alpha=alpha)
    moments = None
    if config.normalize == "zscore":
        moments = FeatureMoments()
        for seqs in acts.iter_sequences(site, layer):
            moments.update(torch.cat(seqs))
    acc = EntropyAccumulator(config, feature_stats=moments, seed=seed)
    for seqs in acts.iter_sequences(site, layer):
        acc.update(seqs)
    return acc.result()


def entropy_analysis(
    cks: Sequence[Checkpoint],
    texts: Sequence[str],
    *,
    site: str = "values",
    preset: str = "lime",
    alpha: float | None = None,
    seed: int = 0,
    extract_kw: dict | None = None,
) -> Analysis:
    """Matrix entropy per layer of ``site`` for each checkpoint (paper Figures 2a, 4a, 7a), streamed layer by
    layer and shard by shard (``stream_entropy``)."""
    rows, series = [], {}
    for ck in cks:
        acts = extract_site(ck, texts, site, extract_kw)
        layers = acts.layers(site)
        res = {
            layer: stream_entropy(acts, site, layer, preset, alpha=alpha, seed=seed)
            for layer in tqdm(layers, desc=f"entropy {ck.label}", unit="layer")
        }
        for layer in layers:
            r = res[layer]
            rows.append(
                {
                    "model": ck.label,
                    "site": site,
                    "layer": layer,
                    "entropy_mean": r.mean,
                    "entropy_std": r.std,
                    "ci_low": r.ci_low,
                    "ci_high": r.ci_high,
                    "n_sequences": len(r.values),
                    "alpha": r.config.alpha,
                }
            )
        series[ck.label] = {
            "layers": layers,
            "mean": [res[la].mean for la in layers],
            "low": [res[la].ci_low for la in layers],
            "high": [res[la].ci_high for la in layers],
        }
    used_alpha = rows[0]["alpha"]
    return Analysis(
        f"entropy_{site}",
        f"Matrix entropy of {site}",
        rows,
        text=(
            f"Matrix-based Renyi entropy (alpha={used_alpha:g}, preset {preset!r}) of each sequence's {site} per "
            f"layer; mean over {rows[0]['n_sequences']} sequences with a 95% bootstrap CI of the mean. Lower "
            "entropy means the tokens crowd into fewer directions (representation collapse)."
        ),
        figures={f"entropy_{site}": F.plot_entropy(series, site=site, alpha=used_alpha)},
        columns=("model", "layer", "entropy_mean", "ci_low", "ci_high"),
    )


def check_class_counts(labels: np.ndarray, classes: Sequence, minimum: int, what: str) -> None:
    """ValueError naming every class of ``classes`` with fewer than ``minimum`` rows in ``labels``."""
    found = dict(zip(*np.unique(labels, return_counts=True), strict=True)) if len(labels) else {}
    short = {c: int(found.get(c, 0)) for c in classes if found.get(c, 0) < minimum}
    if short:
        counts = ", ".join(f"{c!r}: {n}" for c, n in short.items())
        raise ValueError(
            f"{what} too rare in the data (need at least {minimum} each): {counts}; "
            "give more data (--data, --max-sequences) or other words"
        )


def separability_from_features(
    features: dict[str, tuple[dict, np.ndarray]],
    *,
    site: str,
    classes: Sequence,
    name: str,
    what: str,
    method: str = "logreg",
    seed: int = 0,
) -> Analysis:
    """Token separability per layer for each model, from {label: ({layer: (n, d)}, labels (n,))}."""
    from lime_probe.separability import token_separability

    rows, series, chance = [], {}, None
    for label, (per_layer, y) in features.items():
        res = token_separability(per_layer, y, method=method, seed=seed)
        chance = res.majority_baseline
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
        series[label] = {"layers": res.layers, "mean": res.accuracy_mean, "std": res.accuracy_std}
    shown = [str(c) for c in classes]
    return Analysis(
        name,
        f"Separability of {what}",
        rows,
        text=(
            f"Cross-validated accuracy (5 stratified folds, mean ± std) of a linear probe ({method}) telling apart "
            f"the {site} representations of {', '.join(repr(c) for c in shown)} at each layer, classes balanced. "
            "Chance is the majority-class rate; collapsed layers fall towards it."
        ),
        figures={name: F.plot_separability(series, site=site, words=shown, chance=chance)},
        columns=("model", "layer", "accuracy_mean", "accuracy_std", "majority_baseline"),
    )


def word_features(
    ck: Checkpoint,
    texts: Sequence[str],
    site: str,
    words: Sequence[str],
    extract_kw: dict | None = None,
    minimum: int = 5,
) -> tuple[dict, np.ndarray]:
    """Representations of every occurrence of single-token ``words``: ({layer: (n, d)}, labels (n,)).

    ValueError if a word is not one token, or occurs fewer than ``minimum`` times in ``texts``.
    """
    from lime_probe.separability import word_rows, word_token_ids

    ids = word_token_ids(ck.tokenizer, words)
    acts = extract_site(ck, texts, site, extract_kw, token_ids=list(ids.values()))
    rows, y = word_rows(acts.token_ids, ids)
    check_class_counts(y, list(words), minimum, f"{ck.label}: words")
    return {layer: acts[site][layer][rows] for layer in acts[site]}, y


def separability_analysis(
    cks: Sequence[Checkpoint],
    texts: Sequence[str],
    *,
    site: str = "hidden",
    words: Sequence[str] = DEFAULT_WORDS,
    method: str = "logreg",
    seed: int = 0,
    extract_kw: dict | None = None,
) -> Analysis:
    """Separability of the occurrences of single-token ``words`` (paper Sec. 5.3, Figures 2b, 7b)."""
    features = {ck.label: word_features(ck, texts, site, words, extract_kw) for ck in cks}
    return separability_from_features(
        features,
        site=site,
        classes=words,
        name=f"separability_{site}",
        what="words",
        method=method,
        seed=seed,
    )


def tsne_from_features(
    features: dict[str, tuple[dict, np.ndarray]],
    *,
    site: str,
    name: str,
    what: str,
    per_class: int = 100,
    perplexity: float = 30.0,
    seed: int = 0,
) -> Analysis:
    """t-SNE maps per model and layer from {label: ({layer: (n, d)}, labels (n,))}, at most ``per_class``
    points of each class (seeded subsample, the same rows at every layer)."""
    from lime_probe.separability import balance_classes
    from lime_probe.tsne import tsne_layers

    rows, embeddings, point_labels = [], {}, {}
    for label, (per_layer, y) in features.items():
        y = np.asarray(y)
        n = min(per_class, int(np.unique(y, return_counts=True)[1].min()))
        keep = balance_classes(y, seed=seed, n_per_class=n)
        emb = tsne_layers(
            {layer: X[keep] for layer, X in per_layer.items()}, perplexity=perplexity, seed=seed
        )
        embeddings[label], point_labels[label] = emb, [str(v) for v in y[keep]]
        for layer, xy in emb.items():
            rows += [
                {
                    "model": label,
                    "site": site,
                    "layer": layer,
                    "point": k,
                    "token": point_labels[label][k],
                    "x": float(p[0]),
                    "y": float(p[1]),
                }
                for k, p in enumerate(xy)
            ]
    return Analysis(
        name,
        f"t-SNE of {what}",
        rows,
        text=(
            f"openTSNE maps (perplexity {perplexity:g}, seed {seed}) of the {site} representations of {what}, "
            "one panel per model and layer, the same points in every panel. Separate clusters mean the layer "
            "keeps the tokens apart; a collapsed layer mixes them."
        ),
        figures={name: F.plot_tsne_grid(embeddings, point_labels, site=site)},
        summary=[
            {
                "model": m,
                "layers": ",".join(str(la) for la in embeddings[m]),
                "points_per_map": len(point_labels[m]),
                "tokens": " ".join(sorted(set(point_labels[m]))),
            }
            for m in embeddings
        ],
    )


def tsne_analysis(
    cks: Sequence[Checkpoint],
    texts: Sequence[str],
    *,
    site: str = "hidden",
    words: Sequence[str] = DEFAULT_WORDS,
    per_word: int = 100,
    perplexity: float = 30.0,
    seed: int = 0,
    extract_kw: dict | None = None,
) -> Analysis:
    """t-SNE of the occurrences of ``words`` per layer (paper Figures 3, 8)."""
    features = {ck.label: word_features(ck, texts, site, words, extract_kw) for ck in cks}
    return tsne_from_features(
        features,
        site=site,
        name=f"tsne_{site}",
        what="words",
        per_class=per_word,
        perplexity=perplexity,
        seed=seed,
    )


def cka_analysis(
    cks: Sequence[Checkpoint],
    texts: Sequence[str],
    *,
    site: str = "hidden",
    seed: int = 0,
    extract_kw: dict | None = None,
) -> Analysis:
    """Linear CKA between every pair of layers and the effective rank of each layer (beyond the paper)."""
    from lime_probe.similarity import cka_matrix, effective_ranks

    rows, extra, figures, ranks = [], {}, {}, {}
    for ck in cks:
        acts = extract_site(ck, texts, site, extract_kw)
        layers = acts.layers(site)
        feats = {layer: acts[site][layer] for layer in layers}
        cka = cka_matrix(feats, progress=False)
        er = effective_ranks(feats, center=True, progress=False)
        for k, layer in enumerate(layers):
            rows.append(
                {
                    "model": ck.label,
                    "site": site,
                    "layer": layer,
                    "effective_rank": float(er[k]),
                    "cka_with_previous": float(cka[k, k - 1]) if k else None,
                    "n_tokens": int(feats[layer].shape[0]),
                }
            )
        extra[ck.label] = {"layers": layers, "cka": cka, "effective_rank": er}
        ranks[ck.label] = {"layers": layers, "mean": er}
        figures[f"cka_{site}_{_slug(ck.label)}"] = F.plot_heatmap(
            cka,
            row_labels=layers,
            col_labels=layers,
            xlabel="layer",
            ylabel="layer",
            vmin=0.0,
            vmax=1.0,
            title=f"{ck.label}: linear CKA between layers ({site})",
            cbar_label="linear CKA",
        )
    figures[f"effective_rank_{site}"] = F.plot_layer_curves(
        ranks, ylabel="effective rank (centred)", title=f"Effective rank of {site} per layer"
    )
    return Analysis(
        f"cka_{site}",
        f"Layer similarity (CKA) and effective rank of {site}",
        rows,
        text=(
            "Linear CKA between the token representations of every pair of layers (1 = the same up to rotation "
            "and scale), and the effective rank (exp of the entropy of the singular values) of each layer's "
            "centred token cloud."
        ),
        extra={"cka": extra},
        figures=figures,
        columns=("model", "layer", "effective_rank", "cka_with_previous"),
    )


def router_analysis(
    cks: Sequence[Checkpoint],
    texts: Sequence[str] | None = None,
    *,
    seed: int = 0,
    extract_kw: dict | None = None,
) -> Analysis:
    """LIMe router weights, layer x buffered layer and per head (paper Figures 5, 9).

    ``texts`` are needed only for routing "dynamic", whose weights depend on the token.
    """
    from lime_probe.router import router_weights

    rows, extra, figures = [], {}, {}
    for ck in cks:
        routing = getattr(ck.config, "routing", None)
        if routing in (None, "none"):
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
        slug = _slug(ck.label)
        figures[f"router_{slug}"] = F.plot_router(res.per_layer, label=f"{ck.label} ({res.routing})")
        figures[f"router_heads_{slug}"] = F.plot_router_heads(
            res.per_head, label=f"{ck.label} ({res.routing})"
        )
    return Analysis(
        "router",
        "Router weights",
        rows,
        text=(
            "Normalised |router weight| of each layer over the buffered layers it reads (rows sum to 1), averaged "
            "over heads (first figure per model) and per KV head. Mass off the diagonal means the layer reads "
            "keys/values of earlier layers."
        ),
        extra={"routers": extra},
        figures=figures,
        columns=("model", "layer", "source_layer", "weight_share"),
    )


def _is_causal_lm(ck: Checkpoint) -> bool:
    """False for BERT-style encoders (a masked-LM architecture not configured as a decoder): their
    attention is bidirectional, so summed next-token log-probabilities mean nothing."""
    import transformers as tf

    return (
        bool(getattr(ck.config, "is_decoder", False)) or type(ck.config) not in tf.MODEL_FOR_MASKED_LM_MAPPING
    )


def blimp_analysis(
    cks: Sequence[Checkpoint],
    data,
    *,
    site: str = "hidden",
    max_pairs: int = 200,
    method: str = "logreg",
    seed: int = 0,
    extract_kw: dict | None = None,
) -> Analysis:
    """BLiMP per paradigm: good-vs-bad probes per layer (paper Table 2, Appendix D) and, for causal LMs,
    minimal-pair scoring (lm-evaluation-harness's rule). ``data`` is a ``load_blimp`` dataset."""
    from lime_probe.blimp import blimp_probe, score_minimal_pairs

    uids = np.asarray(data["UID"], dtype=object)
    paradigms = sorted(set(uids))
    rows, summary, extra, figures = [], [], {}, {}
    for ck in cks:
        curves, scores = {}, None
        picked = {p: np.flatnonzero(uids == p)[:max_pairs] for p in paradigms}
        if _is_causal_lm(ck):
            scores = score_minimal_pairs(
                ck.model, ck.tokenizer, data.select(np.concatenate(list(picked.values()))), progress=False
            )
            extra[ck.label] = {
                "minimal_pairs": {
                    "per_paradigm": scores.per_paradigm,
                    "per_phenomenon": scores.per_phenomenon,
                    "mean_over_paradigms": scores.mean_over_paradigms,
                    "mean_over_phenomena": scores.mean_over_phenomena,
                }
            }
        for p in paradigms:
            part = data.select(picked[p])
            good = extract_site(ck, list(part["sentence_good"]), site, extract_kw, pool="mean")
            bad = extract_site(ck, list(part["sentence_bad"]), site, extract_kw, pool="mean")
            res = blimp_probe(
                {la: good[site][la] for la in good[site]},
                {la: bad[site][la] for la in bad[site]},
                np.asarray(part["pairID"]),
                method=method,
                seed=seed,
                progress=False,
            )
            for layer, m, s in zip(res.layers, res.accuracy_mean, res.accuracy_std, strict=True):
                rows.append(
                    {
                        "model": ck.label,
                        "paradigm": p,
                        "site": site,
                        "layer": layer,
                        "probe_accuracy_mean": float(m),
                        "probe_accuracy_std": float(s),
                        "n_pairs": len(part),
                    }
                )
            curves[p] = {"layers": res.layers, "mean": res.accuracy_mean, "std": res.accuracy_std}
            best = int(np.argmax(res.accuracy_mean))
            summary.append(
                {
                    "model": ck.label,
                    "paradigm": p,
                    "best_layer": res.layers[best],
                    "probe_accuracy": float(res.accuracy_mean[best]),
                    "minimal_pair_accuracy": scores.per_paradigm[p] if scores else None,
                }
            )
        figures[f"blimp_{site}_{_slug(ck.label)}"] = F.plot_blimp_layers(curves, model=ck.label, site=site)
    models = [ck.label for ck in cks]
    best = np.array(
        [
            [
                next(r["probe_accuracy"] for r in summary if r["model"] == m and r["paradigm"] == p)
                for m in models
            ]
            for p in paradigms
        ]
    )
    figures[f"blimp_{site}_best_layer"] = F.plot_heatmap(
        best,
        row_labels=paradigms,
        col_labels=models,
        xlabel="model",
        ylabel="paradigm",
        vmin=0.5,
        vmax=1.0,
        title=f"BLiMP probe accuracy at the best layer ({site})",
        cbar_label="probe accuracy",
    )
    return Analysis(
        f"blimp_{site}",
        "BLiMP probes and minimal pairs",
        rows,
        text=(
            f"Per paradigm (at most {max_pairs} pairs each): a logistic-regression probe telling the mean-pooled "
            f"{site} representation of the good sentence from the bad one, 5-fold CV grouped by pair, per layer; "
            "and, for causal LMs, minimal-pair accuracy (summed log-probabilities after the BOS token, good > bad, "
            "as lm-evaluation-harness). The mean over paradigms and over phenomena are both in the JSON."
        ),
        extra={"blimp": extra},
        figures=figures,
        summary=summary,
    )


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


# The analyses of texts, by command name (BLiMP takes its own data: ``blimp_analysis``).
ANALYSES: dict[str, Callable] = {
    "entropy": entropy_analysis,
    "separability": separability_analysis,
    "tsne": tsne_analysis,
    "cka": cka_analysis,
    "router": router_analysis,
}


# --------------------------------------------------------------------------- output


def write_analysis(a: Analysis, out: Path, meta: dict) -> None:
    """Write an analysis's results (JSON + CSV) and figures (PNG + PDF) into ``out``."""
    write_results(out / a.name, a.rows, meta=meta, extra=a.extra)
    for stem, fig in a.figures.items():
        F.save_figure(fig, out / stem)


def section_for(a: Analysis) -> Section:
    """The report section of an analysis: its text, figures and compact table."""
    return Section(a.title, text=a.text, figures=list(a.figures.values()), tables=[Table(a.title, a.table())])
