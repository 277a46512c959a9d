"""Linear CKA between layers (of one model, or across models) and effective rank per layer (beyond the paper).

Streamed: the texts are extracted a few sequences at a time (`CHUNK_SEQUENCES`) and only the sums CKA needs are
kept (`similarity.CkaStream`; its memory is 8 (sum_l d_l)^2 bytes per model, plus 8 (sum_l d_l)(sum_m d_m) per
pair of models compared, flat in the number of tokens). With ``across_models`` every layer of each
checkpoint is compared with every layer of each other one on the same token rows: the checkpoints must
tokenize the data alike.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, replace
from typing import Any

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.sites import check_site

from .base import SITE_HELP, Checkpoint, Result, Spec, curve, extract_site, group, option, slug

# Sequences extracted at once (ours): 8 windows of 512 tokens are one forward batch at the default 4096
# tokens a batch, so the activations held beside the sums are one batch's.
CHUNK_SEQUENCES = 8


@dataclass(frozen=True)
class CkaParams:
    site: str = option("hidden", f"representation to probe: {SITE_HELP}", type=check_site, metavar="SITE")
    debiased: bool = option(
        False,
        "debiased linear CKA: HSIC replaced by its unbiased estimator (Song et al. 2012, as Kornblith et al. "
        "2019), free of plain CKA's pull towards 1 when tokens are few against the width; may be slightly "
        "negative",
    )
    across_models: bool = option(
        False,
        "with two or more checkpoints, also compare every layer of each checkpoint with every layer of each "
        "other one, on the same token rows (the checkpoints must tokenize the data alike)",
    )


def _chunks(texts: Iterable, size: int) -> Iterator[list]:
    it = iter(texts)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _same_tokens(first: Checkpoint, acts_first, ck: Checkpoint, acts) -> None:
    import torch

    if not (
        torch.equal(acts.token_ids, acts_first.token_ids) and torch.equal(acts.offsets, acts_first.offsets)
    ):
        raise ValueError(
            f"--across-models compares the same token rows, but {first.label!r} and {ck.label!r} tokenize the "
            "data differently (another tokenizer or position limit); compare checkpoints that share a tokenizer"
        )


def _streamed(cks: Sequence[Checkpoint], texts: Iterable, p: CkaParams, extraction: Extraction) -> list:
    """The `CkaStream` sums of ``texts`` read chunk by chunk: one stream over every checkpoint when they are
    compared (``p.across_models``: the same token rows), else one each; each checkpoint stops at
    ``extraction.max_tokens``."""
    from tqdm.auto import tqdm

    from lime_probe.probes.similarity import CkaStream

    streams = [CkaStream(len(cks), across=True)] if p.across_models else [CkaStream() for _ in cks]
    left: list[int | None] = [extraction.max_tokens] * len(cks)  # each checkpoint's token budget left
    bar = tqdm(total=len(texts) if isinstance(texts, Sized) else None, desc=f"CKA ({p.site})", unit="seq")
    for chunk in _chunks(texts, CHUNK_SEQUENCES):
        batch: dict[int, tuple[Any, dict]] = {}
        for m, ck in enumerate(cks):
            if (budget := left[m]) is not None and budget <= 0:
                continue
            acts = extract_site(ck, chunk, p.site, replace(extraction, max_tokens=budget, progress=False))
            if batch and p.across_models:
                _same_tokens(cks[0], batch[0][0], ck, acts)
            batch[m] = (acts, {la: acts[p.site][la] for la in acts.layers(p.site)})
            if budget is not None:
                left[m] = budget - int(acts.token_ids.shape[0])  # rows are tokens (no pooling)
        if not batch:
            break
        if p.across_models:
            streams[0].update(*(feats for _, feats in batch.values()))
        else:
            for m, (_, feats) in batch.items():
                streams[m].update(feats)
        bar.update(len(chunk))
    bar.close()
    if streams[0].n == 0:
        raise ValueError("cka: no texts given")
    return streams


def _within(cks: Sequence[Checkpoint], streams: list, p: CkaParams) -> tuple[list[list], list[dict], dict]:
    """Each checkpoint's layer names, its rows (effective rank, CKA with the previous layer) and extra (the
    CKA matrix between its layers)."""

    def stream_of(m: int) -> tuple[Any, int]:
        """The stream holding checkpoint m, and its index there."""
        return (streams[0], m) if p.across_models else (streams[m], 0)

    layers = [stream.names[k] for stream, k in map(stream_of, range(len(cks)))]
    rows, extra = [], {}
    for m, ck in enumerate(cks):
        stream, k = stream_of(m)
        cka = stream.cka(k, debiased=p.debiased)
        er = stream.effective_ranks(k)
        for i, layer in enumerate(layers[m]):
            rows.append(
                {
                    "model": ck.label,
                    "site": p.site,
                    "layer": layer,
                    "effective_rank": float(er[i]),
                    "cka_with_previous": float(cka[i, i - 1]) if i else None,
                    "n_tokens": stream.n,
                    "debiased": p.debiased,
                }
            )
        extra[ck.label] = {"layers": layers[m], "cka": cka, "effective_rank": er}
    return layers, rows, extra


def _across(
    cks: Sequence[Checkpoint], stream: Any, layers: list[list], p: CkaParams
) -> tuple[list[dict], list[dict]]:
    """The CKA matrices between the layers of every pair of checkpoints (one ``stream`` over all), and for
    each layer the most similar layer of the other checkpoint."""
    across, best = [], []
    for a, b in itertools.combinations(range(len(cks)), 2):
        cka = stream.cka(a, b, debiased=p.debiased)
        across.append(
            {"models": [cks[a].label, cks[b].label], "rows": layers[a], "cols": layers[b], "cka": cka}
        )
        for i, layer in enumerate(layers[a]):
            j = int(cka[i].argmax())
            same = layers[b].index(layer) if layer in layers[b] else None
            best.append(
                {
                    "model": cks[a].label,
                    "layer": layer,
                    "other_model": cks[b].label,
                    "most_similar_layer": layers[b][j],
                    "cka_most_similar": float(cka[i, j]),
                    "cka_same_layer": None if same is None else float(cka[i, same]),
                }
            )
    return across, best


def compute(cks: Sequence[Checkpoint], texts: Iterable, p: CkaParams, extraction: Extraction) -> Result:
    """Linear CKA between every pair of layers of each checkpoint (extra: the matrices), with
    ``p.across_models`` between the layers of every pair of checkpoints (extra and ``tables``), and the
    centred effective rank of each layer (rows); streamed over chunks of ``texts``."""
    if p.across_models and len(cks) < 2:
        raise ValueError("--across-models needs two or more checkpoints (--ckpt)")
    streams = _streamed(cks, texts, p, extraction)
    layers, rows, extra = _within(cks, streams, p)
    across, best = _across(cks, streams[0], layers, p) if p.across_models else ([], [])
    kind = "Debiased linear CKA (HSIC_1 of Song et al. 2012)" if p.debiased else "Linear CKA"
    return Result(
        "cka",
        f"cka_{slug(p.site)}",
        f"Layer similarity ({'debiased ' if p.debiased else ''}CKA) and effective rank of {p.site}",
        rows,
        text=(
            f"{kind} between the token representations of every pair of layers (1 = the same up to rotation "
            "and scale)"
            + (", within each model and across models on the same tokens" if p.across_models else "")
            + ", and the effective rank (exp of the entropy of the singular values) of each layer's centred "
            "token cloud."
            + (
                " Across models: each layer's most similar layer of the other model."
                if p.across_models
                else ""
            )
        ),
        extra={"cka": extra, "debiased": p.debiased} | ({"cka_across": across} if p.across_models else {}),
        columns=("model", "layer", "effective_rank", "cka_with_previous"),
        tables={f"cka_across_{slug(p.site)}": best} if p.across_models else {},
    )


def plot(result: Result) -> dict:
    import numpy as np

    from lime_probe.output import charts as C
    from lime_probe.output import plots as F

    site = result.rows[0]["site"]
    kind = "debiased linear CKA" if result.extra.get("debiased") else "linear CKA"

    def heatmap(m, rows, cols, xlabel, ylabel, title):
        return F.plot_heatmap(
            m,
            row_labels=rows,
            col_labels=cols,
            xlabel=xlabel,
            ylabel=ylabel,
            vmin=min(0.0, float(np.min(m))),  # debiased CKA may dip below 0
            vmax=1.0,
            title=title,
            cbar_label=kind,
        )

    # the axes say how layers are counted: hidden's 0..L from the embeddings, the other sites' blocks from 0
    # (wrapped: a heatmap of a few layers is narrower than the label)
    axis = textwrap.fill(F.layer_axis_label(site), 28)
    figures = {
        f"cka_{slug(site)}_{slug(label)}": heatmap(
            m["cka"], m["layers"], m["layers"], axis, axis, f"{label}: {kind} between layers ({site})"
        )
        for label, m in result.extra["cka"].items()
    }
    for m in result.extra.get("cka_across", []):
        a, b = m["models"]
        figures[f"cka_{slug(site)}_{slug(a)}_vs_{slug(b)}"] = heatmap(
            m["cka"], m["rows"], m["cols"], f"{b}\n{axis}", f"{a}\n{axis}", f"{a} vs {b}: {kind} ({site})"
        )
    ranks = {m: curve(rs, "effective_rank") for m, rs in group(result.rows, "model").items()}
    figures[f"effective_rank_{slug(site)}"] = C.plot_layer_curves(
        ranks,
        ylabel="effective rank (centred)",
        title=f"Effective rank of {site} per layer",
        xlabel=F.layer_axis_label(site),
    )
    return figures


SPEC = Spec(
    name="cka",
    help="linear CKA between layers (within and across models, plain or debiased) and effective rank per layer",
    example="lime-probe cka --ckpt runs/lime --data data/wikitext-2/valid.txt --site hidden --max-tokens 2000 "
    "--out out/cka\n"
    "lime-probe cka --ckpt runs/lime --ckpt runs/llama --across-models --debiased \\\n"
    "    --data data/wikitext-2/valid.txt --max-tokens 20000 --out out/cka-across",
    params=CkaParams,
    compute=compute,
    plot=plot,
    notebook="cka",
    streams=lambda p: True,  # chunk by chunk, one pass: --data is never read whole
)
