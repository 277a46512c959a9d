"""Where each extraction site lives in each architecture: a small registry keyed by `config.model_type`.

Sites (see `lime_probe.extract` for shapes and layer indexing):

- ``hidden``: the residual stream. X_0 is the input of the first block (the embeddings, after any
  scaling, position embeddings or embedding norm the model applies), X_l the output of block l.
- ``final``: the output of the final norm (for encoders without one: the last block's output).
- ``keys`` / ``values``: the W_K / W_V projections of each block, heads concatenated, before RoPE.
  The LIMe paper's text calls the W_V output "values".
- ``routed_keys`` / ``routed_values`` (LIMe only): the output of ``self_attn.router``, i.e. the
  mixtures of earlier layers' keys/values that the heads really attend to. The official LIMe
  analysis code records these (not the raw W_V output) as "values" for LIMe models.
- ``mixed_values`` (ResFormer only): the values its heads attend over (``self_attn.value_mix`` output).
- ``attn_out`` / ``mlp_out``: the output of each block's attention / MLP module, what it adds to the residual
  stream (before the residual add, and before any norm the block applies to it, as Gemma 2's).
- ``attn_pattern``: the attention weights each head's softmax gives, the second output of each block's
  attention module (transformers returns them from eager attention only; `lime_probe.extract` switches to it).
  For LIMe they are the weights over the routed keys, what its heads really use.

For DenseFormer the block outputs, hence ``hidden``, are the DWA outputs Y_l (the stream each block reads).

Registering a new architecture is a few lines, e.g. for a LLaMA-like model::

    from lime_probe.extraction.adapters import Adapter, register_adapter, proj_sites
    register_adapter("my_llama", Adapter(layers="layers", final_norm="norm",
                                         sites=proj_sites("self_attn.k_proj", "self_attn.v_proj")))

Module paths are relative to the base model (``model.base_model``, e.g. ``LlamaModel`` inside
``LlamaForCausalLM``), so they work for the bare model and for any head on top of it.

A model without a registered adapter needs none for ``hidden`` and ``final`` (`adapter_for`): its blocks are
the one ModuleList of ``num_hidden_layers`` modules in its base model, its final norm the module named as
transformers names them (`FINAL_NORM_NAMES`), and ``keys``/``values`` are offered where the blocks use a
common projection naming (`KV_PROJECTIONS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from lime_probe.extraction.sites import routes

# A site's reader: the output of its module -> (batch, seq, dim).
Take = Callable[[Any], torch.Tensor]


def first(output: Any) -> torch.Tensor:
    """The tensor of a module output that may be a tuple (older blocks return (hidden, ...))."""
    return output[0] if isinstance(output, (tuple, list)) else output


def fused_slice(part: int, q_heads: int = 1, kv_heads: int = 1) -> Take:
    """Reader for a fused projection laid out [q | k | v] along its last dim, q `q_heads` heads wide and k, v
    `kv_heads` each (GPT-2's ``c_attn``: equal thirds; Phi-3's ``qkv_proj``: query and key/value heads):
    part 0, 1 or 2 of the output (batch, seq, (q_heads + 2 * kv_heads) * head_dim)."""

    def take(output: Any) -> torch.Tensor:
        out = first(output)
        hd = out.shape[-1] // (q_heads + 2 * kv_heads)
        start = 0 if part == 0 else (q_heads + (part - 1) * kv_heads) * hd
        return out[..., start : start + (q_heads if part == 0 else kv_heads) * hd]

    return take


def interleaved_slice(part: int, n_heads: int) -> Take:
    """Reader for GPT-NeoX's fused ``query_key_value`` output (batch, seq, heads*3*head_dim).

    Its layout is per head: [q_h | k_h | v_h] for h = 0..heads-1, so the keys of head h are
    columns h*3*hd + hd .. h*3*hd + 2*hd. Returns (batch, seq, heads*head_dim), heads concatenated.
    """

    def take(output: Any) -> torch.Tensor:
        out = first(output)
        per_head = out.unflatten(-1, (n_heads, 3, -1))  # (batch, seq, heads, 3, head_dim)
        return per_head[..., part, :].flatten(-2)

    return take


def routed(part: int) -> Take:
    """Reader for LIMe's router output ``(keys, values)``, each (batch, kv_heads, seq, head_dim)."""

    def take(output: Any) -> torch.Tensor:
        return output[part].transpose(1, 2).flatten(-2)

    return take


def attention_weights(output: Any) -> torch.Tensor:
    """Reader for an attention module's ``(output, weights)``: the weights (batch, heads, query, key), each
    row a softmax over the keys. ValueError where the module returned none (it did not run eager attention)."""
    if not isinstance(output, (tuple, list)) or len(output) < 2 or output[1] is None:
        raise ValueError(
            "the attention module returned no attention weights: load the model with attn_implementation='eager'"
        )
    return output[1]


def proj_sites(keys: str, values: str) -> dict[str, tuple[str, Take]]:
    """``keys``/``values`` sites read from two separate projection modules (paths inside a block)."""
    return {"keys": (keys, first), "values": (values, first)}


def block_outputs(attn: str, mlp: str, weights: str | None = None) -> dict[str, tuple[str, Take]]:
    """``attn_pattern``/``attn_out``/``mlp_out`` sites read from a block's attention and MLP modules (paths inside a
    block; `weights`: the module returning the attention weights, default `attn`); they come after the attention's
    own sites in execution order."""
    return {
        "attn_pattern": (weights or attn, attention_weights),
        "attn_out": (attn, first),
        "mlp_out": (mlp, first),
    }


# The LLaMA layout's per-block sites: separate projections inside ``self_attn``, then ``mlp``.
LLAMA_SITES = proj_sites("self_attn.k_proj", "self_attn.v_proj") | block_outputs("self_attn", "mlp")


@dataclass(frozen=True)
class Adapter:
    """How to find the sites of one architecture.

    layers: path of the ModuleList of blocks, relative to the base model.
    final_norm: path of the final norm, or None where the model has none (then ``final`` is the
        last block's output).
    sites: per-block site name -> (module path inside a block, reader), or a function of the config
        returning that dict (for readers that need e.g. the head count). Listed in execution order.
    has_final: whether the model offers ``final`` (False: a discovered causal LM whose final norm was not
        found, whose last block's output is not what its head reads).
    """

    layers: str
    final_norm: str | None
    sites: dict[str, tuple[str, Take]] | Callable[[Any], dict[str, tuple[str, Take]]] = field(
        default_factory=dict
    )
    has_final: bool = True

    def block_sites(self, config: Any) -> dict[str, tuple[str, Take]]:
        """The per-block sites for this `config`, in execution order."""
        return self.sites(config) if callable(self.sites) else self.sites


ADAPTERS: dict[str, Adapter] = {}


def register_adapter(model_types: str | list[str], adapter: Adapter) -> None:
    """Register `adapter` for one or more `config.model_type` values (replacing any earlier one)."""
    for model_type in [model_types] if isinstance(model_types, str) else model_types:
        ADAPTERS[model_type] = adapter


def get_adapter(config: Any) -> Adapter:
    """The adapter for `config.model_type`; ValueError naming the supported types if there is none."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"no extraction adapter for model_type {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}. "
            "Register one with lime_probe.extraction.adapters.register_adapter(model_type, Adapter(...))"
        )
    return ADAPTERS[model_type]


# The final norm's name in the base models transformers ships: LLaMA family and most recent ones, GPT-2/GPT-J/
# Falcon/BLOOM, Phi, GPT-NeoX/OPT, Mamba.
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
# (W_K, W_V) paths inside a block of the common layouts with separate projections: LLaMA family, Phi, OPT,
# Mistral (self_attn); GPT-J, GPT-Neo (attn). Fused projections are laid out differently per architecture (GPT-2's
# c_attn [q | k | v], GPT-NeoX's query_key_value per head, Phi-3's qkv_proj, Falcon's grouped): they are read
# through registered adapters only, never guessed at, so an unregistered fused model has no keys/values sites.
KV_PROJECTIONS = (
    ("self_attn.k_proj", "self_attn.v_proj"),
    ("attn.k_proj", "attn.v_proj"),
    ("attn.attention.k_proj", "attn.attention.v_proj"),
    ("attention.k_proj", "attention.v_proj"),
)
# A block's attention and MLP modules as transformers names them (``attn_out``/``mlp_out`` where both exist).
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")


def is_encoder(config: Any) -> bool:
    """Whether `config` is a BERT-style encoder: a masked-LM architecture not configured as a decoder.

    Its attention is bidirectional, so it has no next-token head to score text with; the probes read
    only its representations, and `load` gives it as the bare base model.
    """
    import transformers as tf

    return type(config) in tf.MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)


def adapter_for(model: Any) -> Adapter:
    """The adapter of `model` (a Hugging Face model or an nnsight wrapper of one): the one registered for its
    ``model_type``, else the one `discover_adapter` finds in its module tree."""
    hf = getattr(model, "_module", model)
    model_type = getattr(hf.config, "model_type", None)
    return ADAPTERS[model_type] if model_type in ADAPTERS else discover_adapter(hf)


def _outermost(paths: list[str]) -> list[str]:
    """The paths of `paths` not inside another of them."""
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def discover_adapter(model: PreTrainedModel) -> Adapter:
    """An `Adapter` found in the module tree of `model`'s base model, for a model type without a registered one.

    Blocks: the one outermost ModuleList of ``config.num_hidden_layers`` modules (its inputs and outputs are
    the residual stream, as ``output_hidden_states`` returns it). Final norm: the one module outside the
    blocks named as in `FINAL_NORM_NAMES`; an encoder without one has ``final`` = the last block's output
    (as BERT), a causal LM without one no ``final``. ``keys``/``values``: the first pair of `KV_PROJECTIONS`
    present in the first block; ``attn_out``/``mlp_out``: its children named as in `ATTENTION_NAMES` and
    `MLP_NAMES`. ValueError in one line where the blocks cannot be found.
    """
    base, config = model.base_model, model.config
    n = getattr(config, "num_hidden_layers", None)
    lists = _outermost(
        [name for name, m in base.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    )
    if not isinstance(n, int) or len(lists) != 1:
        raise ValueError(
            f"no extraction adapter for model_type {getattr(config, 'model_type', None)!r}, and its blocks "
            f"are not one ModuleList of num_hidden_layers={n} modules (found: {lists or 'none'}); register "
            "one with lime_probe.extraction.adapters.register_adapter(model_type, Adapter(...))"
        )
    layers = lists[0]
    norms = [
        name
        for name, _ in base.named_modules()
        if name.rpartition(".")[2] in FINAL_NORM_NAMES and not name.startswith(layers + ".")
    ]
    final_norm = norms[0] if len(norms) == 1 else None
    block = cast(torch.nn.ModuleList, base.get_submodule(layers))[0]  # the ModuleList found above
    names = {name for name, _ in block.named_modules()}
    kv = next(((k, v) for k, v in KV_PROJECTIONS if k in names and v in names), None)
    attn = next((a for a in ATTENTION_NAMES if a in names), None)
    mlp = next((m for m in MLP_NAMES if m in names), None)
    return Adapter(
        layers=layers,
        final_norm=final_norm,
        sites=(proj_sites(*kv) if kv else {}) | (block_outputs(attn, mlp) if attn and mlp else {}),
        has_final=final_norm is not None or is_encoder(config),
    )


def head_shape(config: Any) -> tuple[int, int]:
    """(key/value heads, head_dim) of `config`: the per-head view of the keys/values sites."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def _lime_sites(config: Any) -> dict[str, tuple[str, Take]]:
    sites = proj_sites("self_attn.k_proj", "self_attn.v_proj")
    if routes(config):
        sites |= {
            "routed_keys": ("self_attn.router", routed(0)),
            "routed_values": ("self_attn.router", routed(1)),
        }
    return sites | block_outputs("self_attn", "mlp")


def _neox_sites(config: Any) -> dict[str, tuple[str, Take]]:
    qkv = "attention.query_key_value"
    heads = config.num_attention_heads
    return {
        "keys": (qkv, interleaved_slice(1, heads)),
        "values": (qkv, interleaved_slice(2, heads)),
    } | block_outputs("attention", "mlp")


LLAMA_FAMILY = [
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "olmo",
    "olmo2",
    "granite",
    "cohere",
    "starcoder2",
    "smollm3",
]

register_adapter("lime", Adapter(layers="layers", final_norm="norm", sites=_lime_sites))
register_adapter(LLAMA_FAMILY, Adapter(layers="layers", final_norm="norm", sites=LLAMA_SITES))
register_adapter(
    "gpt2",
    Adapter(
        layers="h",
        final_norm="ln_f",
        sites={"keys": ("attn.c_attn", fused_slice(1)), "values": ("attn.c_attn", fused_slice(2))}
        | block_outputs("attn", "mlp"),
    ),
)
# Phi-3 fuses its projections into ``qkv_proj`` [q | k | v] (query heads, then key/value heads)
register_adapter(
    "phi3",
    Adapter(
        layers="layers",
        final_norm="norm",
        sites=lambda config: (
            {
                part: (
                    "self_attn.qkv_proj",
                    fused_slice(k, config.num_attention_heads, head_shape(config)[0]),
                )
                for k, part in ((1, "keys"), (2, "values"))
            }
            | block_outputs("self_attn", "mlp")
        ),
    ),
)
register_adapter("gpt_neox", Adapter(layers="layers", final_norm="final_layer_norm", sites=_neox_sites))
register_adapter(
    ["bert", "roberta", "xlm-roberta", "camembert"],
    Adapter(
        layers="encoder.layer",
        final_norm=None,
        # BERT's attention and MLP modules add the residual and normalise: their dense layers are what they add
        sites=proj_sites("attention.self.key", "attention.self.value")
        | block_outputs("attention.output.dense", "output.dense", weights="attention.self"),
    ),
)

# ---- cross-layer baselines (lime_model.denseformer, lime_model.resformer) ----
# DenseFormer: a block's output is its DWA's Y_i, the stream the next block reads, so ``hidden`` is Y.
register_adapter("denseformer", Adapter(layers="layers", final_norm="norm", sites=LLAMA_SITES))
# ResFormer: ``values`` are the layer's own W_V output V_n; ``mixed_values`` the V'_n its heads attend over
# (lambda_1 V_1 + lambda_2 V_n; V_1 itself in the first layer).
register_adapter(
    "resformer",
    Adapter(
        layers="layers",
        final_norm="norm",
        sites={
            **proj_sites("self_attn.k_proj", "self_attn.v_proj"),
            "mixed_values": ("self_attn.value_mix", first),
            **block_outputs("self_attn", "mlp"),
        },
    ),
)

# --- HyperConnections (lime_model.hyperconnections) -------------------------------------------------
# Each block returns (sum of its n residual streams, streams): ``hidden`` X_l (l >= 1) is that sum, the
# input of the final norm for l = L; X_0 is the embeddings before their replication into n streams (so
# X_0 has 1/n of the scale of the streams' sum at init). Keys/values are the W_K/W_V projections.
register_adapter("hyperconnections", Adapter(layers="layers", final_norm="norm", sites=LLAMA_SITES))
