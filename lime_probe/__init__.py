"""Probes of representation collapse for LIMe, LLaMA and any Hugging Face checkpoint.

    import lime_probe
    model, tok = lime_probe.load("runs/lime")                 # a checkpoint dir or hub id
    acts = lime_probe.extract(model, tok, texts, sites=["values", "hidden"])   # texts: list of str
    Z = acts["values"][3]                                      # (n_tokens, dim), padding removed
    lime_probe.matrix_entropy(Z, alpha=1.0)                    # Z: (..., t, d) -> (...)

README.md's "Probes" section has the same example in full, runnable as written.

Sites: ``hidden`` (residual stream X_0..X_L), ``final`` (after the final norm), ``values`` and
``keys`` (the W_V / W_K outputs, which the paper's text calls values), and for LIMe
``routed_values`` / ``routed_keys`` (the router's output, what the heads attend to; the official
analysis code records these for LIMe).

Names are imported on first use, so ``import lime_probe`` (and ``lime-probe --help``) stays cheap.
"""

import os
import signal
import sys
from importlib import import_module
from itertools import pairwise


def _exit_interrupted(signum, frame) -> None:
    """Ctrl-C while the program is still importing, before ``cli.main`` takes over: nothing to clean up."""
    sys.stderr.write("lime-probe: interrupted\n")
    os._exit(130)


# Run as the program (the console script or ``python -m lime_probe.cli``), not imported by a library user.
if os.path.basename(sys.argv[0]) == "lime-probe" or ("-m", "lime_probe.cli") in pairwise(sys.orig_argv):
    signal.signal(signal.SIGINT, _exit_interrupted)

_EXPORTS = {
    "load": "loading",
    "wrap": "loading",
    "extract": "extraction",
    "Activations": "extraction",
    "Adapter": "adapters",
    "register_adapter": "adapters",
    "matrix_entropy": "entropy",
    "layer_entropy": "entropy",
    "layer_entropies": "entropy",
    "EntropyAccumulator": "entropy",
    "stream_entropy": "entropy",
    "EntropyConfig": "entropy",
    "EntropyResult": "entropy",
    "FeatureMoments": "entropy",
    "PRESETS": "entropy",
    "bootstrap_ci": "stats",
    "summarize": "stats",
    "token_separability": "separability",
    "word_token_ids": "separability",
    "word_rows": "separability",
    "balance_classes": "separability",
    "ProbeResult": "separability",
    "load_blimp": "blimp",
    "blimp_probe": "blimp",
    "score_minimal_pairs": "blimp",
    "sentence_logprobs": "blimp",
    "BlimpScores": "blimp",
    "tsne_embed": "tsne",
    "tsne_layers": "tsne",
    "router_weights": "router",
    "RouterAnalysis": "router",
    "linear_cka": "similarity",
    "cka_matrix": "similarity",
    "effective_rank": "similarity",
    "effective_ranks": "similarity",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lime_probe' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
