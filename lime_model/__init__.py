"""LIMe (Layer-Integrated Memory) as a Hugging Face causal LM; ``routing="none"`` is the LLaMA baseline.

``import lime_model`` registers every model type with the Auto classes (``modeling.register_auto``), so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads LIMe checkpoints (``model_type="lime"``) and the
baselines' ("denseformer", "resformer", "hyperconnections"; ``lime_model.architectures``).

The two programs, ``lime-model`` and ``lime-probe`` (console scripts, or ``python -m lime_model.cli`` /
``lime_probe.cli``), skip that import, so their ``--help`` and usage errors take no time: their commands
register the model types after parsing (``lime_model.cli.main``, ``lime_probe.extraction.loading.load``). The names below are imported on first use either way.
"""

import os
import signal
import sys
from importlib import import_module
from itertools import pairwise
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # what `__getattr__` imports on first use, as type checkers and editors see it
    from lime_model.architectures import ARCHITECTURES, config_for
    from lime_model.config import LimeConfig
    from lime_model.denseformer import DenseFormerConfig, DenseFormerForCausalLM, DenseFormerModel
    from lime_model.flops import forward_flops
    from lime_model.hyperconnections import (
        HyperConnectionsConfig,
        HyperConnectionsForCausalLM,
        HyperConnectionsModel,
    )
    from lime_model.modeling import LimeForCausalLM, LimeModel, LimePreTrainedModel
    from lime_model.optim import param_groups
    from lime_model.resformer import ResFormerConfig, ResFormerForCausalLM, ResFormerModel
    from lime_model.routing import RoutingSpec, parse_routing


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


# The program running, if it is one of the two (console script or ``python -m ...cli``): each registers the
# model types after parsing, so that ``lime-probe``, which imports this package's light checks, stays quick too.
_PROGRAM = next(
    (
        name
        for name, module in (("lime-model", "lime_model.cli"), ("lime-probe", "lime_probe.cli"))
        if os.path.basename(sys.argv[0]) == name or ("-m", module) in pairwise(sys.orig_argv)
    ),
    None,
)
if _PROGRAM == "lime-model":  # lime-probe installs its own handler (lime_probe/__init__.py)
    signal.signal(signal.SIGINT, _exit_interrupted)
elif _PROGRAM is None:  # a library user: ``import lime_model`` makes the Auto classes load our checkpoints
    if os.environ.get("LIME_REPRODUCIBLE") == "1":  # the mode must pin torch's libraries before they load
        import_module(".reproducible", __name__).enable()
    register_models()
