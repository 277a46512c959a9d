"""The logit lens per layer (not in the paper; `lime_probe.probes.logit_lens`): what the residual stream X_l
already predicts when read through the model's own final norm and unembedding, the per-layer reading that
sits beside an entropy curve of ``hidden``.

Each document is one sequence, truncated to ``--max-length`` tokens (as entropy's ``--unit documents``), so
the texts are read in one pass per checkpoint and may be a lazily read `Corpus`. Per model and layer: the
next-token cross-entropy over every predicted token (nats; at the last layer the model's own loss) and the
share of tokens whose top-1 is the model's own prediction, each with a 95 % bootstrap CI over documents.
Causal LMs only (``report`` skips encoders).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from lime_probe.extraction.settings import Extraction

from .base import Checkpoint, Result, Spec, curve, extract_site, group, option, seed_option

MIN_LENGTH = 2  # tokens per sequence: the lens reads a prediction and scores it on the next token


@dataclass(frozen=True)
class LogitLensParams:
    seed: int = seed_option()
    top_k: int = option(
        0,
        "also tabulate, per position of the first --top-k-sequences documents and per layer, the lens's K most "
        "probable next tokens, decoded (logit_lens_tokens.csv; 0: no table)",
        metavar="K",
    )
    top_k_sequences: int = option(4, "documents in that table", metavar="N", positive=True)

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"--top-k must be 0 or more, got {self.top_k}")


def is_causal_lm(ck: Checkpoint) -> bool:
    """Whether ``ck`` has an unembedding to read the lens through (a causal LM, not an encoder)."""
    model = getattr(ck.model, "_module", ck.model)
    return getattr(model, "get_output_embeddings", lambda: None)() is not None


def compute(
    cks: Sequence[Checkpoint], texts: Iterable[str], p: LogitLensParams, extraction: Extraction
) -> Result:
    """One row per model and layer of ``hidden`` (``--layers``, always with the last, the reference): the
    lens's next-token cross-entropy and top-1 agreement with their bootstrap CIs over documents."""
    from lime_probe.probes.logit_lens import lens_head, lens_top_tokens, logit_lens
    from lime_probe.probes.stats import bootstrap_ratio_ci

    if extraction.max_length < MIN_LENGTH:
        raise ValueError(
            f"--max-length {extraction.max_length}: logit-lens needs at least {MIN_LENGTH} tokens per sequence"
        )
    if extraction.layers is not None:  # X_L: the model's own prediction, which every layer is compared to
        extraction = replace(extraction, layers=(*extraction.layers, -1))
    rows: list[dict] = []
    tokens_table: list[dict] = []
    for ck in cks:
        lens_head(ck.model)  # a model the lens cannot read is refused before any forward pass
        acts = extract_site(ck, texts, "hidden", extraction, logprobs=True)
        lens = logit_lens(ck.model, acts, desc=f"logit lens {ck.label}")
        if p.top_k:
            top = lens_top_tokens(ck.model, ck.tokenizer, acts, p.top_k, p.top_k_sequences)
            tokens_table += [{"model": ck.label} | r for r in top]
        tokens = int(next(iter(lens.values())).count.sum())
        for layer, r in lens.items():
            ce_low, ce_high = bootstrap_ratio_ci(r.nll, r.count, seed=p.seed)
            ag_low, ag_high = bootstrap_ratio_ci(r.agree, r.count, seed=p.seed)
            rows.append(
                {
                    "model": ck.label,
                    "layer": layer,
                    "cross_entropy": r.cross_entropy,
                    "ce_ci_low": ce_low,
                    "ce_ci_high": ce_high,
                    "agreement": r.agreement,
                    "agreement_ci_low": ag_low,
                    "agreement_ci_high": ag_high,
                    "model_loss": float(-acts.logprobs.sum()) / tokens,
                    "tokens": tokens,
                    "n_sequences": acts.n_sequences,
                }
            )
    losses = "; ".join(f"{m}: {rs[-1]['cross_entropy']:.3f}" for m, rs in group(rows, "model").items())
    first = rows[0]
    return Result(
        "logit-lens",
        "logit_lens",
        "Logit lens",
        rows,
        text=(
            "The logit lens: each layer's residual stream X_l (X_0 = embeddings, X_l = output of block l) read "
            "through the model's own final norm and unembedding. Next-token cross-entropy (nats per predicted "
            "token) and the share of tokens whose top-1 is the model's own prediction (the last layer's), over "
            f"{first['tokens']} predicted tokens of {first['n_sequences']} documents each truncated to its first "
            f"tokens, with 95% bootstrap CIs over documents. At the last layer the cross-entropy is the model's "
            f"own loss ({losses}) and the agreement 1."
        ),
        columns=("model", "layer", "cross_entropy", "ce_ci_low", "ce_ci_high", "agreement"),
        tables={"logit_lens_tokens": tokens_table} if tokens_table else {},
    )


def plot(result: Result) -> dict:
    from lime_probe.output import charts as F

    by_model = group(result.rows, "model")
    ce = {m: curve(rs, "cross_entropy", low="ce_ci_low", high="ce_ci_high") for m, rs in by_model.items()}
    agree = {
        m: curve(rs, "agreement", low="agreement_ci_low", high="agreement_ci_high")
        for m, rs in by_model.items()
    }
    return {result.name: F.plot_logit_lens(ce, agree, band="95 % bootstrap CI over documents")}


SPEC = Spec(
    name="logit-lens",
    help="logit lens per layer: next-token loss and top-1 agreement with the model's own prediction of each "
    "layer's residual stream, read through the final norm and unembedding",
    example="lime-probe logit-lens --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
    "    --data data/wikitext-2/test.txt --out out/logit-lens",
    params=LogitLensParams,
    compute=compute,
    plot=plot,
    notebook="logit_lens",
    applies=is_causal_lm,
    applies_to="causal LMs (a model with an unembedding)",
    streams=lambda p: True,  # documents, one pass per checkpoint
    min_length=MIN_LENGTH,
)
