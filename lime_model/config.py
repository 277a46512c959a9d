"""`LimeConfig`: a LLaMA config plus the routing variant."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from huggingface_hub.errors import StrictDataclassError
from transformers import LlamaConfig

from .routing import RoutingSpec, parse_routing

KV_PROJ_INITS = ("auto", "torch", "normal")
# The sizes a model is built from: each, when given, a count (>= 1); None leaves it to LlamaConfig (its
# default, or for num_key_value_heads and head_dim derived from the others).
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def check_sizes(fields: Mapping[str, Any], prefix: str = "") -> None:
    """ValueError naming the first of `SIZES` in ``fields`` that is given but no integer >= 1 (``prefix``
    goes before its name, e.g. "model." in a recipe): a 0-layer or negative-width model would build, and
    even train, with nothing in it."""
    for name in SIZES:
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{prefix}{name} must be an integer >= 1, got {value!r}")


class LimeConfig(LlamaConfig):
    """Configuration of a LIMe decoder; every LLaMA field keeps its meaning.

    Args:
        routing: routing variant (see ``lime_model.routing``); ``"none"`` is the LLaMA baseline.
        recompute_routed_kv: training memory option, results unchanged: attention does not keep the
            routed K/V for backward; they are recomputed there from the K/V buffer, which backward
            keeps anyway (static routers; dynamic ones ignore it). Saves two K/V-sized tensors per
            layer for one more routed read per layer in backward (docs/models.md, bench/RESULTS.md). In training
            mode it also turns the cache off, as transformers does under gradient checkpointing.
        kv_proj_init: init of the k/v projections. ``"auto"`` (default) as the official code
            (src/lm/lime.py): PyTorch's default ``nn.Linear`` init (uniform(+-1/sqrt(hidden))) when routing
            is on, LLaMA's normal(0, ``initializer_range``) for ``routing="none"``. ``"torch"`` or
            ``"normal"`` forces one for either model (the two inits differ ~3.6x in std at hidden 64).
            A reading: the paper's App. H LIMe attention keeps LLaMA's k/v projections (normal); the
            official default is kept because every committed study trained with it (docs/fidelity.md).
        **kwargs: any ``transformers.LlamaConfig`` field (``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ...).

    Attributes:
        routing_spec: ``routing`` parsed, whenever it is set (here, by ``from_pretrained``'s overrides
            or by hand): what the model, its routers and the FLOP count read (source sets per layer:
            ``RoutingSpec.sources``). Not saved: ``routing`` is.
    """

    model_type = "lime"
    if TYPE_CHECKING:  # None only before LlamaConfig.__post_init__ fills them in
        num_key_value_heads: int
        head_dim: int

    def __init__(
        self,
        routing: str | RoutingSpec = "full",
        recompute_routed_kv: bool = False,
        kv_proj_init: str = "auto",
        **kwargs,
    ) -> None:
        self.routing = routing  # parsed by __setattr__
        if not isinstance(recompute_routed_kv, bool):  # bool("false") would silently be True
            raise ValueError(f"recompute_routed_kv must be true or false, got {recompute_routed_kv!r}")
        self.recompute_routed_kv = recompute_routed_kv
        if kv_proj_init not in KV_PROJ_INITS:
            raise ValueError(f"kv_proj_init must be one of {', '.join(KV_PROJ_INITS)}, got {kv_proj_init!r}")
        self.kv_proj_init = kv_proj_init
        check_sizes(kwargs)  # before LlamaConfig divides by them
        try:
            super().__init__(**kwargs)
        except StrictDataclassError as e:  # transformers' own validation: the ValueError it wraps, one line
            raise ValueError(" ".join(str(e).split())) from None
        if self.attention_bias:
            raise ValueError("LIMe routes bias-free K/V projections; attention_bias=True is not supported")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if kv < 1 or heads % kv:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})"
            )

    def __setattr__(self, key: str, value: Any) -> None:
        # routing is parsed (and validated) here, wherever it is set, so routing_spec is always its parse
        if key == "routing_spec":
            raise AttributeError("routing_spec is the parsed routing: set routing instead")
        if key == "routing":
            spec = parse_routing(value)
            super().__setattr__("routing_spec", spec)
            value = str(spec)
        super().__setattr__(key, value)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        del out["routing_spec"]  # derived from routing
        return out

    @property
    def kv_proj_torch_init(self) -> bool:
        """Whether the k/v projections take PyTorch's default ``nn.Linear`` init (``kv_proj_init``)."""
        if self.kv_proj_init == "auto":
            return self.routing_spec.enabled
        return self.kv_proj_init == "torch"

    def cross_layer_flops(self, seq_len: int) -> int:
        """Forward FLOPs of a baseline's cross-layer mixing for one sequence (0 here: LIMe's routers
        are counted by their own classes)."""
        return 0


def no_routing(arch: str, routing: str | RoutingSpec) -> RoutingSpec:
    """``routing`` parsed if it is ``"none"``, the only routing a cross-layer baseline ``arch`` takes
    (ValueError for any other): baselines carry earlier layers forward their own way, on plain LLaMA
    attention."""
    spec = parse_routing(routing)
    if spec.enabled:
        raise ValueError(f"arch {arch!r} takes no LIMe routing (routing must be 'none', got {routing!r})")
    return spec
