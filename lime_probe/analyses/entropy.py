"""Matrix entropy per layer (paper Sec. 5.3, Figures 2a, 4a, 7a)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from lime_probe.sites import SITES

from .base import Checkpoint, Result, Spec, curve, extract_site, group, option, seed_option


@dataclass(frozen=True)
class EntropyParams:
    site: str = option("values", "representation to probe", choices=SITES)
    preset: str = option(
        "lime",
        "normalisation preset: the official code's or Skean et al.'s",
        choices=("lime", "layer-by-layer"),
    )
    alpha: float | None = option(None, "Renyi order (default: the preset's)")
    seed: int = seed_option()


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: EntropyParams, extract_kw: dict | None
) -> Result:
    """Entropy of each sequence's ``p.site`` per layer, streamed layer by layer and shard by shard
    (``stream_entropy``): one row per model and layer with the mean and its bootstrap CI."""
    from tqdm.auto import tqdm

    from lime_probe.entropy import stream_entropy

    rows = []
    for ck in cks:
        acts = extract_site(ck, texts, p.site, extract_kw)
        for layer in tqdm(acts.layers(p.site), desc=f"entropy {ck.label}", unit="layer"):
            chunks = functools.partial(acts.iter_sequences, p.site, layer)  # one cache shard at a time
            r = stream_entropy(chunks, p.preset, alpha=p.alpha, seed=p.seed)
            rows.append(
                {
                    "model": ck.label,
                    "site": p.site,
                    "layer": layer,
                    "entropy_mean": r.mean,
                    "entropy_std": r.std,
                    "ci_low": r.ci_low,
                    "ci_high": r.ci_high,
                    "n_sequences": len(r.values),
                    "alpha": r.config.alpha,
                }
            )
    used_alpha = rows[0]["alpha"]
    return Result(
        "entropy",
        f"entropy_{p.site}",
        f"Matrix entropy of {p.site}",
        rows,
        text=(
            f"Matrix-based Renyi entropy (alpha={used_alpha:g}, preset {p.preset!r}) of each sequence's {p.site} "
            f"per layer; mean over {rows[0]['n_sequences']} sequences with a 95% bootstrap CI of the mean. Lower "
            "entropy means the tokens crowd into fewer directions (representation collapse)."
        ),
        columns=("model", "layer", "entropy_mean", "ci_low", "ci_high"),
    )


def plot(result: Result) -> dict:
    from lime_probe import figures as F

    rows = result.rows
    curves = {
        m: curve(rs, "entropy_mean", low="ci_low", high="ci_high") for m, rs in group(rows, "model").items()
    }
    return {result.name: F.plot_entropy(curves, site=rows[0]["site"], alpha=rows[0]["alpha"])}


SPEC = Spec(
    name="entropy",
    help="matrix-based Renyi entropy per layer (paper Sec. 5.3, Figures 2a/4a/7a)",
    example="lime-probe entropy --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
    "    --data wikitext-2/valid.txt --site values --max-sequences 64 --out out/entropy",
    params=EntropyParams,
    compute=compute,
    plot=plot,
    notebook="entropy",
)
