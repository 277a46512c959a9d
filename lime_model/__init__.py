"""LIMe (Layer-Integrated Memory) as a Hugging Face causal LM; ``routing="none"`` is the LLaMA baseline.

``import lime_model`` registers :class:`LimeConfig` (``model_type="lime"``) with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads LIMe checkpoints; importing the baseline modules
below registers theirs (``model_type`` "denseformer", "resformer"; :mod:`lime_model.architectures`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import (
    denseformer,  # noqa: F401  (registers the baseline with the Auto classes)
    resformer,  # noqa: F401
)
from .architectures import ARCHITECTURES, config_for
from .config import LimeConfig
from .flops import forward_flops
from .modeling import LimeForCausalLM, LimeModel, LimePreTrainedModel
from .optim import param_groups
from .routing import RoutingSpec, parse_routing

AutoConfig.register("lime", LimeConfig, exist_ok=True)
AutoModel.register(LimeConfig, LimeModel, exist_ok=True)
AutoModelForCausalLM.register(LimeConfig, LimeForCausalLM, exist_ok=True)

__all__ = [
    "ARCHITECTURES",
    "LimeConfig",
    "LimeForCausalLM",
    "LimeModel",
    "LimePreTrainedModel",
    "RoutingSpec",
    "config_for",
    "forward_flops",
    "param_groups",
    "parse_routing",
]
