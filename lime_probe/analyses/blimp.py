"""BLiMP per paradigm: good-vs-bad probes per layer (paper Table 2, Appendix D) and, for causal LMs,
minimal-pair scoring (lm-evaluation-harness's rule)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.sites import SITES

from .base import Checkpoint, Result, Spec, curve, group, option, seed_option, slug
from .separability import METHODS


@dataclass(frozen=True)
class BlimpParams:
    site: str = option("hidden", "representation to probe", choices=SITES)
    paradigms: tuple[str, ...] | None = option(
        None, "BLiMP paradigms to use (default: all in --data)", metavar="UID"
    )
    max_pairs: int = option(
        200, "minimal pairs per paradigm (default: %(default)s; BLiMP has 1,000)", metavar="N", positive=True
    )
    method: str = option("logreg", "probe", choices=METHODS)
    seed: int = seed_option()


def _is_causal_lm(ck: Checkpoint) -> bool:
    """False for BERT-style encoders (a masked-LM architecture not configured as a decoder): their
    attention is bidirectional, so summed next-token log-probabilities mean nothing."""
    import transformers as tf

    return (
        bool(getattr(ck.config, "is_decoder", False)) or type(ck.config) not in tf.MODEL_FOR_MASKED_LM_MAPPING
    )


def compute(cks: Sequence[Checkpoint], data, p: BlimpParams, extract_kw: dict | None) -> Result:
    """Per model and paradigm (``p.paradigms``, default all in ``data``; at most ``p.max_pairs`` pairs each):
    probe accuracy per layer (rows), the best layer and the minimal-pair accuracy (summary). ``data`` is a
    ``load_blimp`` dataset."""
    import numpy as np

    from lime_probe.blimp import blimp_probe, score_minimal_pairs

    from .base import extract_site

    uids = np.asarray(data["UID"], dtype=object)
    paradigms = sorted(set(uids) if p.paradigms is None else set(p.paradigms))
    missing = sorted(set(paradigms) - set(uids))
    if missing:
        raise ValueError(f"paradigms {missing} are not in the BLiMP data")
    rows, summary, extra = [], [], {}
    for ck in cks:
        scores = None
        picked = {q: np.flatnonzero(uids == q)[: p.max_pairs] for q in paradigms}
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
        for q in paradigms:
            part = data.select(picked[q])
            good = extract_site(ck, list(part["sentence_good"]), p.site, extract_kw, pool="mean")
            bad = extract_site(ck, list(part["sentence_bad"]), p.site, extract_kw, pool="mean")
            res = blimp_probe(
                {la: good[p.site][la] for la in good[p.site]},
                {la: bad[p.site][la] for la in bad[p.site]},
                np.asarray(part["pairID"]),
                method=p.method,
                seed=p.seed,
                progress=False,
            )
            for layer, m, s in zip(res.layers, res.accuracy_mean, res.accuracy_std, strict=True):
                rows.append(
                    {
                        "model": ck.label,
                        "paradigm": q,
                        "site": p.site,
                        "layer": layer,
                        "probe_accuracy_mean": float(m),
                        "probe_accuracy_std": float(s),
                        "n_pairs": len(part),
                    }
                )
            best = int(np.argmax(res.accuracy_mean))
            summary.append(
                {
                    "model": ck.label,
                    "paradigm": q,
                    "best_layer": res.layers[best],
                    "probe_accuracy": float(res.accuracy_mean[best]),
                    "minimal_pair_accuracy": scores.per_paradigm[q] if scores else None,
                }
            )
    return Result(
        "blimp",
        f"blimp_{p.site}",
        "BLiMP probes and minimal pairs",
        rows,
        text=(
            f"Per paradigm (at most {p.max_pairs} pairs each): a logistic-regression probe telling the mean-pooled "
            f"{p.site} representation of the good sentence from the bad one, 5-fold CV grouped by pair, per layer; "
            "and, for causal LMs, minimal-pair accuracy (summed log-probabilities after the BOS token, good > bad, "
            "as lm-evaluation-harness). The mean over paradigms and over phenomena are both in the JSON."
        ),
        extra={"blimp": extra},
        summary=summary,
    )


def plot(result: Result) -> dict:
    import numpy as np

    from lime_probe import figures as F

    site = result.rows[0]["site"]
    labels = list(group(result.summary, "model"))
    paradigms = list(group(result.summary, "paradigm"))
    figures = {}
    for m, mine in group(result.rows, "model").items():
        curves = {
            q: curve(rs, "probe_accuracy_mean", std="probe_accuracy_std")
            for q, rs in group(mine, "paradigm").items()
        }
        figures[f"blimp_{site}_{slug(m)}"] = F.plot_blimp_layers(curves, model=m, site=site)
    best = {(r["paradigm"], r["model"]): r["probe_accuracy"] for r in result.summary}
    figures[f"blimp_{site}_best_layer"] = F.plot_heatmap(
        np.array([[best[q, m] for m in labels] for q in paradigms]),
        row_labels=paradigms,
        col_labels=labels,
        xlabel="model",
        ylabel="paradigm",
        vmin=0.5,
        vmax=1.0,
        title=f"BLiMP probe accuracy at the best layer ({site})",
        cbar_label="probe accuracy",
    )
    return figures


SPEC = Spec(
    name="blimp",
    help="BLiMP good-vs-bad probes per layer and minimal-pair scoring (paper Table 2)",
    example="lime-probe blimp --ckpt runs/lime --ckpt runs/llama --data shared/data/blimp \\\n"
    "    --paradigms anaphor_gender_agreement adjunct_island --max-pairs 500 --out out/blimp",
    params=BlimpParams,
    compute=compute,
    plot=plot,
    data_kind="blimp",
    notebook="blimp",
)
