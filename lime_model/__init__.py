"""LIMe (Layer-Integrated Memory) as a Hugging Face causal LM; ``routing="none"`` is the LLaMA baseline.

``import lime_model`` registers every model type with the Auto classes (``modeling.register_auto``), so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads LIMe checkpoints (``model_type="lime"``) and the
baselines' ("denseformer", "resformer", "hyperconnections"; :mod:`lime_model.architectures`).
"""

from .architectures import ARCHITECTURES, config_for
from .config import LimeConfig
from .denseformer import DenseFormerConfig, DenseFormerForCausalLM, DenseFormerModel
from .flops import forward_flops
from .hyperconnections import HyperConnectionsConfig, HyperConnectionsForCausalLM, HyperConnectionsModel
from .modeling import LimeForCausalLM, LimeModel, LimePreTrainedModel
from .optim import param_groups
from .resformer import ResFormerConfig, ResFormerForCausalLM, ResFormerModel
from .routing import RoutingSpec, parse_routing

__all__ = [
    "ARCHITECTURES",
    "DenseFormerConfig",
    "DenseFormerForCausalLM",
    "DenseFormerModel",
    "HyperConnectionsConfig",
    "HyperConnectionsForCausalLM",
    "HyperConnectionsModel",
    "LimeConfig",
    "LimeForCausalLM",
    "LimeModel",
    "LimePreTrainedModel",
    "ResFormerConfig",
    "ResFormerForCausalLM",
    "ResFormerModel",
    "RoutingSpec",
    "config_for",
    "forward_flops",
    "param_groups",
    "parse_routing",
]
