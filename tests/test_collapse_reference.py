"""TwoNN (`lime_probe.probes.collapse.intrinsic_dimension`) against dadapy's ``Data(X).compute_id_2NN()``,
the estimator Skean et al.'s code calls; skipped where dadapy is not installed.

The settings that match: dadapy's defaults, ``algorithm="base"`` (a least-squares line through the origin,
scipy's ``curve_fit`` of y = m x) with ``mu_fraction=0.9`` against our ``method="fit"`` with
``discard=0.1`` (both keep the ``int(0.9 N)`` smallest mu and fit -log(1 - i / N) on log mu_(i), N counting
every mu), and ``data_fraction=1`` (all points, no subsampling). dadapy keeps identical points (their mu is
infinite or NaN, with a warning) where we drop them, so the inputs have none. Its ``algorithm="ml"`` is
(N - 1) / sum log mu, ours N / sum log mu: the MLE differs by design by the factor N / (N - 1).
"""

from __future__ import annotations

import numpy as np
import pytest

from lime_probe.probes.collapse import intrinsic_dimension

dadapy_data = pytest.importorskip("dadapy.data")


def point_clouds() -> dict[str, np.ndarray]:
    """(n, d) inputs: a plane in 50-D, Gaussians of 2, 5 and 10 dims in 30-D, a uniform 20-D cube."""
    rng = np.random.default_rng(0)
    out = {"plane": rng.normal(size=(300, 2)) @ rng.normal(size=(2, 50))}
    for k in (2, 5, 10):
        out[f"gaussian{k}"] = np.pad(rng.normal(size=(300, k)), ((0, 0), (0, 30 - k)))
    out["cube"] = rng.uniform(size=(300, 20))
    return out


@pytest.mark.parametrize("name", list(point_clouds()))
def test_twonn_fit_equals_dadapy(name):
    X = point_clouds()[name]
    theirs, _, _ = dadapy_data.Data(X).compute_id_2NN()
    assert intrinsic_dimension(X, "fit") == pytest.approx(theirs, rel=1e-8)


def test_twonn_mle_is_dadapys_times_n_over_n_minus_1():
    X = point_clouds()["gaussian5"]
    theirs, _, _ = dadapy_data.Data(X).compute_id_2NN(algorithm="ml")
    assert intrinsic_dimension(X, "mle") == pytest.approx(theirs * len(X) / (len(X) - 1), rel=1e-10)
