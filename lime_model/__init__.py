"""LIMe (Layer-Integrated Memory) as a Hugging Face causal LM; ``routing="none"`` is the LLaMA baseline.

``import lime_model`` registers every model type with the Auto classes (``modeling.register_auto``), so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads LIMe checkpoints (``model_type="lime"``) and the
baselines' ("denseformer", "resformer", "hyperconnections"; :mod:`lime_model.architectures`).

The ``lime-model`` program itself (its console script, or ``python -m lime_model.cli``) skips that
import, so its ``--help`` and usage errors take no time: its commands register the model types after
parsing (:func:`lime_model.cli.main`). The names below are imported on first use either way.
"""

import os
import signal
import sys
from importlib import import_module
from itertools import pairwise

_EXPORTS = {
    "ARCHITECTURES": "architectures",
    "config_for": "architectures",
    "LimeConfig": "config",
    "DenseFormerConfig": "denseformer",
    "DenseFormerForCausalLM": "denseformer",
    "DenseFormerModel": "denseformer",
    "forward_flops": "flops",
    "HyperConnectionsConfig": "hyperconnections",
    "HyperConnectionsForCausalLM": "hyperconnections",
    "HyperConnectionsModel": "hyperconnections",
    "LimeForCausalLM": "modeling",
    "LimeModel": "modeling",
    "LimePreTrainedModel": "modeling",
    "param_groups": "optim",
    "ResFormerConfig": "resformer",
    "ResFormerForCausalLM": "resformer",
    "ResFormerModel": "resformer",
    "RoutingSpec": "routing",
    "parse_routing": "routing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lime_model' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def register_models() -> None:
    """Register every architecture with the Auto classes (importing them does it; see the module doc)."""
    import_module(".architectures", __name__)


def _exit_interrupted(signum, frame) -> None:
    """Ctrl-C while the program is still importing, before ``cli.main`` takes over: nothing to clean up."""
    sys.stderr.write("lime-model: interrupted\n")
    os._exit(130)


if os.path.basename(sys.argv[0]) == "lime-model" or ("-m", "lime_model.cli") in pairwise(sys.orig_argv):
    signal.signal(signal.SIGINT, _exit_interrupted)
else:  # a library user: ``import lime_model`` makes the Auto classes load our checkpoints
    register_models()
