"""Machine-readable results: JSON (everything) and CSV (the flat table), written atomically.

Every result file records what produced it: the settings, each checkpoint's identity (path,
architecture, a fingerprint of its config and weights) and the library versions, so a number
in a paper draft can be traced back to the exact run.

    meta = run_metadata("entropy", settings={"site": "values"}, checkpoints={"LIMe": "runs/lime"})
    write_results(out_dir / "entropy", rows, meta=meta, extra={"curves": curves})
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from lime_model.files import atomic_write
from lime_probe.extraction.provenance import checkpoint_identity, versions


def run_metadata(
    command: str,
    *,
    settings: Mapping,
    checkpoints: Mapping[str, str | os.PathLike],
    revisions: Mapping[str, str | None] | None = None,
) -> dict:
    """The header of every result file: command, UTC time, settings, checkpoints (label ->
    identity; a hub checkpoint's with its entry of ``revisions``, label -> revision) and versions."""
    return {
        "command": command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "settings": to_jsonable(dict(settings)),
        "checkpoints": {
            label: checkpoint_identity(c, (revisions or {}).get(label)) for label, c in checkpoints.items()
        },
        "versions": versions(),
    }


def to_jsonable(obj):
    """Convert numpy/torch scalars and arrays, paths and tuples into plain JSON types;
    non-finite floats become None (JSON has no NaN)."""
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "detach"):  # torch tensor, without importing torch here
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, os.PathLike):
        return str(obj)
    return obj


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` all or nothing (``lime_model.files.atomic_write``),
    creating its folder; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, text)


def rows_to_csv(rows: Sequence[Mapping]) -> str:
    """CSV text of ``rows`` (dicts); columns in first-seen order, missing cells empty."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in to_jsonable(dict(row)).items()})
    return buf.getvalue()


def write_results(
    stem: str | os.PathLike, rows: Sequence[Mapping], *, meta: Mapping, extra: Mapping | None = None
) -> list[Path]:
    """Write ``stem.json`` ({"meta", "rows", **extra}) and ``stem.csv`` (the rows); return both paths.

    ``rows`` is the flat table (one dict per model x layer x ...); ``extra`` holds structured
    results that do not fit a table (matrices, embeddings).
    """
    stem = Path(stem)
    doc = {"meta": to_jsonable(dict(meta)), "rows": to_jsonable(list(rows)), **to_jsonable(dict(extra or {}))}
    json_path = atomic_write_text(
        stem.with_name(stem.name + ".json"), json.dumps(doc, indent=1, allow_nan=False) + "\n"
    )
    csv_path = atomic_write_text(stem.with_name(stem.name + ".csv"), rows_to_csv(rows))
    return [json_path, csv_path]


def read_metrics(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Columns of a training run's ``metrics.jsonl`` (step, tokens, flops, loss, lr, grad_norm,
    tokens_per_s, ... as float arrays of equal length); ``path`` may be the run directory.

    Raises FileNotFoundError if there is no metrics file and ValueError if it holds no records
    or a line is not JSON.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no training metrics at {path}")
    from lime_model.data import jsonl_records

    records = [r for _, r in jsonl_records(path) if "loss" in r]
    if not records:
        raise ValueError(f"{path} holds no training records with a 'loss'")
    keys = list(dict.fromkeys(k for r in records for k in r))
    return {
        k: np.array([r.get(k, np.nan) for r in records], dtype=float)
        for k in keys
        if all(isinstance(r.get(k, 0.0), (int, float)) for r in records)
    }
