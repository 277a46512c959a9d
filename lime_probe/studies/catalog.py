"""The studies this repository runs, each a declaration (`Study`); ``lime-probe reproduce --study NAME``.

Each study's protocol, written before its runs, is in its results folder under figures/; its claims are
that protocol's endpoints. The declarations live by family: lm_cpu.py (the paper's language-model
findings at CPU scale), sweep.py and sweep_extension.py (the learning-rate sweep), lm_tuned.py (the
studies at its chosen setting), reads.py (route ablation), upcycling.py, lime_150m.py (the 150M study on
GPUs), arithmetic.py (the Arithmetic Expression Task); this module registers them.
"""

from __future__ import annotations

from dataclasses import replace

from .arithmetic import ARITHMETIC_DOSE_RESPONSE, ARITHMETIC_KV_INIT, ARITHMETIC_SEEDS
from .lime_150m import LIME_150M
from .lm_cpu import LM_CPU, LM_CPU_10_SEEDS, LM_CPU_BASELINES, LM_CPU_KV_INIT
from .lm_tuned import LM_CPU_FAIR, LM_CPU_FAIR_INTERIOR
from .reads import ROUTE_ABLATION
from .study import Study
from .sweep import LR_SWEEP
from .sweep_extension import LR_SWEEP_EXT
from .upcycling import UPCYCLING

# Studies whose committed results were trained before the reproducible mode existed: they run without it,
# so that their finished runs are reused (a run is reused only in the mode it was trained in). Every study
# declared after the mode runs in it.
BEFORE_THE_MODE = frozenset(
    {
        "lm-cpu",
        "lm-cpu-baselines",
        "lm-cpu-kv-init",
        "lm-cpu-10-seeds",
        "lm-cpu-lr-sweep",
        "lm-cpu-fair",
        "arithmetic-seeds",
        "arithmetic-kv-init",
    }
)

# Studies trained on GPUs by `accelerate launch` (their folder's run.sh), outside the mode: it pins CPU
# kernels and one thread, and makes CUDA's algorithms deterministic at a cost the study does not need.
ON_GPUS = frozenset({"lime-150m"})

STUDIES: dict[str, Study] = {
    s.name: replace(s, reproducible=s.name not in BEFORE_THE_MODE | ON_GPUS)
    for s in (
        LM_CPU,
        LM_CPU_BASELINES,
        LM_CPU_KV_INIT,
        LM_CPU_10_SEEDS,
        LR_SWEEP,
        LR_SWEEP_EXT,
        LM_CPU_FAIR,
        LM_CPU_FAIR_INTERIOR,
        ROUTE_ABLATION,
        LIME_150M,
        UPCYCLING,
        ARITHMETIC_SEEDS,
        ARITHMETIC_KV_INIT,
        ARITHMETIC_DOSE_RESPONSE,
    )
}
