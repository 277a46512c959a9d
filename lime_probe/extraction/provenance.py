"""Where activations come from: a checkpoint's identity (path, architecture, a fingerprint of its config
and weights) and the library versions. The activation cache keys on them, and every result file records
them (`lime_probe.output.results.run_metadata`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path

_VERSIONED = (
    "lime-probe",
    "torch",
    "transformers",
    "nnsight",
    "accelerate",
    "numpy",
    "scikit-learn",
    "openTSNE",
    "datasets",
    "tokenizers",
    "safetensors",
    "matplotlib",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Hash at most this much of each weights file (head and tail): enough to tell checkpoints
# apart, cheap for multi-GB models. File sizes are always included.
_HASH_BYTES = 1 << 20


def versions() -> dict[str, str]:
    """Python, platform and installed versions of the packages a result depends on; torch's as it names
    itself, with its build (``2.11.0+cu130``: a CUDA build's numerics differ from a CPU build's, while the
    wheel's metadata says ``2.11.0`` for both)."""
    import torch

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in _VERSIONED:
        try:
            out[name] = torch.__version__ if name == "torch" else metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def checkpoint_identity(ckpt: str | os.PathLike, revision: str | None = None) -> dict:
    """Identity of a checkpoint: for a local directory its resolved path, model type, architectures,
    routing (LIMe), fingerprint and weight files; for anything else a hub id as given, with the
    ``revision`` it was loaded at when given (the branch, tag or commit asked for; the activation cache
    passes the commit it resolved to).

    The fingerprint is a SHA-256 over config.json and, per weights file, its name, size and first
    and last MiB: it follows the content, so a copied checkpoint keeps it. ``weights`` lists each
    file's ``[name, size, mtime_ns]``, so the identity as a whole also changes whenever a file is
    rewritten (the activation cache keys on the whole identity).
    """
    path = Path(ckpt)
    if not path.is_dir():
        return {"id": str(ckpt), "source": "hub", **({"revision": revision} if revision else {})}
    ident: dict = {"path": str(path.resolve()), "source": "local"}
    config_file = path / "config.json"
    h = hashlib.sha256()
    if config_file.is_file():
        raw = config_file.read_bytes()
        h.update(raw)
        try:
            config = json.loads(raw)
        except json.JSONDecodeError:
            config = {}
        ident["model_type"] = config.get("model_type")
        ident["architectures"] = config.get("architectures")
        if config.get("routing") is not None:
            ident["routing"] = config["routing"]
    files = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_HASH_BYTES))
            if size > 2 * _HASH_BYTES:
                fh.seek(-_HASH_BYTES, os.SEEK_END)
                h.update(fh.read(_HASH_BYTES))
    ident["fingerprint"] = h.hexdigest()[:16]
    ident["weights"] = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return ident
