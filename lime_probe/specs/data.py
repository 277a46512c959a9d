"""The one reader of an analysis's data, by its `Spec.data_kind`: texts (a .txt/.jsonl/.parquet file or
folder, or ``hf:NAME[:CONFIG][:SPLIT]``), a BLiMP dataset (a folder, one file or the hub id), clean/corrupt
prompt pairs, or nothing. The command line, ``report``, the studies and a user's script all read their
data through `load_data`; `DATA_KINDS` says how the command line offers each kind.

    from lime_probe.specs.blimp import BlimpParams
    from lime_probe.specs.data import load_data
    texts = load_data("texts", "data/wikitext-2/valid.txt", max_sequences=64)   # list of str
    blimp = load_data("blimp", "data/blimp", params=BlimpParams(tasks="all"))   # a datasets.Dataset

Importing it imports nothing heavy: each reader imports what it needs when it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import DataKind as Kind


@dataclass(frozen=True)
class DataKind:
    """How the analyses of one ``Spec.data_kind`` take their data on the command line.

    ``option``: the argparse keywords of their data option ``flag`` (None: they read only the run folders).
    ``texts``: documents, cut by ``--max-sequences`` (``report`` reads them once for all its sections).
    ``report``: ``report``'s own option for this data, ``(flag, keywords)``, where it is not report's
    ``--data`` (BLiMP: ``--blimp``)."""

    option: dict | None = None
    texts: bool = False
    report: tuple[str, dict] | None = None
    flag: str = "--data"


TEXTS_HELP = "a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG][:SPLIT]"
BLIMP_HUB_ID = "nyu-mll/blimp"  # lime_probe.probes.blimp.HUB_ID, which imports torch
BLIMP_HELP = f"a folder of BLiMP <paradigm>.jsonl files, one .jsonl file, or the hub id {BLIMP_HUB_ID}"
DATA_KINDS: dict[str, DataKind] = {
    "texts": DataKind({"required": True, "metavar": "SPEC", "help": TEXTS_HELP}, texts=True),
    "optional-texts": DataKind(
        {"metavar": "SPEC", "help": TEXTS_HELP + " (only for routing 'dynamic')"}, texts=True
    ),
    "blimp": DataKind(
        {
            "default": BLIMP_HUB_ID,
            "metavar": "SPEC",
            "help": BLIMP_HELP + " (default: %(default)s, needs a network)",
        },
        report=(
            "--blimp",
            {
                "default": None,
                "metavar": "SPEC",
                "help": "add the BLiMP section: " + BLIMP_HELP + "; its layers are the paper's range unless "
                "--layers is given (default: no BLiMP section)",
            },
        ),
    ),
    "pairs": DataKind(
        {
            "required": True,
            "metavar": "FILE",
            "help": "a JSONL file of clean/corrupt prompt pairs, one object a "
            'line: {"clean": ..., "corrupt": ..., "answer": ..., "wrong": ...} (equal token lengths, one-token answers)',
        },
        flag="--pairs",
    ),  # fmt: skip
    "none": DataKind(),
}


def check_blimp_source(source: str, option: str) -> None:
    """FileNotFoundError in one line unless `source` is the hub id or a local BLiMP .jsonl file, or a folder
    holding some (what `lime_probe.probes.blimp.load_blimp` reads), checked before torch loads."""
    path = Path(source).expanduser()
    if source == BLIMP_HUB_ID and not path.exists():
        return
    if not path.exists():
        raise FileNotFoundError(f"{option} {source}: no such file or folder ({BLIMP_HELP})")
    if path.is_dir() and not any(path.glob("*.jsonl")):
        raise FileNotFoundError(f"{option} {source}: the folder holds no .jsonl file ({BLIMP_HELP})")
    if path.is_file() and path.suffix != ".jsonl":
        raise ValueError(f"{option} {source}: not a .jsonl file ({BLIMP_HELP})")


def load_data(
    kind: Kind,
    source: str | os.PathLike | None,
    max_sequences: int | None = None,
    *,
    params: Any = None,
    lazy: bool = False,
    option: str | None = None,
) -> Any:
    """The data of ``source`` as the analyses of data kind ``kind`` take it.

    Args:
        kind: a key of `DATA_KINDS` (a `Spec.data_kind`).
        source: texts: a .txt/.jsonl/.parquet file or folder, or ``hf:NAME[:CONFIG][:SPLIT]``; BLiMP: a
            folder of ``<paradigm>.jsonl`` files, one such file, or the hub id `BLIMP_HUB_ID`; pairs: a
            JSONL file of clean/corrupt pairs; None: no data (None returned).
        max_sequences: texts only: the first this many documents (None: all).
        params: BLiMP only: the analysis's parameters, whose paradigms are read (None: BLiMP's defaults).
        lazy: texts only: a `Corpus` read as the analysis goes (its files are checked now) instead of a list.
        option: the option ``source`` came from, for the one-line errors (default: the kind's own flag).

    Returns:
        texts: a list of documents (or a `Corpus`); BLiMP: ``load_blimp``'s ``datasets.Dataset`` of minimal
        pairs; pairs: ``load_pairs``'s list of `Pair`; kind ``"none"``: None.

    Raises:
        FileNotFoundError, ValueError: in one line, for a source that is missing, malformed, or on the hub
            when the hub cannot give it.
    """
    option = option or DATA_KINDS[kind].flag
    if source is None:
        return None
    source = str(source)
    if DATA_KINDS[kind].texts:
        return _texts(source, max_sequences, lazy, option)
    if kind == "blimp":
        return _blimp(source, params, option)
    if kind == "pairs":
        from lime_probe.interventions.pairs import load_pairs

        return load_pairs(source)
    return None


def _texts(source: str, max_texts: int | None, lazy: bool, option: str) -> Iterable[str]:
    """The first ``max_texts`` documents of ``source`` (see `load_data`); an ``hf:`` spec the hub cannot
    give fails at once in one line."""
    from lime_model.data import data_files

    name = source[len("hf:") :].split(":")[0] if source.startswith("hf:") else ""
    if name:
        from lime_probe.extraction.loading import hub_dataset

        with hub_dataset(name, f"{option} {source}", "pass a local .txt/.jsonl/.parquet file or folder"):
            return _read(source, max_texts, lazy)
    if lazy:
        data_files(source)  # a missing or unsupported file fails now, not mid-analysis
    return _read(source, max_texts, lazy)


def _read(source: str, max_texts: int | None, lazy: bool) -> Iterable[str]:
    """The documents of ``source``: a list, or with ``lazy`` a `Corpus` that reads them as it is iterated."""
    if not lazy:
        from lime_model.data import load_texts

        return load_texts(source, max_texts=max_texts)
    from lime_probe.extraction.tracing import Corpus

    return Corpus(source, max_texts)


def _blimp(source: str, params: Any, option: str) -> Any:
    """The BLiMP data of ``source`` for ``params``; the hub id fails at once in one line when the hub cannot
    give it."""
    from lime_probe.extraction.loading import hub_dataset
    from lime_probe.probes.blimp import HUB_ID, load_blimp
    from lime_probe.specs.blimp import BlimpParams, chosen_paradigms

    paradigms = chosen_paradigms(params if params is not None else BlimpParams())
    if source != HUB_ID or Path(source).exists():
        return load_blimp(source, paradigms)
    fix = f"pass {option} DIR, a folder of BLiMP <paradigm>.jsonl files"
    with hub_dataset(HUB_ID, f"BLiMP data ({HUB_ID})", fix):
        return load_blimp(source, paradigms)
