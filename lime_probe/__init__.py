"""Probes of representation collapse for LIMe, LLaMA and any Hugging Face checkpoint.

    import lime_probe
    model, tok = lime_probe.load("runs/lime")                 # a checkpoint dir or hub id
    acts = lime_probe.extract(model, texts, sites=["values", "hidden"])   # texts: list of str
    Z = acts["values"][1]                                      # block 1: (n_tokens, dim), padding removed
    H = acts.stack("hidden")                                   # (n_layers, n_tokens, dim)
    lime_probe.matrix_entropy(Z, alpha=1.0)                    # Z: (..., t, d) -> (...)

README.md's "The Python API" has the same example in full, runnable as written on the run it trains.

Sites: ``hidden`` (residual stream X_0..X_L), ``final`` (after the final norm), ``values`` and
``keys`` (the W_V / W_K outputs, which the paper's text calls values), ``attn_out`` and ``mlp_out`` (what
each block's attention and MLP add to the residual stream), and for LIMe
``routed_values`` / ``routed_keys`` (the router's output, what the heads attend to; the official
analysis code records these for LIMe).

Names are imported on first use, so ``import lime_probe`` (and ``lime-probe --help``) stays cheap.
"""

import os
import signal
import sys
from importlib import import_module
from itertools import pairwise
from typing import TYPE_CHECKING


def _exit_interrupted(signum, frame) -> None:
    """Ctrl-C while the program is still importing, before ``cli.main`` takes over: nothing to clean up."""
    sys.stderr.write("lime-probe: interrupted\n")
    os._exit(130)


# Run as the program (the console script or ``python -m lime_probe.cli``), not imported by a library user.
if os.path.basename(sys.argv[0]) == "lime-probe" or ("-m", "lime_probe.cli") in pairwise(sys.orig_argv):
    signal.signal(signal.SIGINT, _exit_interrupted)

_EXPORTS = {
    "load": "extraction.loading",
    "wrap": "extraction.loading",
    "extract": "extraction.tracing",
    "Extraction": "extraction.settings",
    "Loading": "extraction.settings",
    "Activations": "extraction.activations",
    "Corpus": "extraction.tracing",
    "Adapter": "extraction.adapters",
    "register_adapter": "extraction.adapters",
    "matrix_entropy": "probes.entropy",
    "layer_entropy": "probes.entropy",
    "layer_entropies": "probes.entropy",
    "EntropyAccumulator": "probes.entropy",
    "stream_entropy": "probes.entropy",
    "EntropyConfig": "probes.entropy",
    "EntropyResult": "probes.entropy",
    "FeatureMoments": "probes.entropy",
    "PRESETS": "probes.entropy",
    "bootstrap_ci": "probes.stats",
    "summarize": "probes.stats",
    "token_separability": "probes.separability",
    "word_token_ids": "probes.separability",
    "word_rows": "probes.separability",
    "balance_classes": "probes.separability",
    "ProbeResult": "probes.separability",
    "load_blimp": "probes.blimp",
    "blimp_probe": "probes.blimp",
    "score_minimal_pairs": "probes.blimp",
    "sentence_logprobs": "probes.blimp",
    "BlimpScores": "probes.blimp",
    "tsne_embed": "probes.tsne",
    "tsne_layers": "probes.tsne",
    "router_weights": "probes.router_weights",
    "RouterAnalysis": "probes.router_weights",
    "linear_cka": "probes.similarity",
    "cka_matrix": "probes.similarity",
    "effective_rank": "probes.similarity",
    "effective_ranks": "probes.similarity",
    "intrinsic_dimension": "probes.collapse",
    "diff_erank": "probes.collapse",
    "curvature": "probes.collapse",
    "dataset_entropy": "probes.collapse",
    "lidar": "probes.collapse",
    "angular_distance": "probes.collapse",
    "layer_angular_distances": "probes.collapse",
    "logit_lens": "probes.logit_lens",
    "LensLayer": "probes.logit_lens",
    "lens_top_tokens": "probes.logit_lens",
    "Edit": "interventions.edits",
    "RouteEdit": "interventions.edits",
    "run_with_edits": "interventions.run",
    "EditedRun": "interventions.run",
    "Pair": "interventions.pairs",
    "load_pairs": "interventions.pairs",
    "activation_patching": "interventions.patching",
    "attribution_patching": "interventions.patching",
    "direct_logit_attribution": "interventions.logit_attribution",
    "route_ablation": "interventions.route_ablation",
    "generate_with_edits": "interventions.steering",
    "load_data": "specs.data",
    "run_report": "specs.reporting",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what `__getattr__` imports on first use, as type checkers and editors see it
    from lime_probe.extraction.activations import Activations
    from lime_probe.extraction.adapters import Adapter, register_adapter
    from lime_probe.extraction.loading import load, wrap
    from lime_probe.extraction.settings import Extraction, Loading
    from lime_probe.extraction.tracing import Corpus, extract
    from lime_probe.interventions.edits import Edit, RouteEdit
    from lime_probe.interventions.logit_attribution import direct_logit_attribution
    from lime_probe.interventions.pairs import Pair, load_pairs
    from lime_probe.interventions.patching import activation_patching, attribution_patching
    from lime_probe.interventions.route_ablation import route_ablation
    from lime_probe.interventions.run import EditedRun, run_with_edits
    from lime_probe.interventions.steering import generate_with_edits
    from lime_probe.probes.blimp import (
        BlimpScores,
        blimp_probe,
        load_blimp,
        score_minimal_pairs,
        sentence_logprobs,
    )
    from lime_probe.probes.collapse import (
        angular_distance,
        curvature,
        dataset_entropy,
        diff_erank,
        intrinsic_dimension,
        layer_angular_distances,
        lidar,
    )
    from lime_probe.probes.entropy import (
        PRESETS,
        EntropyAccumulator,
        EntropyConfig,
        EntropyResult,
        FeatureMoments,
        layer_entropies,
        layer_entropy,
        matrix_entropy,
        stream_entropy,
    )
    from lime_probe.probes.logit_lens import LensLayer, lens_top_tokens, logit_lens
    from lime_probe.probes.router_weights import RouterAnalysis, router_weights
    from lime_probe.probes.separability import (
        ProbeResult,
        balance_classes,
        token_separability,
        word_rows,
        word_token_ids,
    )
    from lime_probe.probes.similarity import cka_matrix, effective_rank, effective_ranks, linear_cka
    from lime_probe.probes.stats import bootstrap_ci, summarize
    from lime_probe.probes.tsne import tsne_embed, tsne_layers
    from lime_probe.specs.data import load_data
    from lime_probe.specs.reporting import run_report


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lime_probe' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
