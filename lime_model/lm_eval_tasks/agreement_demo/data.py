"""The agreement_demo task's data: the JSONL beside this file (a path relative to it, not the cwd)."""

from pathlib import Path

import datasets


def load(**kwargs) -> datasets.DatasetDict:
    """``{"test": rows of {question, choices, label}}``; lm-eval passes the task's metadata as kwargs."""
    path = Path(__file__).with_name("agreement_demo.jsonl")
    return datasets.load_dataset("json", data_files={"test": str(path)})
