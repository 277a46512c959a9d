"""Checks of a command's input, run before any work (a minute of evaluation is not spent on a mistyped device
or a corrupt weights file), shared by ``lime_model`` and ``lime_probe``: each raises one of ``BAD_INPUT``
with a message that names the user's option or file, and ``one_line`` is how such an error is shown.
Nothing here knows of argparse (the programs' machinery is ``lime_model.command_line``). Importing this
module imports nothing heavy: torch and safetensors are imported inside the checks that need them.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .files import DiskFullError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BAD_INPUT",
    "check_causal_lm",
    "check_device",
    "check_model_dir",
    "check_positive",
    "check_weights",
    "check_window",
    "config_positions",
    "is_causal_lm",
    "is_hub_id",
    "one_line",
    "positive_int",
    "quiet_library",
    "read_config",
]

# Errors that mean "the input is wrong" (exit 2), as opposed to a bug or a crash (exit 1). KeyError is not
# one: the libraries raise ValueError for a wrong name, so a KeyError is a bug. A full disk is the user's to
# fix too: its line names the file that did not fit.
BAD_INPUT = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    DiskFullError,
)


def one_line(error: BaseException) -> str:
    """``error`` as one line: an OS error as ``PATH: reason`` (no errno prefix), else its first line of
    text (a KeyError's key unquoted), or its type name."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(error).__name__


def positive_int(text: str) -> int:
    """``text`` as an integer > 0; ValueError naming it otherwise (the command line's ``POSITIVE_INT`` wraps it)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


def check_positive(value: float, what: str) -> None:
    """ValueError naming ``what`` unless ``value`` is a finite number > 0 (a parameter check, run before any
    data or model is read)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")


def check_device(device: str | torch.device, option: str = "--device") -> torch.device:
    """``device`` as a torch.device that this machine has; ValueError naming it otherwise (a name torch
    does not know, such as "gpu0", or a CUDA/MPS/XPU device that is absent), so a run fails before any
    work. ``cpu`` and ``meta`` are always there."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{option} {device!r} is not a torch device; use e.g. cpu, cuda, cuda:1 or mps"
        ) from None
    if dev.type in ("cpu", "meta"):
        return dev
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if not (backend is not None and hasattr(backend, "is_available") and backend.is_available()):
        raise ValueError(
            f"{option} {device}: this machine has no {dev.type.upper()} device (use --device cpu)"
        )
    count = getattr(backend, "device_count", lambda: 1)()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{option} {device}: this machine has {count} {dev.type.upper()} device(s)")
    return dev


def weight_files(ckpt: str | os.PathLike) -> list[Path]:
    """The safetensors weight files of the checkpoint folder ``ckpt``: ``model.safetensors``, or the shards
    its ``model.safetensors.index.json`` lists; none for a checkpoint stored otherwise (``.bin``)."""
    ckpt = Path(ckpt)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read the weights index {index}: {one_line(e)}") from None
        return [ckpt / name for name in sorted(set(weight_map.values()))]
    single = ckpt / "model.safetensors"
    return [single] if single.exists() else []


def check_weights(ckpt: str | os.PathLike) -> None:
    """Raise ValueError naming the file if a safetensors weight file of ``ckpt`` is missing, truncated or
    not safetensors at all: each file's header and its length against the file's size are read (no
    tensor data), so the check takes milliseconds where loading would fail minutes later."""
    from safetensors import safe_open

    for path in weight_files(ckpt):
        try:
            with safe_open(path, framework="numpy"):  # "pt" would import torch: this runs before it
                pass
        except Exception as e:  # noqa: BLE001  safetensors raises its own error types, and OSError
            raise ValueError(f"cannot read the weights file {path}: {one_line(e)}") from None


def check_model_dir(ckpt: str | os.PathLike) -> None:
    """FileNotFoundError unless ``ckpt`` is a folder with a ``config.json``; ValueError naming a missing,
    truncated or corrupt weights file (``check_weights``). Imports no torch: run before any."""
    if not (Path(ckpt) / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt} is not a model directory (no config.json)")
    check_weights(ckpt)


def config_positions(config: Any) -> int | None:
    """The positions a model can read (``max_position_embeddings``, or GPT-2's ``n_positions``) from its
    ``config``: a Hugging Face config, or ``config.json`` read as a dict (no torch needed); None when it
    states none (e.g. pure RoPE without a stated maximum)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_window(window: int | None, config: Any, what: str, *, minimum: int = 1) -> None:
    """ValueError in one line unless ``window`` (tokens per window; None: the command's default) is an
    integer from ``minimum`` to the positions ``config`` states (`config_positions`; ``what`` names the
    model): a longer window would index past the position embeddings, or run on past what it was trained
    for, so it is refused rather than cut down silently."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < minimum:
        raise ValueError(f"--window must be an integer >= {minimum}, got {window!r}")
    positions = config_positions(config)
    if positions is not None and window > positions:
        raise ValueError(
            f"--window {window} is longer than {what}'s {positions} positions: give --window <= {positions}"
        )


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(ckpt: str) -> bool:
    """Whether `ckpt` reads as a hub id ("name" or "owner/name") and is no existing local path.

    "owner/name" whose "owner" is an existing local folder reads as a path (``runs/lime`` where
    ``runs/`` exists): a hub owner never shadows a folder the user has.
    """
    if not HUB_ID.match(ckpt) or Path(ckpt).exists():
        return False
    return "/" not in ckpt or not Path(ckpt.split("/")[0]).is_dir()


def read_config(ckpt: str | os.PathLike) -> dict:
    """The ``config.json`` of the checkpoint folder ``ckpt`` as a dict (no torch, no transformers), for
    checks before a model loads; ValueError naming the file when it is not a JSON object."""
    path = Path(ckpt) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(config, dict):
        raise ValueError(f"cannot read {path}: not a JSON object")
    return config


def is_causal_lm(config) -> bool:
    """Whether the Hugging Face ``config`` names a model with a next-token head: a causal-LM architecture,
    and no BERT-style encoder (a masked LM not configured as a decoder; BERT is in both Auto mappings, and
    its bidirectional attention sees the token it would predict). The model types must be registered."""
    import transformers as tf

    if type(config) in tf.MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False):
        return False
    return type(config) in tf.MODEL_FOR_CAUSAL_LM_MAPPING


def check_causal_lm(config, what: str, purpose: str = "perplexity") -> None:
    """ValueError, one line naming ``what`` and its model type, unless ``config`` is a causal LM
    (``is_causal_lm``): ``purpose`` scores next-token predictions, which such a model has not."""
    if not is_causal_lm(config):
        raise ValueError(
            f"{what} ({config.model_type}) is not a causal LM: {purpose} needs a next-token head, which it has not"
        )


@contextmanager
def quiet_library(verbose: bool = False) -> Iterator[None]:
    """Keep transformers/huggingface_hub load chatter (load reports, warnings, progress bars) off the
    console inside the block: their loggers report errors only, their progress bars ("Loading weights")
    are off and Python warnings are ignored; everything is restored afterwards. With ``verbose`` the block
    changes nothing."""
    if verbose:
        yield
        return
    import transformers
    from huggingface_hub.utils import logging as hub_logging

    before = hub_logging.get_verbosity(), transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    hub_logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hub_logging.set_verbosity(before[0])
        transformers.logging.set_verbosity(before[1])
        if bars:
            transformers.utils.logging.enable_progress_bar()
