"""Layer 5, runs of many analyses over many checkpoints: the seeded studies and the embedded demo.

A study is a declaration (`Study`: models, seeds, measures as analyses of the registry with their
parameters, pre-registered claims); `run_study` is the one runner. ``STUDIES`` holds this repository's,
``lime-probe reproduce --study NAME`` runs one. Importing this package imports no model code.
"""

from .catalog import STUDIES
from .runner import run_study
from .study import Claim, Effect, Endpoint, Measure, Selection, Study

__all__ = ["STUDIES", "Claim", "Effect", "Endpoint", "Measure", "Selection", "Study", "run_study"]
