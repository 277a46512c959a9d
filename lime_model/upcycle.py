"""Upcycling: a pretrained LLaMA-style causal LM as a LIMe whose routers start at self-only routing.

Every parameter of a LLaMA-style checkpoint has its LIMe name (``lime_model.modeling``), so the
conversion copies the weights by name, adds each layer's router at self-only routing (every head reads
its own layer's head unchanged: ``lime_model.router.LimeRouter.reset_self_only``) and copies the
tokenizer. The result computes the source's logits exactly at step 0, whatever the routing; training it
(``lime-model train --init DIR``) moves the routers from there. ``train --init`` of a routed recipe from a
LLaMA of this project (routing none) upcycles the same way in memory (``load_init``).

What converts: ``llama`` (no attention biases), ``mistral`` without a sliding window (then it is LLaMA),
and this project's own LLaMA runs (``lime`` with routing ``none``). Everything else is refused in one
line naming the feature LIMe cannot represent: Qwen2's q/k/v biases, Mistral's sliding window, LLaMA's
``attention_bias``, another model type. ``config.json`` records the source under ``upcycled_from`` (ours).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .checks import check_model_dir, is_hub_id, quiet_library, read_config, weight_files
from .files import atomic_dir, check_writable

# The model types whose every weight and operation LIMe has (see the module docstring).
SOURCES = ("llama", "mistral", "lime")
# the files a saved tokenizer has one of (a fast tokenizer's, a SentencePiece model)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
# config.json keys that say where a config came from, not what the model computes
PROVENANCE = ("model_type", "architectures", "transformers_version", "_name_or_path", "auto_map")


def is_local(ckpt: str) -> bool:
    """Whether ``ckpt`` names a local folder (existing or not) rather than a hub id."""
    return not is_hub_id(ckpt)


def check_source(config: dict[str, Any], what: str) -> None:
    """ValueError in one line naming what LIMe cannot represent exactly in the model ``config``
    (``config.json`` as a dict; ``what`` names the checkpoint); None when it converts exactly."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise ValueError(f"{what} ({model_type}) is not a causal LM: upcycle needs a next-token head")
    if model_type == "qwen2":
        raise ValueError(
            f"{what} is a Qwen2 model: LIMe cannot represent its q/k/v projection biases "
            "(it routes bias-free K/V projections)"
        )
    if model_type not in SOURCES:
        raise ValueError(
            f"{what} is a {model_type!r} model: upcycle converts LLaMA-style checkpoints "
            "(llama, mistral without a sliding window, lime with routing none)"
        )
    if config.get("attention_bias"):
        raise ValueError(f"{what}: LIMe cannot represent attention biases (attention_bias=true)")
    if model_type == "mistral" and config.get("sliding_window") is not None:
        raise ValueError(
            f"{what}: LIMe cannot represent sliding-window attention "
            f"(sliding_window={config['sliding_window']}); it attends to every earlier position"
        )
    if model_type == "lime" and config.get("routing", "full") != "none":
        raise ValueError(
            f"{what} already routes (routing {config['routing']!r}): upcycle starts from a LLaMA"
        )


def check_out(out: str | os.PathLike) -> None:
    """ValueError unless ``out`` is absent or an empty folder that can be written."""
    path = Path(out)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder: choose a new --out")
    check_writable(path, folder=True)


def check_inputs(ckpt: str, out: str | os.PathLike) -> None:
    """The checks that need no torch: a local ``ckpt`` is a model folder that converts (``check_source``);
    ``out`` is new (``check_out``). A hub id's config is checked by ``upcycle`` (network)."""
    if is_local(ckpt):
        if not Path(ckpt).is_dir():
            raise FileNotFoundError(f"--ckpt {ckpt}: no such folder (nor a hub id)")
        check_model_dir(ckpt)
        check_source(read_config(ckpt), ckpt)
    check_out(out)


def lime_config(source: dict[str, Any], routing: str, ckpt: str):
    """The ``lime_model.config.LimeConfig`` of the source model's ``config.json`` (``source``) with
    ``routing``: every field LLaMA has (a ``lime`` source's own fields too), the source recorded."""
    from transformers import LlamaConfig

    from .config import LimeConfig

    keys = set(LlamaConfig().to_dict()) | (
        set(LimeConfig().to_dict()) if source["model_type"] == "lime" else set()
    )
    fields = {k: v for k, v in source.items() if k in keys and k not in (*PROVENANCE, "routing")}
    return LimeConfig(routing=routing, upcycled_from=upcycled_from(ckpt, source["model_type"]), **fields)


def upcycled_from(ckpt: str | os.PathLike, model_type: str) -> dict[str, str]:
    """What an upcycled model's ``config.json`` records of its source (``upcycled_from``)."""
    where = os.path.abspath(ckpt) if is_local(str(ckpt)) else str(ckpt)
    return {"checkpoint": where, "model_type": model_type, "routing_start": "self-only"}


def self_only_routers(model) -> None:
    """Every router of ``model`` at self-only routing, checked: its coefficients are the own heads'
    identity (ValueError naming the layer otherwise, e.g. a router class that cannot start there)."""
    import torch

    from .router import own_heads_only

    for layer in model.model.layers:
        router = layer.self_attn.router
        if router is None:
            continue
        router.reset_self_only()
        hidden = torch.randn(1, 3, model.config.hidden_size) if router.input_dependent else None
        with torch.no_grad():
            c = router.coefficients(hidden)
        own = own_heads_only(router.num_kv_heads, len(router.sources)).to(c.dtype)
        if not torch.equal(c, own.expand_as(c)):
            raise ValueError(
                f"routing {model.config.routing!r}: layer {router.layer_idx}'s router does not start at "
                "self-only routing (its reset_self_only leaves other sources' coefficients)"
            )


def upcycle(ckpt: str, out: str | os.PathLike, routing: str = "full", verbose: bool = False) -> Path:
    """Convert the causal LM ``ckpt`` (a local folder or hub id) into a LIMe with ``routing`` in ``out``.

    Args:
        ckpt: a LLaMA-style checkpoint (``SOURCES``; see the module docstring).
        out: the new folder (absent or empty); written whole or not at all.
        routing: the LIMe routing spec (``lime_model.routing``); its routers start at self-only.
        verbose: show transformers' load messages.

    Returns:
        ``out``: a LIMe checkpoint (``config.json`` with ``upcycled_from``, weights, the source's
        tokenizer) whose logits equal the source's.

    Raises:
        ValueError: a source LIMe cannot represent, a routing that cannot start at self-only, weights
            that do not match by name; nothing is written then.
    """
    from transformers import AutoConfig, AutoTokenizer

    from .modeling import LimeForCausalLM
    from .routing import parse_routing

    spec = str(parse_routing(routing))
    check_inputs(ckpt, out)
    with quiet_library(verbose):
        source = read_config(ckpt) if is_local(ckpt) else AutoConfig.from_pretrained(ckpt).to_dict()
        check_source(source, ckpt)
        config = lime_config(source, spec, ckpt)
        # a routing that cannot start at self-only is refused here, before the load
        self_only_routers(LimeForCausalLM(_tiny(config)))
        loaded: Any = LimeForCausalLM.from_pretrained(ckpt, config=config, output_loading_info=True)
        model, info = loaded  # (model, {"missing_keys": ..., ...}); transformers types it as the model
    routers = {n for n, _ in model.named_parameters() if ".self_attn.router." in n}
    wrong = {
        "missing": sorted(set(info["missing_keys"]) - routers),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": sorted(str(k) for k in info["mismatched_keys"]),
    }
    if any(wrong.values()):
        named = "; ".join(f"{k}: {', '.join(v[:3])}" for k, v in wrong.items() if v)
        raise ValueError(f"{ckpt}'s weights do not match a LIMe's by name ({named})")
    self_only_routers(model)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, replace=False) as tmp, quiet_library(verbose):
        model.save_pretrained(tmp)
        if is_local(ckpt) and not any((Path(ckpt) / f).is_file() for f in TOKENIZER_FILES):
            print(f"lime-model: {ckpt} has no tokenizer: none copied", file=sys.stderr)
        else:
            AutoTokenizer.from_pretrained(ckpt).save_pretrained(tmp)
    return out


def _tiny(config):
    """``config``'s routing and head layout at two layers and a tiny width: where a router that cannot
    start at self-only is found in milliseconds, before a large model loads."""
    from .config import LimeConfig

    kv, heads = config.num_key_value_heads, config.num_attention_heads
    return LimeConfig(
        routing=config.routing,
        vocab_size=8,
        hidden_size=heads * 2,
        intermediate_size=4,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=2,
    )


# ---------------------------------------------------------------------------------------------
# training from a saved model (``lime-model train --init DIR``)

# Model fields that change neither the weights' shapes nor what they compute (the k/v init, recomputation
# in backward; the positions are checked against seq_len): the recipe's, whatever the init's.
RUN_OPTIONS = ("arch", "kv_proj_init", "recompute_routed_kv", "max_position_embeddings")


def check_init_dir(init: str | os.PathLike) -> None:
    """The checks of ``--init`` that need no torch: a model folder (``check_model_dir``) with
    safetensors weights and a tokenizer (the one its embeddings were trained with)."""
    check_model_dir(init)
    if not weight_files(init):
        raise FileNotFoundError(
            f"--init {init} has no model.safetensors (a finished run, a checkpoint or an upcycled folder has)"
        )
    if not (Path(init) / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"--init {init} has no tokenizer: its embeddings need the one they were trained with"
        )


def init_config(recipe, expected):
    """The model config of a run that starts from ``recipe.init``'s weights: the saved model's own (its
    RoPE, norms and activation are its weights' companions) with the recipe's run options. A LLaMA (a
    ``lime`` model with routing none) takes a routed recipe's routing: it is upcycled (``load_init``).

    Args:
        recipe: a ``lime_model.recipes.Recipe`` with ``init`` set.
        expected: the recipe's model config (``lime_model.train.model_config`` with the init's tokenizer).

    Raises:
        ValueError: naming the first field of the model's shape (``SIZES``, tied embeddings, routing), or
            of those the recipe's model states, where the saved model differs from the recipe's; or a
            ``seq_len`` beyond its positions.
    """
    from transformers import AutoConfig

    from .config import SIZES

    saved = AutoConfig.from_pretrained(recipe.init)
    if type(saved) is not type(expected):
        raise ValueError(
            f"--init {recipe.init} is a {saved.model_type!r} model, the recipe trains {expected.model_type!r}"
        )
    stated = sorted(k for k, v in recipe.model.items() if v is not None)
    fields = dict.fromkeys([*SIZES, "tie_word_embeddings", "routing", *stated])  # the shape first, in order
    if upcycles(saved, expected):
        from .modeling import LimeForCausalLM

        saved.routing = expected.routing
        saved.upcycled_from = upcycled_from(recipe.init, "lime")
        self_only_routers(LimeForCausalLM(_tiny(saved)))  # a routing that cannot start there: refused now
    for name in (f for f in fields if f not in RUN_OPTIONS):
        have, want = getattr(saved, name, None), getattr(expected, name, None)
        if have != want:
            key = name if name == "routing" else f"model.{name}"
            raise ValueError(
                f"--init {recipe.init} has {name} {have!r}, the recipe's model {want!r}: set {key}={have!r} "
                "to train it (or choose another --init)"
            )
    if recipe.seq_len > saved.max_position_embeddings:
        raise ValueError(
            f"seq_len {recipe.seq_len} is longer than --init {recipe.init}'s {saved.max_position_embeddings} positions"
        )
    saved.recompute_routed_kv = expected.recompute_routed_kv
    return saved


def upcycles(saved, expected) -> bool:
    """Whether a run of config ``expected`` starting from a saved model of config ``saved`` upcycles it:
    a LLaMA (LIMe's own class, routing none) into a routed LIMe."""
    from .config import LimeConfig

    both_lime = type(saved) is type(expected) is LimeConfig
    return both_lime and not saved.routing_spec.enabled and expected.routing_spec.enabled


def load_init(init: str | os.PathLike, model) -> None:
    """The weights of the model folder ``init`` into ``model`` (built from ``init_config``); a routed
    model started from a LLaMA, whose folder holds no router weights, gets its routers at self-only
    routing, as ``upcycle`` gives them, so it starts with the LLaMA's logits."""
    from .checkpoint import load_weights

    routers = frozenset(n for n, _ in model.named_parameters() if ".self_attn.router." in n)
    upcycling = read_config(init).get("routing") == "none" and bool(routers)
    if upcycling:
        self_only_routers(model)
    load_weights(Path(init), model, absent=routers if upcycling else frozenset())
