"""Input checks and error reporting shared by the two programs, ``lime-model`` and ``lime-probe``.

Both end a failure with one line on stderr and an exit code: 0 done, 2 bad usage or input, 1 an
unexpected failure, 130 interrupted (Ctrl-C). The checks here run before any work (a minute of
evaluation is not spent on a mistyped device or a corrupt weights file) and raise one of
:data:`BAD_INPUT` with a message that names the user's option or file. Importing this module imports
nothing heavy: torch and safetensors are imported inside the checks that need them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BAD_INPUT", "OneLineParser", "check_device", "check_weights", "one_line"]

# Errors that mean "the input is wrong" (exit 2), as opposed to a bug or a crash (exit 1). KeyError is not
# one: the libraries raise ValueError for a wrong name, so a KeyError is a bug.
BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the usage itself stays one ``--help`` away) and no abbreviated
    options (``--ckp`` is an error, not ``--ckpt``). Pass it on as ``add_subparsers(parser_class=...)``."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line(error: BaseException) -> str:
    """``error`` as one line: an OS error as ``PATH: reason`` (no errno prefix), else its first line of
    text (a KeyError's key unquoted), or its type name."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(error).__name__


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
            with safe_open(path, framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001  safetensors raises its own error types, and OSError
            raise ValueError(f"cannot read the weights file {path}: {one_line(e)}") from None
