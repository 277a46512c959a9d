"""`LimeConfig`: a LLaMA config plus the routing variant."""

from __future__ import annotations

from transformers import LlamaConfig

from .routing import RoutingSpec, parse_routing


class LimeConfig(LlamaConfig):
    """Configuration of a LIMe decoder; every LLaMA field keeps its meaning.

    Args:
        routing: routing variant (see :mod:`lime_model.routing`); ``"none"`` is the LLaMA baseline.
        recompute_routed_kv: training memory option, results unchanged: attention does not keep the
            routed K/V for backward; they are recomputed there from the K/V buffer, which backward
            keeps anyway (static routers; dynamic ones ignore it). Saves two K/V-sized tensors per
            layer for one more routed read per layer in backward (README, Performance). In training
            mode it also turns the cache off, as transformers does under gradient checkpointing.
        **kwargs: any :class:`transformers.LlamaConfig` field (``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ...).
    """

    model_type = "lime"

    def __init__(self, routing: str = "full", recompute_routed_kv: bool = False, **kwargs) -> None:
        self.routing = str(parse_routing(routing))
        if not isinstance(recompute_routed_kv, bool):  # bool("false") would silently be True
            raise ValueError(f"recompute_routed_kv must be true or false, got {recompute_routed_kv!r}")
        self.recompute_routed_kv = recompute_routed_kv
        super().__init__(**kwargs)
        if self.attention_bias:
            raise ValueError("LIMe routes bias-free K/V projections; attention_bias=True is not supported")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if kv < 1 or heads % kv:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})"
            )

    @property
    def routing_spec(self) -> RoutingSpec:
        """The parsed ``routing`` string (source sets per layer: :meth:`RoutingSpec.sources`)."""
        return parse_routing(self.routing)

    def cross_layer_flops(self, seq_len: int) -> int:
        """Forward FLOPs of a baseline's cross-layer mixing for one sequence (0 here: LIMe's routers
        are counted by their own classes)."""
        return 0


def no_routing(arch: str, routing: str) -> str:
    """``"none"``, the only routing a cross-layer baseline ``arch`` takes (ValueError for any other):
    baselines carry earlier layers forward their own way, on plain LLaMA attention."""
    if parse_routing(routing).enabled:
        raise ValueError(f"arch {arch!r} takes no LIMe routing (routing must be 'none', got {routing!r})")
    return "none"
