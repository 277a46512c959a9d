"""Clean/corrupt prompt pairs, the input of activation patching, read from JSONL; imports nothing heavy, so
the command line checks a pairs file before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FIELDS = ("clean", "corrupt", "answer", "wrong")


@dataclass(frozen=True)
class Pair:
    """A clean and a corrupt prompt (texts, or token id lists used as they are; equal token lengths) and the
    answer / wrong-answer tokens (a text that is one token, or its id)."""

    clean: str | list[int]
    corrupt: str | list[int]
    answer: str | int
    wrong: str | int


def load_pairs(path: str | Path) -> list[Pair]:
    """The pairs of a JSONL file, one object a line with "clean", "corrupt", "answer" and "wrong" (blank lines
    skipped); ValueError in one line naming the file and line of anything else."""
    from lime_model.data import jsonl_records  # here: it loads NumPy, which the command line defers

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--pairs {path}: no such file (a JSONL file of clean/corrupt pairs)")
    pairs = []
    for n, row in jsonl_records(path):
        missing = [k for k in FIELDS if k not in row]
        if missing:
            raise ValueError(
                f"{path}:{n}: a pair needs the fields {', '.join(FIELDS)}; missing {', '.join(missing)}"
            )
        if not all(_prompt(row[k]) for k in ("clean", "corrupt")):
            raise ValueError(f"{path}:{n}: clean and corrupt must be non-empty strings or token id lists")
        for k in ("answer", "wrong"):
            if not isinstance(row[k], (str, int)) or isinstance(row[k], bool) or row[k] == "":
                raise ValueError(f"{path}:{n}: {k} must be a one-token string or a token id")
        pairs.append(Pair(row["clean"], row["corrupt"], row["answer"], row["wrong"]))
    if not pairs:
        raise ValueError(f"{path}: holds no pairs")
    return pairs


def _prompt(value: object) -> bool:
    """Whether `value` is a prompt: a non-empty string or list of token ids."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    return isinstance(value, str) and bool(value)
