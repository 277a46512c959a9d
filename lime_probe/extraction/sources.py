"""Where a checkpoint comes from, told apart without heavy imports: a local folder, checked at once, or a
hub id, which only the hub (or its local cache) can answer for. The command line checks ``--ckpt`` with
this before torch is imported; `loading.load` again, for library users."""

from __future__ import annotations

import os
from pathlib import Path

from lime_model.checks import is_hub_id  # lime-model's upcycle tells them apart the same way

__all__ = ["check_local", "is_hub_id"]


def check_local(ckpt: str | os.PathLike) -> None:
    """Raise unless the local folder `ckpt` is a checkpoint: it exists (FileNotFoundError "checkpoint not
    found"), is a folder with a config.json, and its safetensors weights are whole (ValueError naming the
    file, `lime_model.checks.check_weights`: headers only, milliseconds)."""
    from lime_model.checks import check_weights  # here: `import lime_model` registers the models

    path = Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise ValueError(f"not a checkpoint directory: {path} (expected a folder with config.json)")
    if not (path / "config.json").is_file():
        raise ValueError(f"not a checkpoint: {path} has no config.json")
    check_weights(path)
