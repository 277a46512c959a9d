"""Held-out perplexity of a causal language model (paper Sec. 5.1, Figure 1: LIMe's lower loss).

The texts are packed as ``lime-model train`` packs them (`lime_model.data.packed_sequences`: each
document followed by EOS, concatenated, cut into non-overlapping windows of the model's positions, the
tail dropped), and every token of a window but the first is predicted from those before it, so the
number equals ``lime-model eval`` on the same text and is the same set of predictions for every
checkpoint that shares a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.extraction.settings import Extraction

from .base import Checkpoint, Result, Spec, option

MIN_WINDOW = 2  # tokens per window: its first token is not predicted, so one token scores nothing


@dataclass(frozen=True)
class PerplexityParams:
    window: int | None = option(
        None, "tokens per window, 2 to the model's positions (default: those)", metavar="T", positive=True
    )

    def __post_init__(self):
        if self.window is not None and not (isinstance(self.window, int) and self.window >= MIN_WINDOW):
            raise ValueError(f"--window must be an integer >= {MIN_WINDOW}, got {self.window!r}")


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: PerplexityParams, extraction: Extraction
) -> Result:
    """One row per model: mean next-token NLL over the packed windows (``loss``, nats), ``exp`` of it;
    ``extraction.batch_size`` windows per forward pass (default 8, as ``lime-model eval``)."""
    import torch

    from lime_model.checks import check_causal_lm, check_window
    from lime_model.data import packed_sequences
    from lime_model.evaluate import token_nll
    from lime_probe.extraction.windows import max_positions

    for ck in cks:  # all before any work: an encoder is loaded without a head (`lime_probe.load`)
        check_causal_lm(ck.config, ck.label)
        check_window(p.window, ck.config, ck.label)
    rows = []
    for ck in cks:
        model = getattr(ck.model, "_module", ck.model)
        window = p.window if p.window is not None else max_positions(model)
        if window is None:
            raise ValueError(f"{ck.label} states no maximum length: give --window")
        ids = torch.from_numpy(packed_sequences(list(texts), ck.tokenizer, window))
        total, count = token_nll(model, ids, ids, extraction.batch_size or 8)
        rows.append(
            {
                "model": ck.label,
                "window": window,
                "windows": len(ids),
                "tokens": count,
                "loss": total / count,
                "perplexity": math.exp(total / count),
            }
        )
    return Result(
        "perplexity",
        "perplexity",
        "Held-out perplexity",
        rows,
        text=(
            "exp of the mean next-token NLL over non-overlapping windows of the packed texts (each document "
            "followed by EOS, as training packs them; the first token of each window is not predicted)."
        ),
    )


def plot(result: Result) -> dict:
    from lime_probe.output import charts as F

    return {result.name: F.plot_bars({r["model"]: r["perplexity"] for r in result.rows}, ylabel="perplexity")}


SPEC = Spec(
    name="perplexity",
    help="held-out perplexity of a causal LM, windows packed as training packs them (paper Sec. 5.1, Fig. 1)",
    example="lime-probe perplexity --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
    "    --data data/wikitext-2/test.txt --out out/perplexity",
    params=PerplexityParams,
    compute=compute,
    plot=plot,
    notebook="",
    max_sequences=100_000,
)
