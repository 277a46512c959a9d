"""Names shared by the extraction, the probes and the command line, kept free of heavy imports."""

from typing import Any

# Representations `lime_probe.extract` can read: the residual stream ("hidden", the embeddings and
# each block's output), the last block's normalised output ("final"), the raw per-layer keys/values
# and, for LIMe, the routed keys/values the heads really attend to (for ResFormer, its mixed values),
# and what each block's attention and MLP add to the residual stream ("attn_out", "mlp_out").
SITES = (
    "hidden",
    "final",
    "keys",
    "values",
    "routed_keys",
    "routed_values",
    "mixed_values",
    "attn_out",
    "mlp_out",
)
# The sites that are heads concatenated, kv_heads * head_dim wide (`Activations.per_head`); the others are
# hidden_size wide.
HEADED = ("keys", "values", "routed_keys", "routed_values", "mixed_values")

# The paper's separability words (single tokens with their leading space).
DEFAULT_WORDS = (" is", " are", " was", " were")


def routes(model: Any) -> bool:
    """Whether ``model`` (a model, an nnsight wrapper of one, or its config) routes K/V across layers:
    a LIMe model whose parsed routing (``config.routing_spec``) has routers, so it has routed sites."""
    spec = getattr(getattr(model, "config", model), "routing_spec", None)
    return spec is not None and spec.enabled
