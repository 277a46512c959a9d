"""The settings of the notebooks in ``analyses/``: the matching command's defaults, overridden by ``LIME_*``
environment variables, with paths read the way the shell that set them reads them.

    from lime_probe.notebook import command_defaults, env_path, env_paths, repo_root
    D = command_defaults("entropy")        # {"site": None, "max_sequences": 4000, "max_length": 256, ...}
    CKPTS = env_paths("LIME_CKPTS", [f"{repo_root()}/runs/lime"])
    DATA = env_path("LIME_DATA", "hf:Salesforce/wikitext:wikitext-2-raw-v1:validation")

Jupyter (and ``jupyter nbconvert --execute``, papermill) run a notebook's kernel in the notebook's own
folder, ``analyses/``, while the user typed ``LIME_DATA=data/valid.txt`` in the folder they launched it
from. That folder is ``$PWD``: the shell sets it and the kernel inherits it, its working folder changed
by Jupyter but its environment not. So a relative path given in a variable is read from ``$PWD`` (as
every command-line tool reads it); the shipped defaults name the repository's own files, from its root.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def launch_dir() -> Path:
    """The folder the user launched Jupyter from: ``$PWD`` where it names a folder, else the current one."""
    pwd = os.environ.get("PWD", "")
    return Path(pwd) if pwd and Path(pwd).is_dir() else Path.cwd()


def repo_root() -> Path:
    """The repository root, whether the kernel runs there or in ``analyses/`` (as Jupyter does)."""
    here = Path.cwd()
    return here.parent if here.name == "analyses" else here


def from_launch_dir(value: str) -> str:
    """``value`` as the user meant it: a relative path that exists from `launch_dir` made absolute;
    anything else (an absolute path, a hub id such as ``gpt2``, ``hf:NAME``, a missing path, which the
    loader then names in its error) unchanged."""
    if not value or value.startswith("hf:") or Path(value).is_absolute():
        return value
    there = launch_dir() / value
    return str(there.resolve()) if there.exists() else value


def env_path(name: str, default: str) -> str:
    """The path in environment variable ``name`` (read from `launch_dir`), else ``default``."""
    return from_launch_dir(os.environ[name]) if name in os.environ else default


def env_paths(name: str, default: list[str]) -> list[str]:
    """The comma-separated paths or hub ids in environment variable ``name`` (each read from
    `launch_dir`), else ``default``."""
    return [from_launch_dir(v) for v in os.environ[name].split(",")] if name in os.environ else default


def command_defaults(command: str) -> dict[str, Any]:
    """The settings ``lime-probe COMMAND`` measures with when no option is given, built from the dataclasses
    its options are generated from: how it loads (`Loading`: ``device``, ``dtype``, ...) and extracts
    (`Extraction`: ``max_length``, ``max_tokens``, ...), ``max_sequences`` where it reads texts, and the
    analysis's parameters; so a notebook measures what the command measures: ``{field: default}``."""
    from dataclasses import asdict

    from lime_probe.extraction.settings import Extraction, Loading, command_settings
    from lime_probe.specs import ANALYSES
    from lime_probe.specs.data import DATA_KINDS

    if command not in ANALYSES:
        raise ValueError(f"unknown analysis {command!r}; choose one of {', '.join(ANALYSES)}")
    spec = ANALYSES[command]
    kind = DATA_KINDS[spec.data_kind]
    settings = [command_settings(Loading), command_settings(Extraction)] if kind.option is not None else []
    sizes = {"max_sequences": spec.max_sequences} if kind.texts else {}
    # an analysis's own `layers` parameter (BLiMP's) wins over the extraction's
    return {k: v for s in settings for k, v in asdict(s).items()} | sizes | asdict(spec.params())
