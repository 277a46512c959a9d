"""LIMe (Layer-Integrated Memory) as a Hugging Face causal LM; ``routing="none"`` is the LLaMA baseline.

``import lime_model`` registers :class:`LimeConfig` (``model_type="lime"``) with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads LIMe checkpoints; importing the baseline modules
below registers theirs (``model_type`` "denseformer", "resformer"; :mod:`lime_model.architectures`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .architectures import ARCHITECTURES, config_for
from .config import LimeConfig
from .denseformer import DenseFormerConfig, DenseFormerForCausalLM, DenseFormerModel
from .flops import forward_flops
from .hyperconnections import HyperConnectionsConfig, HyperConnectionsForCausalLM, HyperConnectionsModel
from .modeling import LimeForCausalLM, LimeModel, LimePreTrainedModel
from .optim import param_groups
from .resformer import ResFormerConfig, ResFormerForCausalLM, ResFormerModel
from .routing import RoutingSpec, parse_routing

AutoConfig.register("lime", LimeConfig, exist_ok=True)
AutoModel.register(LimeConfig, LimeModel, exist_ok=True)
AutoModelForCausalLM.register(LimeConfig, LimeForCausalLM, exist_ok=True)

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
