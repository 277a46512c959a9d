"""Collapse metrics the literature uses beside the matrix entropy (`entropy`) and effective rank (`similarity`).

All computations are in float64; inputs are torch tensors or numpy arrays.

- Intrinsic dimension by TwoNN (Facco et al. 2017, "Estimating the intrinsic dimension of datasets by a
  minimal neighborhood information", Sci. Rep. 7:12140): each point's two nearest-neighbour distances
  r1 <= r2 give mu = r2 / r1, which follows the Pareto law F(mu) = 1 - mu^-d on a d-dimensional manifold.
  ``method="fit"`` (the paper's estimator, as dadapy's ``compute_id_2NN`` that Skean et al.'s code calls):
  the mu sorted ascending, F_emp(mu_(i)) = i / N, the largest 10 % discarded, and d the slope of the line
  through the origin of -log(1 - F_emp) against log mu (least squares). ``method="mle"``: d = N / sum log mu.
  Identical points (r1 = 0) are dropped first.
- Diff-eRank (Wei et al. 2024, "Diff-eRank: A Novel Rank-Based Metric for Evaluating Large Language
  Models", NeurIPS): a sequence's token rows are centred and L2-normalised, Sigma = Z^T Z / t, and its
  effective rank (`similarity.effective_rank` of Sigma: exp of the entropy of its normalised singular
  values) taken; over a dataset the eRank is exp of the mean per-sequence entropy (their dataset script), and
  Diff-eRank = eRank(untrained) - eRank(trained) on the same sequences.
- Curvature (Hosseini & Fedorenko 2023, "Large language models implicitly learn to straighten neural
  sentence trajectories", NeurIPS): for a sequence's token representations z_1..z_t, v_k = z_{k+1} - z_k
  and the curvature is the mean angle between successive v_k, v_{k+1} (radians, in [0, pi]).
  ``absolute=True`` takes arccos |cos|, in [0, pi/2], as Skean et al.'s code does. Pairs where a difference
  vector is zero (a repeated representation) have no angle and are left out.
- Dataset entropy (Skean et al. 2025, "Layer by Layer: Uncovering Hidden Representations in Language
  Models", ICML; their code's "dataset" granularity): each sequence's tokens centred and L2-normalised (as
  the prompt entropy's "layer-by-layer" preset), mean-pooled to one row per sequence, and the matrix entropy
  of those N rows with the Gram matrix's negative entries set to 0 (`entropy.clamped_gram_entropy`).
- LiDAR (Thilak et al. 2024, "LiDAR: Sensing Linear Probing Performance in Joint Embedding SSL
  Architectures", ICLR; as Skean et al. compute it): N samples seen in A augmented views x_ij, class means
  mu_i, grand mean mu; Sigma_b = 1/N sum_i (mu_i - mu)(mu_i - mu)^T, Sigma_w = 1/(N A) sum_ij (x_ij - mu_i)
  (x_ij - mu_i)^T + delta I (delta = 1e-4), Sigma_lidar = Sigma_w^-1/2 Sigma_b Sigma_w^-1/2, and the Renyi
  entropy of its eigenvalues normalised to sum to 1 (Skean et al. report this entropy; Thilak et al.'s
  LiDAR is exp of the Shannon one).
- Angular distance between layers (Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper
  Layers"): d(x, y) = arccos(x . y / (|x| |y|)) / pi, in [0, 1], averaged over rows (tokens) of layer l and
  layer l + n; a small distance means the n blocks between change little (redundant layers).

Angles are taken as 2 atan2(|a - b|, |a + b|) of the unit vectors a, b (Kahan), exact near 0 and pi where
arccos of a rounded cosine is not.

Checked against the reference code on the same seeded inputs (`bench/collapse_reference.py`, numbers in
bench/RESULTS.md): TwoNN's fit against dadapy 0.3.4's ``compute_id_2NN`` (1e-9 relative; its "ml" divides
N - 1, ours N; `tests/test_collapse_reference.py` where dadapy is installed); the prompt and dataset entropies,
curvature with ``absolute=True`` and LiDAR against Skean et al.'s ``metric_functions.py`` with ``repitl``
(1e-15; LiDAR's 1e-6 as they run it is their scatter sums in float32; at alpha = 2 their entropies add
2 log n, repitl's shortcut assuming tr K = n). Diff-eRank and the angular distance have no runnable
reference here: they are checked against their formulas only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from lime_probe.probes.entropy import clamped_gram_entropy, gram_entropy
from lime_probe.probes.similarity import _matrix, effective_rank

Array = torch.Tensor | np.ndarray
# Facco et al.'s fit discards the largest 10 % of mu, where the empirical law is noisiest.
TWONN_DISCARD = 0.1
# Skean et al.'s ridge on the within-class scatter, so that its inverse square root exists.
LIDAR_DELTA = 1e-4


def _unit(X: torch.Tensor) -> torch.Tensor:
    """Rows of X (..., d) divided by their norms (zero rows stay zero)."""
    return X / torch.linalg.vector_norm(X, dim=-1, keepdim=True).clamp_min(torch.finfo(X.dtype).tiny)


def _angles(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Angle in [0, pi] between matching rows of A and B (..., d) -> (...)."""
    a, b = _unit(A), _unit(B)
    return 2 * torch.atan2(torch.linalg.vector_norm(a - b, dim=-1), torch.linalg.vector_norm(a + b, dim=-1))


def center_l2(Z: torch.Tensor) -> torch.Tensor:
    """A sequence's token rows Z (t, d) centred (token mean removed) and L2-normalised -> (t, d); the
    normalisation of Wei et al.'s and Skean et al.'s code (rows of norm 0 stay 0)."""
    Z = Z - Z.mean(-2, keepdim=True)
    return Z / torch.linalg.vector_norm(Z, dim=-1, keepdim=True).clamp_min(1e-12)


def _sequences(seqs: Iterable[Array], name: str, min_tokens: int = 1) -> list[torch.Tensor]:
    out = [_matrix(z, f"{name} {i}", min_tokens) for i, z in enumerate(seqs)]
    if not out:
        raise ValueError(f"{name}: no sequences given")
    if any(z.shape[1] != out[0].shape[1] for z in out):
        raise ValueError(f"{name}: the sequences differ in width")
    return out


def twonn_ratios(X: Array) -> torch.Tensor:
    """mu = r2 / r1 of every distinct row of X (n, d) -> (n_distinct,): its distances to its nearest and second
    nearest other rows."""
    P = torch.unique(_matrix(X, "twonn", 3), dim=0)
    if P.shape[0] < 3:
        raise ValueError(f"twonn: needs at least 3 distinct points, got {P.shape[0]}")
    D = torch.cdist(P, P).fill_diagonal_(math.inf)
    r = D.topk(2, dim=1, largest=False).values
    return r[:, 1] / r[:, 0]


def intrinsic_dimension(X: Array, method: str = "fit", discard: float = TWONN_DISCARD) -> float:
    """TwoNN intrinsic dimension of the point cloud X (n, d) (see the module doc).

    Args:
        X: (n, d) points; identical rows are counted once.
        method: "fit" (Facco et al.'s line through the origin, the largest ``discard`` of mu left out) or
            "mle" (N / sum log mu).
        discard: the fraction of the largest mu the fit leaves out, in [0, 1).
    """
    mu = twonn_ratios(X)
    if method == "mle":
        return float(len(mu) / torch.log(mu).sum())
    if method != "fit":
        raise ValueError(f"twonn: method must be 'fit' or 'mle', got {method!r}")
    if not 0 <= discard < 1:
        raise ValueError(f"twonn: discard must be in [0, 1), got {discard}")
    n = len(mu)
    keep = min(int(n * (1 - discard)), n - 1)  # F_emp = 1 at the largest mu: -log 0
    x = torch.log(mu.sort().values[:keep])
    y = -torch.log1p(-torch.arange(1, keep + 1, dtype=torch.float64) / n)
    return float((x @ y) / (x @ x))


def covariance_erank(Z: Array) -> float:
    """Wei et al.'s effective rank of one sequence Z (t, d): `effective_rank` of the covariance
    Z~^T Z~ / t of its centred, L2-normalised token rows Z~ (through Z~ Z~^T / t when t < d: the same
    non-zero spectrum)."""
    Z = center_l2(_matrix(Z, "covariance_erank"))
    t, d = Z.shape
    return effective_rank((Z @ Z.T if t < d else Z.T @ Z) / t)


def dataset_erank(seqs: Iterable[Array]) -> float:
    """eRank of a dataset of sequences [(t_i, d)]: exp of the mean of log `covariance_erank` (Wei et al.'s
    dataset script averages the entropies, then exponentiates)."""
    seqs = _sequences(seqs, "sequence", 2)
    return math.exp(sum(math.log(covariance_erank(z)) for z in seqs) / len(seqs))


def diff_erank(untrained: Iterable[Array], trained: Iterable[Array]) -> float:
    """Diff-eRank: `dataset_erank` of an untrained model's representations minus that of a trained model's,
    on the same sequences ([(t_i, d)] each, in the same order). Positive: training removed directions."""
    untrained, trained = list(untrained), list(trained)
    if len(untrained) != len(trained):
        raise ValueError(f"diff_erank: {len(untrained)} untrained sequences but {len(trained)} trained")
    return dataset_erank(untrained) - dataset_erank(trained)


def curvature(Z: Array, absolute: bool = False) -> float:
    """Mean angle (radians) between successive difference vectors of the trajectory Z (t, d): NaN when it has
    no pair of non-zero successive differences (fewer than 3 points, or all repeated)."""
    Z = _matrix(Z, "curvature", 1)
    v = Z.diff(dim=0)
    ok = torch.linalg.vector_norm(v, dim=1) > 0
    pair = ok[:-1] & ok[1:]
    if not bool(pair.any()):
        return math.nan
    theta = _angles(v[:-1][pair], v[1:][pair])
    if absolute:
        theta = torch.minimum(theta, math.pi - theta)
    return float(theta.mean())


def mean_curvature(seqs: Iterable[Array], absolute: bool = False) -> float:
    """`curvature` averaged over sequences [(t_i, d)], those without an angle left out."""
    values = [c for c in (curvature(z, absolute) for z in seqs) if not math.isnan(c)]
    if not values:
        raise ValueError("curvature: no sequence has two successive non-zero token differences")
    return float(np.mean(values))


def pooled(seqs: Iterable[Array], normalize: bool = True) -> torch.Tensor:
    """One row per sequence [(t_i, d)]: its token mean, after `center_l2` with ``normalize`` -> (N, d)."""
    seqs = _sequences(seqs, "sequence")
    return torch.stack([(center_l2(z) if normalize else z).mean(0) for z in seqs])


def dataset_entropy(
    seqs: Iterable[Array],
    alpha: float = 1.0,
    normalize: bool = True,
    clamp_gram: bool = True,
    max_normalize: bool = False,
) -> float:
    """Skean et al.'s dataset entropy of sequences [(t_i, d)]: the matrix entropy of their `pooled` rows (N, d).

    Args:
        alpha: Renyi order.
        normalize: centre and L2-normalise each sequence's tokens before pooling (their code).
        clamp_gram: set the Gram matrix's negative entries to 0 (their code), else the plain matrix entropy.
        max_normalize: divide by log(min(N, d)), its maximum.
    """
    P = pooled(seqs, normalize)
    n, d = P.shape
    K = P @ P.T if n <= d else P.T @ P  # their code takes the d x d matrix when N > d
    ent = float((clamped_gram_entropy if clamp_gram else gram_entropy)(K, alpha))
    if max_normalize:
        if min(n, d) < 2:
            raise ValueError(f"dataset_entropy: log(min(N, d)) is 0 for {n} sequences of width {d}")
        ent /= math.log(min(n, d))
    return ent


def lda_matrix(views: Array, delta: float = LIDAR_DELTA) -> torch.Tensor:
    """Sigma_w^-1/2 Sigma_b Sigma_w^-1/2 of N samples in A views each, views (N, A, d) -> (d, d) (module doc)."""
    V = torch.as_tensor(views)
    if V.ndim != 3 or V.shape[0] < 2 or V.shape[1] < 2:
        raise ValueError(f"lidar: views must have shape (N, A, d) with N, A >= 2, got {tuple(V.shape)}")
    V = _matrix(V.reshape(-1, V.shape[-1]), "lidar views").reshape(V.shape)
    n, a, d = V.shape
    means = V.mean(1)
    B = means - means.mean(0)
    W = (V - means[:, None]).reshape(-1, d)
    between = B.T @ B / n
    within = W.T @ W / (n * a) + delta * torch.eye(d, dtype=torch.float64)
    lam, U = torch.linalg.eigh(within)
    root = U @ torch.diag(lam.rsqrt()) @ U.T
    return root @ between @ root


def lidar(views: Array, alpha: float = 1.0, delta: float = LIDAR_DELTA) -> float:
    """LiDAR entropy of views (N, A, d), N samples in A augmented views: the Renyi entropy of `lda_matrix`'s
    eigenvalues normalised to sum to 1 (its negative round-off eigenvalues as 0)."""
    L = lda_matrix(views, delta)
    return float(gram_entropy((L + L.T) / 2, alpha))


def angular_distance(X: Array, Y: Array) -> float:
    """Mean over matching rows of X and Y (n, d) of arccos(cos(x, y)) / pi, in [0, 1]."""
    X, Y = _matrix(X, "angular_distance X", 1), _matrix(Y, "angular_distance Y", 1)
    if X.shape != Y.shape:
        raise ValueError(f"angular_distance: shapes {tuple(X.shape)} and {tuple(Y.shape)} differ")
    return float(_angles(X, Y).mean() / math.pi)


def layer_angular_distances(
    features: Mapping[int, Array] | Sequence[Array], shift: int = 1
) -> dict[int, float]:
    """Angular distance of each layer l to layer l + shift, {l: (n, d)} (or a list) on the same rows ->
    {l: distance} for every l whose l + shift is given."""
    if shift < 1:
        raise ValueError(f"shift must be a positive number of layers, got {shift}")
    items = dict(features) if isinstance(features, Mapping) else dict(enumerate(features))
    return {la: angular_distance(X, items[la + shift]) for la, X in items.items() if la + shift in items}
