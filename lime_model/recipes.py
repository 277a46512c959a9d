"""Training recipes: JSON files in ``lime_model/recipes/`` loaded into a typed, validated ``Recipe``.

A recipe lists only what differs from the field defaults of ``Recipe``; nested fields (``model``,
``arithmetic``) take dotted override keys (``model.hidden_size=64``). What each key means is documented
in docs/models.md, "Recipe keys".
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import LlamaConfig

from .config import check_sizes
from .routing import parse_routing

MODEL_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": True,
}
RUN_CONTROL = ("log_every", "save_every", "keep_last", "eval_every", "description")
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
    "eval_every",
    "eval_max_rows",
)
_MODEL_KEYS = frozenset(LlamaConfig().to_dict())


@dataclass(frozen=True)
class ArithmeticSettings:
    """The Arithmetic Expression Task's data: tiers by operator count (``lime_model.tasks.arithmetic``)."""

    operators: list[int] = field(default_factory=lambda: [4, 5, 6])
    train_per_tier: int = 50000
    test_per_tier: int = 1000
    max_operand: int = 9
    max_value: int = 1000
    eval_batch_size: int = 256

    def __post_init__(self) -> None:
        _check_fields(self, "arithmetic.")
        if not self.operators or min(self.operators) < 1:
            raise ValueError(f"arithmetic.operators must be operator counts >= 1, got {self.operators}")


@dataclass(frozen=True)
class Recipe:
    """A validated training recipe (docs/models.md, "Recipe keys", gives the meaning of each field)."""

    description: str = ""
    task: str = "lm"
    data: str | None = None
    split: str | None = None
    max_texts: int | None = None
    one_pass: bool = False
    tokenizer: str | None = None
    init: str | None = None
    routing: str = "full"
    model: dict[str, Any] = field(default_factory=lambda: dict(MODEL_DEFAULTS))
    seq_len: int = 2048
    batch_size: int = 1024
    micro_batch_size: int = 4
    steps: int | None = None
    epochs: float | None = None
    lr: float = 1e-3
    min_lr: float = 1e-6
    warmup_steps: int = 200
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    router_lr_mult: float = 10.0
    mixed_precision: str = "auto"
    compile: bool = False
    fsdp: bool = False
    seed: int = 42
    log_every: int = 10
    save_every: int = 1000
    keep_last: int = 2
    eval_data: str | None = None
    eval_holdout: float = 0.0
    eval_every: int | None = None
    eval_max_rows: int | None = None
    cache_dir: str | None = None
    arithmetic: ArithmeticSettings = field(default_factory=ArithmeticSettings)

    def __post_init__(self) -> None:
        _check_fields(self, "")
        self._check_model()
        for key, choices in CHOICES.items():
            if getattr(self, key) not in choices:
                raise ValueError(
                    f"recipe key {key!r} must be one of {', '.join(choices)}, got {getattr(self, key)!r}"
                )
        for key in POSITIVE:
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"recipe key {key!r} must be > 0, got {value}")
        if self.steps is None and self.epochs is None:
            raise ValueError("the recipe sets neither steps nor epochs")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must lie in [0, lr], got {self.min_lr}")
        if not 0 <= self.eval_holdout < 1:
            raise ValueError(f"eval_holdout must lie in [0, 1), got {self.eval_holdout}")
        if self.one_pass and self.steps is None:
            raise ValueError("one_pass needs steps (it reads steps x batch_size sequences)")
        if self.task == "lm" and self.data is None:
            raise ValueError("this recipe trains on text but names no data: pass --data FILE|FOLDER|hf:NAME")

    @property
    def arch(self) -> str:
        """The model architecture, ``model.arch`` (default ``"lime"``)."""
        return self.model.get("arch") or "lime"

    def _check_model(self) -> None:
        from .architectures import ARCHITECTURES  # imports the models: only when a recipe is checked

        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"recipe key 'model.arch' must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}"
            )
        routing = parse_routing(self.routing)  # raises on a malformed spec, for every arch
        if self.arch != "lime" and routing.enabled:
            raise ValueError(
                f"model.arch {self.arch!r} takes no LIMe routing: set routing to 'none' (got {self.routing!r})"
            )
        own = set(ARCHITECTURES[self.arch]().to_dict()) - _MODEL_KEYS - {"routing"}  # the arch's own fields
        bad = sorted(set(self.model) - _MODEL_KEYS - own - {"arch"})
        if not bad:  # the arch's own fields are checked by its config
            ARCHITECTURES[self.arch](**{k: v for k, v in self.model.items() if k in own})
        if bad:
            raise ValueError(f"unknown recipe key(s): {', '.join(f'model.{b}' for b in bad)}")
        for sub, value in self.model.items():
            default = MODEL_DEFAULTS.get(sub)
            if value is not None and default is not None and not _is_instance(value, type(default)):
                raise ValueError(f"recipe key 'model.{sub}' must be {type(default).__name__}, got {value!r}")
        check_sizes(self.model, "recipe key model.")
        heads = self.model.get("num_attention_heads")
        kv = self.model.get("num_key_value_heads") or heads
        hidden = self.model.get("hidden_size")
        if heads is None or hidden is None:
            raise ValueError("the recipe's model needs hidden_size and num_attention_heads")
        if hidden % heads or heads % kv:
            raise ValueError(
                f"hidden_size {hidden} must be divisible by num_attention_heads {heads}, "
                f"and that by num_key_value_heads {kv}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The recipe as JSON-able data (what ``recipe.json`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """A recipe from a mapping (missing top-level keys take their defaults; ``model`` is taken whole), validated."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown recipe key(s): {', '.join(unknown)}")
        values = dict(data)
        if "model" in values and not isinstance(values["model"], Mapping):
            raise ValueError("recipe key 'model' must be an object")
        if "arithmetic" in values:
            values["arithmetic"] = _arithmetic(values["arithmetic"])
        return cls(**{k: copy.deepcopy(v) for k, v in values.items()})

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the original: the recipe minus run-control keys."""
        return identity(self.to_dict())


def _arithmetic(value: Any) -> ArithmeticSettings:
    if isinstance(value, ArithmeticSettings):
        return value
    if not isinstance(value, Mapping):
        raise ValueError("recipe key 'arithmetic' must be an object")
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(ArithmeticSettings)})
    if unknown:
        hint = " (tiers count operators now: operands n -> operators n-1)" if "operands" in unknown else ""
        raise ValueError(f"unknown recipe key(s): {', '.join(f'arithmetic.{u}' for u in unknown)}{hint}")
    return ArithmeticSettings(**copy.deepcopy(dict(value)))


def _is_instance(value: Any, kind: type) -> bool:
    """``isinstance`` as JSON values mean it: a bool is not a number, an int is a float."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _check_fields(obj: Any, prefix: str) -> None:
    """Check each field of dataclass ``obj`` against its annotation (``X``, ``X | None``, ``list[int]``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if value is None and type(None) in options:
            continue
        ok = False
        for kind in options:
            origin = typing.get_origin(kind) or kind
            if origin is list:
                (item,) = typing.get_args(kind)
                ok = isinstance(value, list) and all(_is_instance(v, item) for v in value)
            elif origin is dict:
                ok = isinstance(value, dict)
            elif kind is not type(None):
                ok = _is_instance(value, kind)
            if ok:
                break
        if not ok:
            names = " or ".join(getattr(k, "__name__", str(k)) for k in options)
            raise ValueError(f"recipe key {prefix + f.name!r} must be {names}, got {value!r}")


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
        path = Path(str(resources.files("lime_model") / "recipes" / f"{name_or_path}.json"))
    try:
        recipe = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"recipe {path} is not valid JSON: {e}") from None
    if not isinstance(recipe, dict):
        raise ValueError(f"recipe {path} must hold a JSON object")
    return recipe


NESTED = ("model", "arithmetic")


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


def load_recipe(
    recipe: str | Mapping[str, Any] | Recipe, overrides: Mapping[str, Any] | None = None
) -> Recipe:
    """A shipped recipe name, a JSON path, a dict or a ``Recipe``, with ``overrides``, validated.

    A file or dict lists only what differs from the defaults; ``model`` and ``arithmetic`` merge
    key by key over the defaults too.
    """
    if isinstance(recipe, Recipe):
        raw = recipe.to_dict()
    else:
        raw = _read(recipe) if isinstance(recipe, str) else dict(recipe)
    base = {"model": dict(MODEL_DEFAULTS), "arithmetic": dataclasses.asdict(ArithmeticSettings())}
    merged = merge(merge(base, raw), overrides or {})
    model = merged.get("model")
    arch = model.get("arch") if isinstance(model, Mapping) else None
    if arch not in (None, "lime") and "routing" not in raw and "routing" not in (overrides or {}):
        merged["routing"] = "none"  # a baseline has no LIMe routing; the default "full" is LIMe's
    return Recipe.from_dict(merged)


def identity(recipe: Mapping[str, Any]) -> dict:
    """What a resumed run must share with the original: the recipe (as data) minus run-control keys.

    Keys a saved recipe lacks (written before they existed) count as their defaults, so adding a
    recipe field does not break resuming older runs that leave it at its default; the arithmetic
    settings count only for the arithmetic task.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(Recipe) if f.default is not dataclasses.MISSING}
    full = {**defaults, **recipe}
    ignored = RUN_CONTROL if full["task"] == "arithmetic" else (*RUN_CONTROL, "arithmetic")  # unused by lm
    return {k: v for k, v in full.items() if k not in ignored}
