"""Training recipes: JSON files in ``lime_model/recipes/`` merged over :data:`DEFAULTS`, validated.

A recipe is a flat dict plus two nested ones, ``model`` (any `LlamaConfig` field) and
``arithmetic`` (the task's generator). A recipe file only lists what differs from the defaults.
Overrides use dotted keys for nested fields (``model.hidden_size=64``).

Key meanings (batch sizes count sequences):

* ``task``: ``"lm"`` (packed text from ``data``) or ``"arithmetic"`` (generated expressions).
* ``data``, ``split``, ``max_texts``: the text spec of :func:`lime_model.data.load_texts`.
* ``tokenizer``: a tokenizer directory or hub name; ``null`` trains a byte-level BPE of
  ``model.vocab_size`` entries on the data (lm) or uses the task's characters (arithmetic).
* ``batch_size``: sequences per optimizer step, over all processes; ``micro_batch_size``:
  sequences per forward pass on one process (the rest is gradient accumulation).
* ``steps`` (or, when ``null``, ``epochs`` over the training set) sets the run length and with it
  the learning-rate schedule, so it cannot change on ``--resume`` (a finished run is not extended).
* ``cache_dir``: where packed token rows and trained BPEs are cached (default ``$LIME_MODEL_CACHE``,
  else ``~/.cache/lime_model``), keyed on the data source (each file's path, size and mtime, or the
  ``hf:`` spec), ``split``, ``max_texts``, the tokenizer and ``seq_len``; a hit reads no text.
* ``schedule``: ``cosine`` / ``linear`` decay to ``min_lr`` after ``warmup_steps``, or ``constant``.
* ``router_lr_mult``: router learning rate / ``lr`` (the paper: 1e-2 / 1e-3 = 10).
* ``mixed_precision``: ``auto`` (bf16 on a GPU, else fp32), ``no``, ``bf16``, ``fp16``.
* ``log_every``, ``save_every``, ``keep_last``: run control; they may change on ``--resume``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import LlamaConfig

from .routing import parse_routing

DEFAULTS: dict[str, Any] = {
    "description": "",
    "task": "lm",
    "data": None,
    "split": None,
    "max_texts": None,
    "tokenizer": None,
    "routing": "full",
    "model": {
        "vocab_size": 50257,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "tie_word_embeddings": True,
    },
    "seq_len": 2048,
    "batch_size": 1024,
    "micro_batch_size": 4,
    "steps": None,
    "epochs": None,
    "lr": 1e-3,
    "min_lr": 1e-6,
    "warmup_steps": 200,
    "schedule": "cosine",
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "grad_clip": 1.0,
    "router_lr_mult": 10.0,
    "mixed_precision": "auto",
    "compile": False,
    "fsdp": False,
    "seed": 42,
    "log_every": 10,
    "save_every": 1000,
    "keep_last": 2,
    "cache_dir": None,
    "arithmetic": {
        "operators": [4, 5, 6],
        "train_per_tier": 50000,
        "test_per_tier": 1000,
        "max_operand": 9,
        "max_value": 1000,
        "eval_batch_size": 256,
    },
}
RUN_CONTROL = ("log_every", "save_every", "keep_last", "description")
NESTED = ("model", "arithmetic")
CHOICES = {
    "task": ("lm", "arithmetic"),
    "schedule": ("cosine", "linear", "constant"),
    "mixed_precision": ("auto", "no", "bf16", "fp16"),
}
POSITIVE = (
    "seq_len",
    "batch_size",
    "micro_batch_size",
    "steps",
    "epochs",
    "lr",
    "eps",
    "grad_clip",
    "router_lr_mult",
    "log_every",
    "save_every",
    "keep_last",
)
_MODEL_KEYS = frozenset(LlamaConfig().to_dict())


def recipe_names() -> list[str]:
    """Names of the recipes shipped in ``lime_model/recipes/``."""
    return sorted(
        p.name[:-5]
        for p in resources.files("lime_model").joinpath("recipes").iterdir()
        if p.name.endswith(".json")
    )


def _read(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not path.is_file():
        if name_or_path not in recipe_names():
            raise FileNotFoundError(
                f"recipe not found: {name_or_path} (not a file; shipped recipes: {', '.join(recipe_names())})"
            )
        path = Path(str(resources.files("lime_model").joinpath("recipes", f"{name_or_path}.json")))
    try:
        recipe = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"recipe {path} is not valid JSON: {e}") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"recipe {path} must hold a JSON object")
    return recipe


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """``base`` updated by ``overrides``; dotted keys (``model.hidden_size``) and dicts reach nested fields."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        head, _, tail = key.partition(".")
        if tail:
            value, key = {tail: value}, head
        if key in NESTED and isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["lr=3e-4", "model.hidden_size=64", "data=x.txt"]`` -> overrides (values as JSON, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _check_type(key: str, value: Any, default: Any) -> None:
    if value is None or default is None:
        return
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ValueError(f"recipe key {key!r} must be {type(default).__name__}, got {value!r}")


def validate(recipe: Mapping[str, Any]) -> dict:
    """The recipe, checked: known keys and types, choices, positive sizes, a parsable routing."""
    unknown = sorted(set(recipe) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown recipe key(s): {', '.join(unknown)}")
    for key, value in recipe.items():
        if key in NESTED:
            if not isinstance(value, Mapping):
                raise ValueError(f"recipe key {key!r} must be an object")
            known = _MODEL_KEYS if key == "model" else set(DEFAULTS[key])
            bad = sorted(set(value) - known)
            if bad:
                raise ValueError(f"unknown recipe key(s): {', '.join(f'{key}.{b}' for b in bad)}")
            for sub, v in value.items():
                _check_type(f"{key}.{sub}", v, DEFAULTS[key].get(sub))
        else:
            _check_type(key, value, DEFAULTS[key])
    for key, choices in CHOICES.items():
        if recipe[key] not in choices:
            raise ValueError(f"recipe key {key!r} must be one of {', '.join(choices)}, got {recipe[key]!r}")
    for key in POSITIVE:
        if recipe[key] is not None and recipe[key] <= 0:
            raise ValueError(f"recipe key {key!r} must be > 0, got {recipe[key]}")
    if recipe["steps"] is None and recipe["epochs"] is None:
        raise ValueError("the recipe sets neither steps nor epochs")
    if recipe["batch_size"] % recipe["micro_batch_size"]:
        raise ValueError(
            f"batch_size {recipe['batch_size']} is not a multiple of micro_batch_size "
            f"{recipe['micro_batch_size']}"
        )
    if not 0 <= recipe["min_lr"] <= recipe["lr"]:
        raise ValueError(f"min_lr must lie in [0, lr], got {recipe['min_lr']}")
    model = recipe["model"]
    heads, kv = model["num_attention_heads"], model.get("num_key_value_heads") or model["num_attention_heads"]
    if model["hidden_size"] % heads or heads % kv:
        raise ValueError(
            f"hidden_size {model['hidden_size']} must be divisible by num_attention_heads {heads}, "
            f"and that by num_key_value_heads {kv}"
        )
    parse_routing(recipe["routing"])
    if recipe["task"] == "lm" and recipe["data"] is None:
        raise ValueError("this recipe trains on text but names no data: pass --data FILE|FOLDER|hf:NAME")
    return dict(recipe)


def load_recipe(recipe: str | Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict:
    """A shipped recipe name, a JSON path or a dict, over :data:`DEFAULTS`, with ``overrides``, validated."""
    raw = _read(recipe) if isinstance(recipe, str) else dict(recipe)
    return validate(merge(merge(DEFAULTS, raw), overrides or {}))


def identity(recipe: Mapping[str, Any]) -> dict:
    """What a resumed run must share with the original: the recipe minus run-control keys."""
    return {k: v for k, v in recipe.items() if k not in RUN_CONTROL}
