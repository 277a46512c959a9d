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

A model without a registered adapter needs none for ``hidden`` (`adapter_for`): its blocks are the one
ModuleList of ``num_hidden_layers`` modules in its base model, and ``keys``/``values`` are offered where the
blocks use a common projection naming (`KV_PROJECTIONS`). ``final``, ``attn_out``/``mlp_out`` and
``attn_pattern`` are offered only where a two-token forward pass shows where they are (`verified_places`):
a site that cannot be placed with certainty is refused, never guessed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
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
    ``model_type``, else the one `discover_adapter` finds in its module tree (found once per model)."""
    hf = getattr(model, "_module", model)
    model_type = getattr(hf.config, "model_type", None)
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    if hf not in _DISCOVERED:
        _DISCOVERED[hf] = discover_adapter(hf)
    return _DISCOVERED[hf]


# The adapters found for models of unregistered types, each found by one forward pass.
_DISCOVERED: weakref.WeakKeyDictionary[torch.nn.Module, Adapter] = weakref.WeakKeyDictionary()


def _outermost(paths: list[str]) -> list[str]:
    """The paths of `paths` not inside another of them."""
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def discover_adapter(model: PreTrainedModel) -> Adapter:
    """An `Adapter` found in the module tree of `model`'s base model, for a model type without a registered one.

    Blocks: the one outermost ModuleList of ``config.num_hidden_layers`` modules (its inputs and outputs are
    the residual stream, as ``output_hidden_states`` returns it). ``keys``/``values``: the first pair of
    `KV_PROJECTIONS` present in every block. The sites whose place a name cannot make certain are offered only
    where one two-token forward pass (`verified_places`) shows them: ``final``, ``attn_out``/``mlp_out``
    (children named as in `ATTENTION_NAMES` and `MLP_NAMES`) and ``attn_pattern``; any other is refused in
    one line naming the model type. ValueError in one line where the blocks cannot be found.
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
    blocks = cast(torch.nn.ModuleList, base.get_submodule(layers))  # the ModuleList found above
    every = [{name for name, _ in block.named_modules()} for block in blocks]
    names = set.intersection(*every) if every else set()  # the names every block has
    kv = next(((k, v) for k, v in KV_PROJECTIONS if k in names and v in names), None)
    attn = next((a for a in ATTENTION_NAMES if a in names), None)
    mlp = next((m for m in MLP_NAMES if m in names), None)
    places = verified_places(model, layers, attn, mlp) if len(blocks) else {}
    sites = proj_sites(*kv) if kv else {}
    if attn and "attn_pattern" in places:
        sites["attn_pattern"] = (attn, attention_weights)
    if attn and mlp and "residual" in places:
        outputs = {"attn_out": (attn, first), "mlp_out": (mlp, first)}
        sites = {"mlp_out": outputs["mlp_out"]} | sites if places["residual"] == mlp else sites
        sites |= outputs
    final_norm = places.get("final")
    return Adapter(layers=layers, final_norm=final_norm, sites=sites, has_final="final" in places)


def _tensor(value: Any) -> Any:
    """The tensor a module gave or took: itself, the first of a tuple or the first field of a ModelOutput."""
    if isinstance(value, dict):  # a ModelOutput: its fields that are set, in order
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return value[0] if value else None
    return value


def _close(x: Any, y: Any) -> bool:
    """Whether `x` and `y` are equal float tensors up to the rounding of a few additions in their dtype."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape:
        return False
    if not x.is_floating_point() or x.dtype != y.dtype:
        return False
    scale = torch.maximum(x.abs().max(), y.abs().max()).float()
    return bool((x.float() - y.float()).abs().max() <= 8 * torch.finfo(x.dtype).eps * scale)


def _sum(seen: dict[str, Any], i: int) -> torch.Tensor | None:
    """Block `i`'s input plus its attention's and its MLP's outputs, as captured; None where one is missing."""
    x, a, m = (seen.get(f"{i}/{key}") for key in ("block/in", "attn/out", "mlp/out"))
    if isinstance(x, torch.Tensor) and isinstance(a, torch.Tensor) and isinstance(m, torch.Tensor):
        return x + a + m if x.shape == a.shape == m.shape else None
    return None


def _is_pattern(weights: Any, heads: int | None, causal: bool) -> bool:
    """Whether `weights` are the (1, heads, 2, 2) attention weights of a two-token pass: each row a softmax
    (summing to 1), and for a causal model none on the later key."""
    if not isinstance(weights, torch.Tensor) or weights.shape != (1, heads, 2, 2):
        return False
    sums = weights.float().sum(-1)
    return bool((sums - 1).abs().max() <= 8 * torch.finfo(weights.dtype).eps) and (
        not causal or not weights[..., 0, 1].any()
    )


def _sample_ids(model: Any) -> torch.Tensor | None:
    """Two token ids (1, 2) on the device the input embedding runs on, avoiding the pad token (whose
    embedding may be zero); None for a model holding no weights (built on ``meta``)."""
    embedding = model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    device = getattr(getattr(embedding, "_hf_hook", None), "execution_device", None)
    device = torch.device(device) if device is not None else getattr(weight, "device", None)
    if weight is None or device is None or device.type == "meta":
        return None
    pad = getattr(model.config, "pad_token_id", None)
    ids = [t for t in range(weight.shape[0] // 3, weight.shape[0]) if t != pad][:2]
    return torch.tensor([ids], device=device) if len(ids) == 2 else None


def _capture(model: Any, modules: dict[str, torch.nn.Module], ids: torch.Tensor) -> dict[str, Any]:
    """One forward pass of `ids` with plain hooks: per name in `modules`, its first call's first input
    (``name/in``) and output (``name/out``), copied when taken (a block may change them in place later), and
    for names ending in ``/attn`` their second output (``name/weights``). Empty where the pass fails: then
    nothing can be verified."""
    seen: dict[str, Any] = {}

    def keep(key: str, value: Any) -> None:
        value = _tensor(value)
        if key not in seen:
            seen[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value

    handles = []
    for name, module in modules.items():
        handles.append(
            module.register_forward_pre_hook(
                lambda m, args, kwargs, name=name: keep(
                    f"{name}/in",
                    args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None)),
                ),
                with_kwargs=True,
            )
        )
        handles.append(module.register_forward_hook(lambda m, a, out, name=name: keep(f"{name}/out", out)))
        if name.endswith("/attn"):
            handles.append(
                module.register_forward_hook(
                    lambda m, a, out, name=name: keep(
                        f"{name}/weights", out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else None
                    )
                )
            )
    try:
        with torch.inference_mode():
            model(input_ids=ids)
    except Exception:  # noqa: BLE001  a model this pass cannot run has nothing verified, whatever the error
        seen = {}
    finally:
        for handle in handles:
            handle.remove()
    return seen


@contextlib.contextmanager
def _eager(model: Any) -> Iterator[None]:
    """`model` running eager attention (the one that returns the attention weights) inside the block, where
    it can be switched; its own implementation restored after."""
    own = getattr(model.config, "_attn_implementation", None) or "eager"
    switched = False
    if own != "eager" and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("eager")
            switched = True
        except Exception:  # noqa: BLE001  a model that cannot switch keeps its own (no weights verified)
            pass
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(own)


def verified_places(model: Any, layers: str, attn: str | None, mlp: str | None) -> dict[str, str | None]:
    """What one two-token forward pass of `model` (in eval mode, eager attention) shows of its sites, given
    its blocks (`layers`, relative to the base model) and each block's attention and MLP children named `attn`,
    `mlp` (a module called twice counts by its first call, the one a trace reads):

    - ``final`` -> the final norm's path (None: the last block's output is the model's final one), present
      where exactly one module outside the blocks maps the last block's output to the base model's output
      (for a causal LM also what its head reads), or the last block's output is it;
    - ``residual`` -> the one of `attn`, `mlp` that runs first, present where every block's output is its input
      plus its attention's and its MLP's outputs (a sequential or parallel residual block whose attention and
      MLP do not add the residual themselves, as BLOOM's do);
    - ``attn_pattern``, present where every block's attention gives (batch, heads, query, key) weights, each
      row summing to 1 (causal: none above the diagonal), through transformers' attention interface (which
      `lime_probe.extract` switches to eager attention).
    """
    base = model.base_model
    blocks = cast(torch.nn.ModuleList, base.get_submodule(layers))
    ids = _sample_ids(model)
    if ids is None:
        return {}
    inside = {name for name, _ in base.named_modules() if name == layers or name.startswith(layers + ".")}
    outside = {
        name: m
        for name, m in base.named_modules()
        if name and name not in inside and not layers.startswith(name + ".")
    }
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = {f"out/{name}": m for name, m in outside.items()} | {"base": base}
    modules |= {"head": head} if isinstance(head, torch.nn.Module) and not is_encoder(model.config) else {}
    for i, block in enumerate(blocks):
        modules[f"{i}/block"] = block
        modules |= {f"{i}/attn": block.get_submodule(attn)} if attn else {}
        modules |= {f"{i}/mlp": block.get_submodule(mlp)} if mlp else {}
    training = model.training
    model.eval()
    try:
        with _eager(model):
            seen = _capture(model, modules, ids)
    finally:
        model.train(training)
    if not seen:
        return {}
    places: dict[str, str | None] = {}
    # the model's final representation: its base model's output, else (a head calling the blocks' parent
    # directly, as OPT's) what its head reads
    last, final = seen.get(f"{len(blocks) - 1}/block/out"), seen.get("base/out", seen.get("head/in"))
    norms = _outermost(
        [
            name
            for name in outside
            if _close(last, seen.get(f"out/{name}/in")) and _close(final, seen.get(f"out/{name}/out"))
        ]
    )
    if "head/in" not in seen or _close(final, seen["head/in"]):  # else the head reads something else
        if len(norms) == 1:
            places["final"] = norms[0]
        elif not norms and _close(last, final):
            places["final"] = None
    if attn and mlp and all(_close(seen.get(f"{i}/block/out"), _sum(seen, i)) for i in range(len(blocks))):
        # the module a block runs first (a trace reads its sites in execution order)
        places["residual"] = mlp if list(seen).index("0/mlp/out") < list(seen).index("0/attn/out") else attn
    try:
        heads = getattr(model.config, "num_attention_heads", None)
    except Exception:  # noqa: BLE001  a per-layer head count (heterogeneous configs) places no pattern
        heads = None
    causal = not is_encoder(model.config)
    if (
        getattr(model, "_supports_attention_backend", False)
        and attn
        and all(_is_pattern(seen.get(f"{i}/attn/weights"), heads, causal) for i in range(len(blocks)))
    ):
        places["attn_pattern"] = attn
    return places


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
