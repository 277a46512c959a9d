"""The settings a measurement runs under, as frozen dataclasses: how checkpoints load (`Loading`) and how
their activations are extracted (`Extraction`).

The analyses (``Spec.compute``), the studies and the notebooks take these dataclasses; the command line
generates its options from their fields, as from each analysis's parameter dataclass. A field declared with
`option` is a command-line option: its metadata holds the help and the argparse extras, and
``cli_default`` where the command's default differs from the library's (the command line measures 256
tokens a sequence and keeps a cache; a library call, as ``extract`` does, 512 and none). A plain field is
set by the code that builds the settings, not by an option of its own (``Loading.device`` is the run
options' ``--device``, shared with ``lime-model``). This module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any

from lime_probe.extraction.cachedir import DEFAULT_LIMIT, parse_size


def option(default: Any = MISSING, help: str = "", **cli: Any) -> Any:
    """A settings or parameter field with its command-line help; ``cli`` holds argparse extras (``metavar``,
    ``choices``, ``type``, ``action``; a ``type`` raises ValueError, whose message the command line prints
    as the usage error), ``positive=True`` for integers that must be > 0, ``flag`` for an
    option not named after the field, ``cli_default`` (a value, or a function called when the parser is
    built) where the command's default differs from the field's, and ``off`` for the help of a ``--no-``
    option that sets the field to None."""
    return field(default=default, metadata={"help": help, **cli})


def dest_of(f: dataclasses.Field) -> str:
    """Where the parsed command line holds field ``f``: its name, or its ``flag``'s (``--cache``: ``cache``)."""
    return f.metadata["flag"].removeprefix("--").replace("-", "_") if "flag" in f.metadata else f.name


def cli_defaults(settings: type) -> dict[str, Any]:
    """``{dest: the value the command line holds when it is not given}`` of each field of the dataclass
    ``settings`` (`dest_of`): the field's ``cli_default`` where it has one, else its default."""
    out = {}
    for f in dataclasses.fields(settings):
        value = f.metadata.get("cli_default", f.default)
        out[dest_of(f)] = value() if callable(value) else value
    return out


def from_options(settings: type, options: Mapping[str, Any], skip: Iterable[str] = ()) -> Any:
    """The dataclass ``settings`` (`Loading`, `Extraction`, an analysis's parameters) from ``options``,
    ``{dest: value}`` as the command line parses them (`dest_of`): a field's ``parse`` reads its value
    (``--layers all``: None), a list (``nargs="+"``, ``action="append"``) becomes a tuple; a field missing
    from ``options`` or named in ``skip`` keeps its default."""
    values = {}
    for f in dataclasses.fields(settings):
        if f.name not in skip and dest_of(f) in options:
            value = options[dest_of(f)]
            value = f.metadata["parse"](value) if "parse" in f.metadata else value
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return settings(**values)


def command_settings(settings: type) -> Any:
    """The dataclass ``settings`` as the command line builds it when none of its options is given."""
    return from_options(settings, cli_defaults(settings))


# --layers, as every command reads it: negative indices count from the end, as Python's do
LAYERS_HELP = "'all' or comma-separated layer indices, negative ones counted from the last (-1: the last)"


def layer_list(text: str | None, also: str = "") -> list[int] | None:
    """The layer indices of a ``--layers`` value (None: all, for None or "all"); ValueError naming the
    accepted forms (``also``: more of them, e.g. "'paper', ") for anything else. Needs no model: the
    indices are checked against a model's layers when it is read (`lime_probe.extraction.planning`)."""
    if text in (None, "all"):
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be {also}'all' or comma-separated integers, got {text!r}") from None


def default_cache() -> str:
    """This user's own activation cache: under $XDG_CACHE_HOME (an absolute path, as the XDG spec asks), else
    under ~/.cache."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "lime-probe")


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Loading:
    """How checkpoints are loaded (``lime_probe.specs.load_checkpoints``, each with
    ``lime_probe.extraction.loading.load``).

    ``revision``: one hub revision per hub checkpoint in order, or one for all (``revisions_for``).
    ``device``: where the model runs, unless ``device_map`` places it. ``verbose``: let the libraries'
    loading messages through.
    """

    dtype: str = option(
        "auto",
        "weights dtype, loaded as such (bfloat16 holds half of float32's memory); auto: what the "
        "checkpoint's config names (default: %(default)s)",
        choices=DTYPES,
    )
    device_map: str | None = option(
        None,
        "spread the model over devices instead of --device (accelerate): auto, balanced, "
        "balanced_low_0, sequential, or a JSON object (inline or a .json file) of module name -> device "
        "(a GPU index, cuda:1, or cpu or disk: kept there, brought in layer by layer) (default: none)",
        metavar="MAP",
    )
    revision: tuple[str, ...] | None = option(
        None,
        "hub branch, tag or commit, e.g. step143000 for a Pythia checkpoint; one per hub --ckpt in "
        "order, or one for all (default: main)",
        metavar="REV",
        action="append",
    )
    device: str = "cpu"  # the run options' --device, shared with lime-model
    verbose: bool = False  # the run options' --verbose

    def __post_init__(self) -> None:
        if self.device_map is not None and self.device != "cpu":
            raise ValueError("give --device or --device-map, not both: a device map places the model itself")


@dataclass(frozen=True)
class Extraction:
    """How activations are extracted (``lime_probe.extraction.tracing.extract``'s settings; see there).

    ``layers``: the layer indices read (None: all). ``cache_dir``: the activation cache (None: none);
    ``cache_limit`` (bytes) is what the command line trims it to after a run. ``pretokenized``: the texts
    are token-id lists (token windows). ``progress``: show a progress bar.
    """

    layers: Sequence[int] | None = option(
        None, LAYERS_HELP + " (default: all)", cli_default="all", type=str, parse=layer_list
    )
    max_length: int = option(
        512,
        "truncate each sequence to T tokens (default: %(default)s)",
        cli_default=256,
        metavar="T",
        positive=True,
    )
    max_tokens: int | None = option(
        None, "stop extracting after N tokens in all (default: no limit)", metavar="N", positive=True
    )
    batch_size: int | None = option(
        None,
        "sequences per forward pass (default: as many as fit 4096 tokens, padding included; either way "
        "sequences run sorted by length and results come back in order)",
        metavar="B",
        positive=True,
    )
    cache_dir: str | None = option(
        None,
        "activation cache; a rerun or an interrupted run reuses it (default: %(default)s, yours alone: "
        "under $XDG_CACHE_HOME, else ~/.cache)",
        flag="--cache",
        cli_default=default_cache,
        metavar="DIR",
        off="extract without the on-disk cache",
    )
    cache_limit: int = option(
        parse_size(DEFAULT_LIMIT),
        "after the run, remove the least recently used cache entries (never this run's) until the cache "
        f"holds at most SIZE, e.g. 500MB, 20GB; 0: no limit (default: {DEFAULT_LIMIT})",
        type=parse_size,
        metavar="SIZE",
    )
    allow_unknown_tokens: bool = option(
        False,
        "measure data even when over 10%% of its tokens are the tokenizer's unknown token (default: "
        "refused, as the data does not fit the tokenizer; over 1%% warns)",
    )
    pretokenized: bool = False
    progress: bool = True

    def extract_kwargs(self) -> dict[str, Any]:
        """These settings as ``extract`` keywords (the cache limit is the command line's, not extract's)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cache_limit"}
        return kw | {"layers": None if self.layers is None else list(self.layers)}
