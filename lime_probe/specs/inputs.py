"""The checks of a request that need no model, so a bad label, parameter, path or number is named in a
second, before torch and a checkpoint take half a minute to load. The command line runs them on its parsed
options (`lime_probe.cli.check_inputs`); a script may run them on its own values the same way.

Importing it imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lime_model.checks import check_window, read_config
from lime_model.files import check_writable
from lime_probe.extraction.settings import layer_list
from lime_probe.extraction.sources import check_local, is_hub_id
from lime_probe.interventions.pairs import load_pairs

from . import ANALYSES
from .base import labels_for
from .data import check_blimp_source


def check_request(
    params: Iterable[tuple[str, Any]],
    *,
    checkpoints: Sequence[str] = (),
    labels: Sequence[str] | None = None,
    load: bool = False,
    max_length: int | None = None,
    layers: str | None = None,
    folders: Mapping[str, str] | None = None,
    texts: str | None = None,
    pairs: str | None = None,
    blimp: Sequence[tuple[str, str]] = (),
) -> None:
    """Raise the first problem of a request that needs no model to find (ValueError, FileNotFoundError,
    ...), checking the labels, the parameters, the layers, the folders, the data, then the checkpoints.

    Args:
        params: ``(analysis, its parameter dataclass)`` per analysis run, each built as it is read (a
            dataclass checks itself, e.g. ``words``), its ``max_length`` need checked then (`Spec.min_length`).
        checkpoints: the checkpoints' paths or hub ids.
        labels: one per checkpoint, unique (None: the folder names, which must be unique).
        load: whether the checkpoints are loaded as models: then each local one is checked
            (`lime_probe.extraction.sources.check_local`), and a ``window`` that differs from its analysis's
            default against the positions its config.json states.
        max_length: tokens per sequence (None: the default).
        layers: the extraction's layers as text (`layer_list`; None: all).
        folders: ``{option: folder}`` written into (``lime_model.files.check_writable``).
        texts: a local text source (`lime_model.data.check_source`; a hub spec is the hub's to answer).
        pairs: a JSONL file of prompt pairs (`lime_probe.interventions.pairs.load_pairs`).
        blimp: ``(option, source)`` of each BLiMP source read.
    """
    from lime_model.data import check_source

    if labels:
        labels_for(checkpoints, labels)
    windows = set()  # the windows given, checked against each local checkpoint's positions below
    for name, p in params:
        window = getattr(p, "window", None)
        if window != getattr(ANALYSES[name].params(), "window", None):  # a default is the analysis's to fit
            windows.add(window)
        if max_length is not None and max_length < ANALYSES[name].min_length:
            raise ValueError(
                f"--max-length {max_length}: {name} needs at least {ANALYSES[name].min_length} tokens "
                "per sequence"
            )
    layer_list(layers)
    for option, folder in (folders or {}).items():
        check_writable(folder, folder=True, option=option)
    if texts is not None:
        check_source(texts)
    if pairs is not None:
        load_pairs(pairs)
    for option, source in blimp:
        check_blimp_source(source, option)
    if load:  # a local checkpoint; a hub id is the hub's to answer, when it is loaded
        for ckpt, label in zip(checkpoints, labels_for(checkpoints, labels), strict=True):
            if not is_hub_id(ckpt):
                check_local(Path(ckpt).expanduser())
                for window in windows:
                    check_window(window, read_config(Path(ckpt).expanduser()), label)
