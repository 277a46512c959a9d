"""Names shared by the extraction, the probes and the command line, kept free of heavy imports."""

import re
from typing import Any

# Representations `lime_probe.extract` can read: the residual stream ("hidden", the embeddings and
# each block's output), the last block's normalised output ("final"), the raw per-layer keys/values
# and, for LIMe, the routed keys/values the heads really attend to (for ResFormer, its mixed values),
# what each block's attention and MLP add to the residual stream ("attn_out", "mlp_out") and the
# attention weights of each head ("attn_pattern"). Any other module is read as ``module:PATH``.
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
    "attn_pattern",
)
# The sites that are heads concatenated, kv_heads * head_dim wide (`Activations.per_head`); the others are
# hidden_size wide, but for attn_pattern (query heads x key positions) and module sites (the module's width).
HEADED = ("keys", "values", "routed_keys", "routed_values", "mixed_values")

# Any module's output or input: ``module:PATH``, ``module:PATH:output`` (the same) or ``module:PATH:input``
# (its first positional argument). PATH is a dotted module path relative to the base model (``model.base_model``,
# as the adapters' paths) or to the root; ``{i}`` in it stands for a block's index, giving one entry per block.
MODULE = "module:"
MODULE_SYNTAX = (
    "module:PATH[:input|:output], PATH dotted, relative to the base model or the root, {i} = block index"
)
_PATH = re.compile(r"(?:\w+|\{i\})(?:\.(?:\w+|\{i\}))*")


def module_site(site: str) -> tuple[str, str] | None:
    """``(path, "input" | "output")`` of a ``module:`` site, None for any other name; ValueError in one line
    for a malformed one (checked without a model: what the path names is checked against the model)."""
    if not site.startswith(MODULE):
        return None
    path, _, what = site[len(MODULE) :].partition(":")
    what = what or "output"
    if what not in ("input", "output") or not _PATH.fullmatch(path) or path.count("{i}") > 1:
        raise ValueError(
            f"malformed site {site!r}: write {MODULE_SYNTAX}, e.g. module:layers.{{i}}.mlp.down_proj"
        )
    return path, what


def check_site(site: str) -> str:
    """`site` itself when it is a site name: one of `SITES` or a well-formed ``module:`` site; else ValueError
    in one line naming them (the command line's check before any model loads)."""
    if not isinstance(site, str) or (site not in SITES and module_site(site) is None):
        raise ValueError(f"unknown site {site!r}; sites are {', '.join(SITES)} or {MODULE_SYNTAX}")
    return site


def per_block(site: str) -> bool:
    """Whether `site` has an entry per block (or per residual-stream position) rather than one only:
    ``final`` and a ``module:`` site without ``{i}`` have one."""
    return site != "final" and not (site.startswith(MODULE) and "{i}" not in site)


# The paper's separability words (single tokens with their leading space).
DEFAULT_WORDS = (" is", " are", " was", " were")


def routes(model: Any) -> bool:
    """Whether ``model`` (a model, an nnsight wrapper of one, or its config) routes K/V across layers:
    a LIMe model whose parsed routing (``config.routing_spec``) has routers, so it has routed sites."""
    spec = getattr(getattr(model, "config", model), "routing_spec", None)
    return spec is not None and spec.enabled
