"""The collapse metrics against Skean et al.'s own code, on the same seeded inputs.

The reference is the user's checkout of Skean et al.'s information_flow repository (its
`experiments/utils/metrics/metric_functions.py`), of `repitl` (representation-itl, the matrix entropies it
calls) and, for TwoNN, of dadapy (an installed `dadapy`, or an unpacked sdist given with `--dadapy`; its
Cython parts are not needed for `compute_id_2NN`, so the sdist is read without building it). Nothing is
downloaded; nothing from them is copied here.

    python bench/collapse_reference.py --information-flow DIR --repitl DIR [--dadapy DIR]

Prints one row per metric and input: ours, theirs and the relative difference |ours - theirs| / |theirs|,
then the largest relative difference per metric. Where a metric differs by design the row says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from lime_model.command_line import OneLineParser
from lime_probe.probes.collapse import center_l2, curvature, dataset_entropy, intrinsic_dimension, lidar
from lime_probe.probes.entropy import layer_entropy

REFERENCE_FILE = Path("experiments/utils/metrics/metric_functions.py")


def fail(message: str) -> NoReturn:
    """Bad input: one line on stderr, exit code 2."""
    print(f"collapse_reference: {message}", file=sys.stderr)
    raise SystemExit(2)


def _package(name: str, folder: Path) -> types.ModuleType:
    """An empty package `name` whose submodules load from `folder`, its __init__ not run (dadapy's imports
    its compiled and jax parts)."""
    module = types.ModuleType(name)
    module.__path__ = [str(folder)]
    sys.modules[name] = module
    return module


def load_reference(
    information_flow: Path, repitl: Path, dadapy: Path | None
) -> tuple[types.ModuleType, bool]:
    """Skean et al.'s `metric_functions` module, and whether dadapy's TwoNN is available to it."""
    src = repitl / "src" if (repitl / "src" / "repitl").is_dir() else repitl
    if not (src / "repitl" / "matrix_itl.py").is_file():
        fail(f"--repitl: no repitl/matrix_itl.py under {repitl}")
    sys.path.insert(0, str(src))
    have_twonn = True
    if dadapy is not None:
        _package("dadapy", dadapy / "dadapy")
        data = types.ModuleType("dadapy.data")
        data.Data = importlib.import_module("dadapy.id_estimation").IdEstimation  # type: ignore[attr-defined]
        sys.modules["dadapy.data"] = data
    elif importlib.util.find_spec("dadapy") is None:
        _package("dadapy", Path("/nonexistent"))
        sys.modules["dadapy.data"] = types.ModuleType("dadapy.data")
        sys.modules["dadapy.data"].Data = None  # type: ignore[attr-defined]
        have_twonn = False
    path = information_flow / REFERENCE_FILE
    if not path.is_file():
        fail(f"--information-flow: no {REFERENCE_FILE} under {information_flow}")
    spec = importlib.util.spec_from_file_location("information_flow_metrics", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, have_twonn


def twonn_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Point clouds (n, d): a plane in 50-D, Gaussians of 2, 5 and 10 dims in 30-D, a uniform 20-D cube."""
    plane = rng.normal(size=(400, 2)) @ rng.normal(size=(2, 50))
    out = {"plane in 50-D": plane}
    for k in (2, 5, 10):
        out[f"Gaussian {k}-D in 30-D"] = np.pad(rng.normal(size=(400, k)), ((0, 0), (0, 30 - k)))
    out["uniform cube 20-D"] = rng.uniform(size=(400, 20))
    return out


def sequences(rng: np.random.Generator, n: int, t: int, d: int) -> list[torch.Tensor]:
    """n token sequences (t, d) with a few dominant directions (a collapsed-looking spectrum)."""
    scale = torch.tensor(np.geomspace(1.0, 0.01, d))
    return [torch.tensor(rng.normal(size=(t, d))) * scale for _ in range(n)]


def rows(ref: types.ModuleType, have_twonn: bool, seed: int) -> list[tuple[str, str, float, float, str]]:
    """(metric, input, ours, theirs, note) for every comparison."""
    out: list[tuple[str, str, float, float, str]] = []
    if have_twonn:
        for name, X in twonn_inputs(np.random.default_rng([seed, 0])).items():
            theirs = float(ref.ID_DATA(X).compute_id_2NN()[0])
            out.append(("TwoNN (fit)", name, intrinsic_dimension(X), theirs, ""))
            mle = float(ref.ID_DATA(X).compute_id_2NN(algorithm="ml")[0])
            n = len(X)
            out.append(
                (
                    "TwoNN (mle)",
                    name,
                    intrinsic_dimension(X, "mle"),
                    mle,
                    f"by design: N/sum vs (N-1)/sum, x{n / (n - 1):.4f}",
                )
            )

    def theirs_entropy(Z: torch.Tensor, alpha: float) -> float:
        return float(ref.compute_entropy(Z[None], alpha=alpha, normalizations=["raw"])["raw"][0])

    rng = np.random.default_rng([seed, 1])  # the same inputs with or without TwoNN
    for t, d in ((16, 64), (96, 32)):
        (z,) = sequences(rng, 1, t, d)
        for alpha in (1.0, 2.0):
            ours = float(layer_entropy([z], "layer-by-layer", alpha=alpha).values[0])
            # repitl's alpha=2 shortcut takes tr(K^2) / n^2, right only for tr K = n, after their K / tr K
            note = f"theirs = ours + 2 log n: {ours + 2 * math.log(min(t, d)):.8f}" if alpha == 2 else ""
            out.append(
                (
                    f"prompt entropy a={alpha:g}",
                    f"t={t}, d={d}",
                    ours,
                    theirs_entropy(center_l2(z), alpha),
                    note,
                )
            )

    for n, d in ((24, 64), (80, 16)):
        seqs = sequences(rng, n, 12, d)
        pooled = torch.stack([center_l2(z).mean(0) for z in seqs])
        out.append(
            ("dataset entropy", f"N={n}, d={d}", dataset_entropy(seqs), theirs_entropy(pooled, 1.0), "")
        )

    for t, d in ((20, 8), (40, 64)):
        z = torch.tensor(rng.normal(size=(t, d))).cumsum(0)
        theirs = float(ref.compute_curvature(z[None])["raw"][0])
        out.append(("curvature (absolute)", f"t={t}, d={d}", curvature(z, absolute=True), theirs, ""))
        out.append(
            ("curvature", f"t={t}, d={d}", curvature(z), theirs, "by design: arccos cos, not arccos |cos|")
        )

    for n, a, d in ((30, 4, 8), (12, 6, 24)):
        centers = rng.normal(size=(n, 1, d))
        views = torch.tensor(centers + 0.3 * rng.normal(size=(n, a, d)))
        as_run = float(ref.compute_lidar(views[None], normalizations=["raw"])["raw"][0])
        # their scatter sums start from torch.zeros, float32 under the default dtype
        torch.set_default_dtype(torch.float64)
        theirs = float(ref.compute_lidar(views[None], normalizations=["raw"])["raw"][0])
        torch.set_default_dtype(torch.float32)
        ours = lidar(views)
        out.append(("LiDAR entropy", f"N={n}, A={a}, d={d}", ours, theirs, ""))
        out.append(
            ("LiDAR entropy", f"N={n}, A={a}, d={d}", ours, as_run, "theirs as run: float32 scatter sums")
        )
    return out


def relative(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / max(abs(theirs), 1e-300)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--information-flow", type=Path, required=True, help="a checkout of information_flow")
    parser.add_argument("--repitl", type=Path, required=True, help="a checkout of representation-itl")
    parser.add_argument("--dadapy", type=Path, help="an unpacked dadapy sdist (else an installed dadapy)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ref, have_twonn = load_reference(args.information_flow, args.repitl, args.dadapy)
    if not have_twonn:
        print("dadapy not found: TwoNN left out (install it or pass --dadapy)")
    results = rows(ref, have_twonn, args.seed)
    print(f"{'metric':<22} {'input':<24} {'ours':>14} {'theirs':>14} {'rel diff':>9}  note")
    worst: dict[str, float] = {}
    for metric, name, ours, theirs, note in results:
        rel = relative(ours, theirs)
        if not note:
            worst[metric] = max(worst.get(metric, 0.0), rel)
        print(f"{metric:<22} {name:<24} {ours:>14.8f} {theirs:>14.8f} {rel:>9.1e}  {note}")
    print("\nlargest relative difference where the definitions agree:")
    for metric, rel in worst.items():
        print(f"  {metric:<22} {rel:.1e}")
    if any(not math.isfinite(r) for r in worst.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
