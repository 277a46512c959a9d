"""The analyses, one `Spec` each, by command name: the single list the CLI, ``report``, the demo, the
notebooks and the tests read.

    from lime_probe.analyses import ANALYSES, load_checkpoints
    spec = ANALYSES["entropy"]
    cks = load_checkpoints(["runs/lime", "runs/llama"], ["LIMe", "LLaMA"], device="cpu")
    result = spec.run(cks, texts, extract_kw={"max_length": 256}, site="values")   # numbers only
    result.rows, result.table()                      # tidy rows, the compact table
    figures = spec.plot(result)                      # {file stem: matplotlib Figure}

Adding an analysis: a module here with its parameter dataclass, ``compute``, ``plot`` and ``SPEC``, one
line below, a test and a notebook in analyses/. Importing this package imports no probe, model or
plotting library.
"""

from __future__ import annotations

from . import blimp, cka, entropy, router, separability, training, tsne
from .base import Checkpoint, Result, Spec, labels_for, load_checkpoints, named_checkpoints

ANALYSES: dict[str, Spec] = {
    s.name: s
    for s in (
        entropy.SPEC,
        separability.SPEC,
        tsne.SPEC,
        blimp.SPEC,
        cka.SPEC,
        router.SPEC,
        training.CURVES,
        training.ACCURACY,
    )
}

__all__ = ["ANALYSES", "Checkpoint", "Result", "Spec", "labels_for", "load_checkpoints", "named_checkpoints"]
