"""The reproducible mode: one numerical code path for every Intel x86-64 machine with AVX2, whatever else.

On one thread, a CPU run's bits still depend on the machine: MKL, oneDNN, PyTorch's own kernels and the
openBLAS that NumPy and SciPy bundle each pick their instruction set (and with it the order of
floating-point operations) per CPU, so AVX-512 and AVX2 hosts of the same seed diverge. The mode pins each
of them to AVX2, the highest set every AMD EPYC and Intel Xeon since 2015 has, plus one thread and
PyTorch's deterministic algorithms:

    MKL_CBWR=AVX2,STRICT     MKL's conditional numerical reproducibility on its AVX2 branch. COMPATIBLE
                             (the SSE2 branch) is identical on any x86-64 too but slows GEMMs several
                             times over (bench/RESULTS.md); AVX2 cost nothing measurable.
                             STRICT: the bitwise variant of its level-3 BLAS (GEMM), at no measured cost.
    ONEDNN_MAX_CPU_ISA=AVX2  oneDNN's kernels (convolutions, some matmuls) capped at AVX2.
    ATEN_CPU_CAPABILITY=avx2 PyTorch's vectorised kernels (softmax, norms, reductions) on their AVX2 build,
                             not AVX-512 where the CPU has it; "default" (no vector extensions) would also
                             pin them but is slower for nothing on machines that all have AVX2.
    OPENBLAS_CORETYPE=Haswell
                             NumPy's and SciPy's openBLAS (t-SNE, scikit-learn's probes) on its AVX2
                             kernels; it would take its SkylakeX (AVX-512) or Zen ones where it finds them.
    OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1)
                             reductions split over threads sum in another order (each library's own
                             variable, so that one left in the shell cannot override the mode's).
    torch.use_deterministic_algorithms(True)
                             refuses (with an error) an operation that has no deterministic implementation.

The libraries read their variables once, when torch or NumPy loads them, so ``enable`` must run
before the first ``import torch`` or ``import numpy``; the programs do it first thing in their commands.
A library user's ``import lime_model`` loads torch (it registers the Auto classes), so a script enters
the mode by starting Python with ``LIME_REPRODUCIBLE=1``: the package then calls ``enable`` before
anything else. In a process where torch or NumPy is already loaded, ``enable`` checks that the
variables were set beforehand (a parent process, a shell) and otherwise raises ``ModeError``: the
mode cannot take effect there.

Which processors the promise covers: Intel ones with AVX2. MKL honours ``MKL_CBWR`` on Intel processors
only; on AMD ones it ignores the pin and picks its code path by the CPU, as without the mode (its
``MKL_VERBOSE=1`` log shows ``CNR:AUTO`` there, ``CNR:AVX2,STRICT`` on Intel), so the MKL operations of
a run on an AMD machine (torch's CPU matrix products among them) may differ in their last bits from an
Intel one's, and between AMD generations. The other pins hold on both.

Tested by training twice under different ISA settings on one machine (``tests/test_reproducible.py``):
bit-identical weights in the mode, different ones without it; and in a new process, that openBLAS runs
its Haswell kernels and MKL its AVX2 branch (``CNR:AUTO`` on an AMD processor). That is what it shows;
other Intel machines are expected, not shown, to agree.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

# The variables the mode sets before torch and NumPy load (see the module doc for why each value).
PINNED: dict[str, str] = {
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_CORETYPE": "Haswell",
    "OPENBLAS_NUM_THREADS": "1",
}
LOADERS = ("torch", "numpy")  # the modules whose loading reads the pins (MKL, oneDNN, ATen; openBLAS)
CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() reports under ATEN_CPU_CAPABILITY=avx2


class ModeError(ValueError):
    """The reproducible mode was asked for where it cannot take effect: a usage error (one line, exit 2)."""


def pin() -> None:
    """Set ``PINNED`` in the environment while neither torch nor NumPy is loaded (each reads it as it
    loads); a program calls it before its input checks, which may load NumPy, and ``enable`` after."""
    if not any(name in sys.modules for name in LOADERS):
        os.environ.update(PINNED)


def enable() -> None:
    """Enter the reproducible mode: ``pin``, then one torch thread and deterministic algorithms.
    Raises ``ModeError`` if torch or NumPy was loaded without the pins, or on a CPU without AVX2."""
    pin()
    unset = {k: v for k, v in PINNED.items() if os.environ.get(k) != v}
    if unset:
        loaded = next(name for name in LOADERS if name in sys.modules)
        raise ModeError(
            f"the reproducible mode cannot take effect: {loaded} was imported before it could set "
            + ", ".join(f"{k}={v}" for k, v in unset.items())
            + " (run the command in a new process, or set them before starting Python)"
        )
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability != CAPABILITY:  # a CPU without AVX2: torch falls back and the pinned path is not taken
        raise ModeError(f"the reproducible mode needs a CPU with AVX2; torch reports capability {capability}")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def active() -> bool:
    """Whether this process runs in the mode: the pins in the environment, torch on them, one thread,
    deterministic algorithms."""
    if "torch" not in sys.modules or any(os.environ.get(k) != v for k, v in PINNED.items()):
        return False
    import torch

    return (
        torch.backends.cpu.get_cpu_capability() == CAPABILITY
        and torch.get_num_threads() == 1
        and torch.are_deterministic_algorithms_enabled()
    )


def processor() -> str:
    """The CPU's vendor and model as Linux names them ("GenuineIntel, Intel(R) Xeon(R) ..."), else what
    `platform` knows: MKL keeps its pin on Intel processors only, so a run's bits depend on it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in reversed(lines))}
    return ", ".join(fields[k] for k in ("vendor_id", "model name") if k in fields)  # the first CPU's


def settings() -> dict[str, Any]:
    """What a run records: the mode, the pinned variables' values (None: unset), the processor, torch's
    CPU capability, threads and the deterministic flag, as this process has them."""
    import torch

    return {
        "reproducible": active(),
        "env": {k: os.environ.get(k) for k in PINNED},
        "processor": processor(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def run_mode(run_dir: str | os.PathLike) -> bool | None:
    """Whether the run in ``run_dir`` was trained in the mode: True when every start of it recorded the
    mode in ``run_info.json``; False otherwise (a run from before the mode existed records nothing: not
    reproducible); None when there is no run there."""
    path = Path(run_dir) / "run_info.json"
    if not path.is_file():
        return None
    starts = json.loads(path.read_text())
    return bool(starts) and all(s.get("reproducible", {}).get("reproducible") is True for s in starts)


def check_same_mode(run_dir: str | os.PathLike, reproducible: bool) -> None:
    """Refuse (one-line ValueError) to reuse or continue the run in ``run_dir`` in the other mode."""
    mode = run_mode(run_dir)
    if mode is not None and mode != reproducible:

        def name(on: bool) -> str:
            return "in the reproducible mode" if on else "without the reproducible mode"

        raise ValueError(
            f"{run_dir} was trained {name(mode)}, this process runs {name(reproducible)}: train into "
            f"another folder, or run {'with --reproducible' if mode else 'with --no-reproducible'}"
        )


def describe(info: dict[str, Any]) -> str:
    """One line for the model card from a ``settings`` record."""
    if info.get("reproducible"):
        pins = ", ".join(f"{k}={v}" for k, v in info["env"].items())
        return f"reproducible mode: on ({pins}; torch CPU capability {info['cpu_capability']}, deterministic algorithms)"
    return (
        f"reproducible mode: off (torch CPU capability {info.get('cpu_capability', '?')}, "
        f"{info.get('torch_threads', '?')} thread(s))"
    )
