"""Matrix entropy per layer (paper Sec. 5.3, Figures 2a, 4a, 7a).

The unit of text is a fixed-length token window by default (``lime_probe.extraction.windows``): the texts are
packed into non-overlapping windows of one length, ``num_windows`` of them drawn with the seed, so the
per-sequence entropy does not mix lengths and two checkpoints with the same tokenizer see the same
token ids. ``unit="documents"`` is the per-document mode (each text truncated to ``--max-length``); it
reads the texts in one pass per checkpoint, so they may be an iterable read lazily (a `Corpus`, a streamed
dataset) and memory stays flat in their number; windows need the whole corpus up front (a list).

By default the values are measured twice for a model that routes: the W_V output (the paper's values, Sec.
5.3) and the routed values its heads attend to (the official analysis's); other models have the first only
(``base.value_sites``). Rows carry the site; legends name both.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from lime_probe.extraction.settings import Extraction
from lime_probe.protocol import defaults

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

from .base import (
    Checkpoint,
    Result,
    Spec,
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

PROTOCOL = defaults("entropy")


@dataclass(frozen=True)
class EntropyParams:
    site: str | None = value_site_option()
    preset: str = option(
        PROTOCOL["preset"],
        "normalisation preset: the official code's or Skean et al.'s",
        choices=("lime", "layer-by-layer"),
    )
    alpha: float | None = option(None, "Renyi order (default: the preset's)")
    unit: str = option(
        PROTOCOL["unit"],
        "unit of text: fixed-length token windows packed from the data (drawn at random: the whole "
        "data is read first), or one sequence per document (truncated to --max-length; --data is then "
        "read as the extraction goes, never whole)",
        choices=("windows", "documents"),
    )
    window: int | None = option(
        None,
        "tokens per window (default: 2048, the official code's rows, capped at the model's max positions)",
        metavar="T",
        positive=True,
    )
    num_windows: int = option(
        PROTOCOL["num_windows"], "windows drawn (seeded, without replacement)", metavar="N", positive=True
    )
    max_normalize: bool = option(
        PROTOCOL["max_normalize"], "divide each entropy by log(min(tokens, dim)), as Skean et al.'s code"
    )
    seed: int = seed_option()
    mix_router: str | None = mix_router_option("entropy")

    def __post_init__(self):
        from lime_model.checks import check_positive  # here: `import lime_model` registers the models

        if self.alpha is not None:
            check_positive(self.alpha, "--alpha")
        check_mix_site(self.mix_router, self.site)


def window_for(ck: Checkpoint, p: EntropyParams) -> tuple[int, str]:
    """The window length of ``ck`` under ``p`` and where it comes from ("given", "official",
    "max_positions")."""
    from lime_model.checks import check_window
    from lime_probe.extraction.windows import default_window

    if p.window is None:
        return default_window(ck.model)
    check_window(p.window, ck.config, ck.label)
    return p.window, "given"


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: EntropyParams, extraction: Extraction
) -> Result:
    """Entropy of each sequence's representations per layer at ``p.site`` (default: ``value_sites``),
    streamed layer by layer and shard by shard (``stream_entropy``): one row per model, site and layer with
    the mean and its bootstrap CI."""
    from tqdm.auto import tqdm

    from lime_model.digests import texts_hash
    from lime_probe.extraction.windows import token_windows
    from lime_probe.probes.entropy import entropy_config, stream_entropy

    config = entropy_config(p.preset, alpha=p.alpha, max_normalize=p.max_normalize)
    rows = []
    for ck in cks:
        router = None if p.mix_router is None else mixing_router(ck, p.mix_router)
        sites = value_sites(ck, p.site)
        unit: dict[str, Any] = {"unit": p.unit, "window": None, "window_source": None, "num_windows": None}
        if p.unit == "windows":
            window, source = window_for(ck, p)
            ids = token_windows(texts, ck.tokenizer, window, p.num_windows, seed=p.seed)
            acts = extract_site(ck, ids, sites, extraction, max_length=window, pretokenized=True)
            unit |= {"window": window, "window_source": source, "num_windows": len(ids)}
            unit["windows_digest"] = texts_hash(ids)  # equal for checkpoints that saw the same windows
        else:
            acts = extract_site(ck, texts, sites, extraction)
        streams = {
            site: {layer: functools.partial(acts.iter_sequences, site, layer) for layer in acts.layers(site)}
            for site in sites
        }  # one cache shard at a time
        if router is not None:
            streams = {MIXED: mixed_streams(acts, router)}
            unit["mix_router"] = p.mix_router
        device = model_device(ck)
        for site, per_layer in streams.items():
            for layer, chunks in tqdm(per_layer.items(), desc=f"entropy {ck.label} {site}", unit="layer"):
                r = stream_entropy(chunks, config, seed=p.seed, device=device)
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
                        "max_normalize": r.config.max_normalize,
                        **unit,
                    }
                )
    first = rows[0]
    if p.unit == "windows":
        sizes = sorted({(r["model"], r["window"], r["window_source"]) for r in rows})
        what = "; ".join(f"{m}: {w} tokens ({s})" for m, w, s in sizes)
        unit_text = (
            f"{first['num_windows']} non-overlapping token windows packed from the data (seed {p.seed}); "
            f"window length per model: {what}"
        )
    else:
        unit_text = f"{first['n_sequences']} documents, each truncated to its first tokens"
    scale = ", divided by log(min(tokens, dim))" if first["max_normalize"] else ""
    return Result(
        "entropy",
        f"entropy_{slug(p.site or 'values')}",
        f"Matrix entropy of {p.site or 'values'}",
        rows,
        text=(
            f"Matrix-based Renyi entropy (alpha={first['alpha']:g}, preset {p.preset!r}{scale}) of each sequence's "
            f"{sites_text(rows)} per layer; mean over {unit_text}, with a 95% bootstrap CI of the mean. Lower entropy means "
            "the tokens crowd into fewer directions (representation collapse)."
            + routing_note(rows, p.site is None)
        ),
        columns=("model", "site", "layer", "entropy_mean", "ci_low", "ci_high"),
    )


def model_device(ck: Checkpoint) -> torch.device:
    """Where ``ck``'s model runs (its input embedding's device; the CPU for weights on ``meta``): the
    entropy's Gram matrices and eigenvalues are computed there, on the GPU when the model is."""
    from lime_probe.extraction.loading import input_device
    from lime_probe.probes.router_weights import unwrap_model

    return input_device(cast("PreTrainedModel", unwrap_model(ck.model)))


def mixed_streams(acts, router_model: Any) -> dict:
    """{layer: chunks} of ``acts``'s values mixed across layers by ``router_model``'s routers
    (`mix_by_router`), in the form `stream_entropy` reads. Holds every layer's values at once (the null is
    for the models a study trains, not for billion-parameter ones)."""
    import torch

    from lime_probe.probes.router_weights import mix_by_router

    mixed = mix_by_router(router_model, {layer: acts["values"][layer] for layer in acts.layers("values")})
    lengths = acts.offsets.diff().tolist()

    def chunks(x: torch.Tensor):
        return lambda: [list(torch.split(x, lengths))]

    return {layer: chunks(x) for layer, x in mixed.items()}


def plot(result: Result) -> dict:
    from lime_probe.output import charts as F

    rows = result.rows
    curves = site_curves(rows, "entropy_mean", low="ci_low", high="ci_high")
    band = "95 % bootstrap CI of the mean over sequences"
    return {result.name: F.plot_entropy(curves, site=rows[0]["site"], alpha=rows[0]["alpha"], band=band)}


SPEC = Spec(
    name="entropy",
    help="matrix-based Renyi entropy per layer (paper Sec. 5.3, Figures 2a/4a/7a)",
    example="lime-probe entropy --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
    "    --data data/wikitext-2/valid.txt --site values --num-windows 32 --out out/entropy",
    params=EntropyParams,
    compute=compute,
    plot=plot,
    notebook="entropy",
    max_sequences=4000,
    streams=lambda p: p.unit == "documents",  # windows are drawn from the whole packed corpus
)
