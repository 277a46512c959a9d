"""LIMe (Layer-Integrated Memory) as a Hugging Face causal LM; ``routing="none"`` is the LLaMA baseline.

``import lime_model`` registers :class:`LimeConfig` (``model_type="lime"``) with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads LIMe checkpoints.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import LimeConfig
from .flops import forward_flops
from .hyperconnections import HyperConnectionsConfig, HyperConnectionsForCausalLM, HyperConnectionsModel
from .modeling import LimeForCausalLM, LimeModel, LimePreTrainedModel
from .optim import param_groups
from .routing import RoutingSpec, parse_routing

AutoConfig.register("lime", LimeConfig, exist_ok=True)
AutoModel.register(LimeConfig, LimeModel, exist_ok=True)
AutoModelForCausalLM.register(LimeConfig, LimeForCausalLM, exist_ok=True)

__all__ = [
    "HyperConnectionsConfig",
    "HyperConnectionsForCausalLM",
    "HyperConnectionsModel",
    "LimeConfig",
    "LimeForCausalLM",
    "LimeModel",
    "LimePreTrainedModel",
    "RoutingSpec",
    "forward_flops",
    "param_groups",
    "parse_routing",
]
