"""Matrix-based Renyi entropy of token representations (paper Sec. 5.3, Table 13).

For one sequence Z (t, d) the Gram matrix K = Z Z^T has eigenvalues lambda_i; with p_i = lambda_i / tr(K)

    S_alpha(Z) = log(sum_i p_i^alpha) / (1 - alpha),      S_1(Z) = -sum_i p_i log p_i  (0 log 0 = 0).

A high entropy means the tokens spread over many directions; collapse drives it down.

Computation: Z Z^T (t, t) and Z^T Z (d, d) share their non-zero spectrum, so the smaller one is used
(the official code always builds the (t, t) one). Everything runs in float64 (a float32 (t, t) Gram is off by
~1e-3 at alpha = 0.5, t = 2048, d = 512: its many round-off eigenvalues are magnified by p^alpha), batched over sequences of the
same length, with negative round-off eigenvalues clamped to zero. alpha = 2 uses the closed form
S_2 = -log(||K||_F^2 / tr(K)^2), which needs no eigendecomposition.

Presets (every knob can be overridden):

- ``"lime"``: the official code. Per-feature z-score with the mean and std (ddof=1, as `torch.std`) over all
  tokens of all sequences of that layer, eps = 1e-5 added to the std, alpha = 0.5.
- ``"layer-by-layer"``: Skean et al. 2025 as their code computes prompt entropy (OFSkean/information_flow,
  experiments/utils/misc/metric_utils.py): each sequence is centred (token mean removed) and every token row
  L2-normalised; the smaller Gram matrix, (t, t) or (d, d) when t > d, has its negative *entries* set to 0
  (elementwise, which changes the spectrum; `clamp_gram`), its positive eigenvalues divided by their sum
  give p; alpha = 1, float64. Their optional normalisation by the maximum entropy log(min(t, d))
  ("maxEntropy") is the `max_normalize` flag (off by default: entropies in nats, like "lime").

Streaming: `stream_entropy(chunks, preset)` is the one implementation; `layer_entropy` (sequences in memory),
the command line and the notebooks (sequences read from the activation cache, one shard at a time) all run it.
`chunks()` returns a fresh iterable of batches of sequences. The per-sequence normalisations ("none",
"center-l2") need one pass. The global z-score of "lime" needs the layer's mean/std before any entropy, so it
takes two: the first fills a `FeatureMoments`, the second feeds an `EntropyAccumulator` (which computes each
entropy in `update` and keeps one float per sequence), so memory holds one batch whatever the data size.

Device: the float64 batches, their Gram matrices and eigenvalues live where the sequences are (on a GPU
when the activations are there), or on ``device`` when one is given: each batch then travels there in its
own dtype (a bfloat16 batch is a quarter of its float64 bytes) and is converted there; only the
per-sequence entropies come back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from lime_model.checks import check_positive
from lime_probe.extraction.transfer import all_finite
from lime_probe.probes.stats import summarize

Normalization = Literal["none", "zscore", "center-l2"]
_NORMALIZATIONS = ("none", "zscore", "center-l2")
# Sequences are converted to float64 in chunks of at most this many numbers (128 MiB).
_CHUNK_NUMEL = 2**24


def _check_alpha(alpha: float) -> None:
    check_positive(alpha, "alpha")


@dataclass(frozen=True)
class EntropyConfig:
    """How sequences are normalised before `matrix_entropy`, and its alpha.

    normalize: "none" (as given), "zscore" (per feature, global mean/std over all tokens of the layer,
    eps added to the std) or "center-l2" (per-sequence centring then row L2-normalisation).
    clamp_gram: set the Gram matrix's negative entries to 0 and take p from its positive eigenvalues
    (Skean et al.'s code). max_normalize: divide each entropy by log(min(t, d)), its maximum.
    """

    alpha: float = 1.0
    normalize: Normalization = "none"
    eps: float = 1e-5
    clamp_gram: bool = False
    max_normalize: bool = False

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        if self.normalize not in _NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {_NORMALIZATIONS}, got {self.normalize!r}")
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a finite number >= 0, got {self.eps}")
        for flag in ("clamp_gram", "max_normalize"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")


PRESETS: dict[str, EntropyConfig] = {
    "lime": EntropyConfig(alpha=0.5, normalize="zscore", eps=1e-5),
    "layer-by-layer": EntropyConfig(alpha=1.0, normalize="center-l2", clamp_gram=True),
}


def entropy_config(
    preset: str | EntropyConfig = "lime",
    *,
    alpha: float | None = None,
    normalize: Normalization | None = None,
    eps: float | None = None,
    clamp_gram: bool | None = None,
    max_normalize: bool | None = None,
) -> EntropyConfig:
    """The `EntropyConfig` of `preset` ("lime", "layer-by-layer" or a config) with the given knobs replaced."""
    if isinstance(preset, EntropyConfig):
        config = preset
    elif preset in PRESETS:
        config = PRESETS[preset]
    else:
        raise ValueError(f"unknown entropy preset {preset!r}; choose one of {sorted(PRESETS)}")
    knobs: dict[str, Any] = dict(
        alpha=alpha, normalize=normalize, eps=eps, clamp_gram=clamp_gram, max_normalize=max_normalize
    )
    return replace(config, **{k: v for k, v in knobs.items() if v is not None})


def gram_entropy(K: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Renyi entropy of order `alpha` of PSD Gram matrices K (..., n, n) -> (...), in K's dtype.

    p = eigenvalues / trace with negative (round-off) eigenvalues clamped to 0; alpha = 1 is the Shannon
    limit and alpha = 2 the eigendecomposition-free closed form.
    """
    _check_alpha(alpha)
    trace = K.diagonal(dim1=-2, dim2=-1).sum(-1)
    if not bool((trace > 0).all()):
        raise ValueError(
            "matrix entropy is undefined for an all-zero sequence (zero Gram trace), e.g. a one-token sequence "
            "after per-sequence centring"
        )
    if alpha == 2:
        return -torch.log(K.square().sum((-2, -1)) / trace.square())
    return _renyi(torch.linalg.eigvalsh(K).clamp_(min=0) / trace.unsqueeze(-1), alpha)


def _renyi(p: torch.Tensor, alpha: float) -> torch.Tensor:
    """Renyi entropy of distributions p (..., n) -> (...)."""
    if alpha == 1:
        return -torch.special.xlogy(p, p).sum(-1)
    return torch.log(p.pow(alpha).sum(-1)) / (1 - alpha)


def clamped_gram_entropy(K: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Skean et al.'s entropy of a Gram matrix K (..., n, n) -> (...): K's negative entries set to 0
    (elementwise), p = its positive eigenvalues divided by their sum (the clamped K need not be PSD)."""
    _check_alpha(alpha)
    lam = torch.linalg.eigvalsh(K.clamp(min=0)).clamp_(min=0)
    total = lam.sum(-1, keepdim=True)
    if not bool((total > 0).all()):
        raise ValueError(
            "matrix entropy is undefined for an all-zero sequence (zero Gram trace), e.g. a one-token sequence "
            "after per-sequence centring"
        )
    return _renyi(lam / total, alpha)


def _gram_config_entropy(K: torch.Tensor, config: EntropyConfig, t: int, d: int) -> torch.Tensor:
    """Entropy per `config` of the Gram matrices K (..., n, n) of (t, d) sequences."""
    ent = (clamped_gram_entropy if config.clamp_gram else gram_entropy)(K, config.alpha)
    if not config.max_normalize:
        return ent
    if min(t, d) < 2:
        raise ValueError(f"max_normalize: log(min(t, d)) is 0 for a ({t}, {d}) sequence; needs t, d >= 2")
    return ent / math.log(min(t, d))


def _entropy(Z: torch.Tensor, config: EntropyConfig) -> torch.Tensor:
    """Entropy of validated float64 Z (..., t, d) through the smaller Gram matrix (shape (d, d) only when t > d,
    as Skean et al.'s code chooses, which matters for `clamp_gram`)."""
    t, d = Z.shape[-2:]
    return _gram_config_entropy(Z @ Z.mT if t <= d else Z.mT @ Z, config, t, d)


def matrix_entropy(Z: torch.Tensor | np.ndarray, alpha: float = 1.0) -> torch.Tensor:
    """Matrix-based Renyi entropy of Z (..., t, d), taken as given (no normalisation) -> (...) float64.

    Uses the smaller of the (t, t) and (d, d) Gram matrices; see the module docstring for the formula.
    """
    Z = torch.as_tensor(Z)
    if Z.ndim < 2 or Z.shape[-1] == 0 or Z.shape[-2] == 0:
        raise ValueError(
            f"matrix_entropy: Z must have shape (..., t, d) with t, d >= 1, got {tuple(Z.shape)}"
        )
    if not Z.is_floating_point():
        raise ValueError(f"matrix_entropy: Z must be a floating-point tensor, got {Z.dtype}")
    if not bool(all_finite(Z)):
        raise ValueError("matrix_entropy: Z contains NaN or Inf")
    return _entropy(Z.to(torch.float64), EntropyConfig(alpha=alpha))


class FeatureMoments:
    """Streaming per-feature mean and std (ddof=1) over token rows, in float64 (Chan et al. merge).

    `update(rows)` with rows (n, d); `mean` and `std` are (d,) float64 tensors.
    """

    def __init__(self) -> None:
        self.count = 0
        self._mean: torch.Tensor | None = None
        self._m2 = torch.zeros(())  # the sum of squared deviations, once `_mean` is set

    def update(self, rows: torch.Tensor) -> FeatureMoments:
        rows = torch.as_tensor(rows, dtype=torch.float64)
        if rows.ndim != 2:
            raise ValueError(f"FeatureMoments.update: rows must have shape (n, d), got {tuple(rows.shape)}")
        n = rows.shape[0]
        if n == 0:
            return self
        var, mean = torch.var_mean(rows, dim=0, correction=0)  # one fused, numerically stable pass
        return self.merge(FeatureMoments.of(n, mean, var * n))

    @classmethod
    def of(cls, count: int, mean: torch.Tensor, m2: torch.Tensor) -> FeatureMoments:
        """Moments of `count` rows with the given mean (d,) and sum of squared deviations m2 (d,)."""
        moments = cls()
        moments.count, moments._mean, moments._m2 = count, mean, m2
        return moments

    def merge(self, other: FeatureMoments) -> FeatureMoments:
        """Add the rows summarised by `other` (Chan et al.'s pairwise update); returns self."""
        if other._mean is None:
            return self
        if self._mean is None:
            self.count, self._mean, self._m2 = other.count, other._mean, other._m2
            return self
        if other._mean.shape != self._mean.shape:
            raise ValueError(
                f"FeatureMoments: got dim {other._mean.shape[0]}, earlier rows had {self._mean.shape[0]}"
            )
        total = self.count + other.count
        delta = other._mean - self._mean
        self._mean = self._mean + delta * (other.count / total)
        self._m2 = self._m2 + other._m2 + delta.square() * (self.count * other.count / total)
        self.count = total
        return self

    @property
    def mean(self) -> torch.Tensor:
        if self._mean is None:
            raise ValueError("FeatureMoments: no rows seen yet")
        return self._mean

    @property
    def std(self) -> torch.Tensor:
        if self.count < 2:
            raise ValueError(f"FeatureMoments: the std needs at least 2 token rows, got {self.count}")
        return (self._m2 / (self.count - 1)).sqrt()


@dataclass(frozen=True)
class EntropyResult:
    """Per-layer entropy: per-sequence values (n_seq,) in input order, their mean, std (ddof=0) and a
    percentile-bootstrap CI of the mean (`lime_probe.probes.stats.bootstrap_ci`)."""

    values: np.ndarray
    mean: float
    std: float
    ci_low: float
    ci_high: float
    config: EntropyConfig


def _as_sequences(seqs: torch.Tensor | np.ndarray | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """A (n, t, d) array or an iterable of (t_i, d) tensors -> list of (t_i, d) tensors, shapes checked."""
    if isinstance(seqs, (torch.Tensor, np.ndarray)):
        seqs = torch.as_tensor(seqs)
        if seqs.ndim != 3:
            raise ValueError(f"sequences: a tensor must have shape (n_seq, t, d), got {tuple(seqs.shape)}")
    out = [torch.as_tensor(z) for z in seqs]
    for i, z in enumerate(out):
        if z.ndim != 2 or z.shape[0] == 0 or z.shape[1] == 0:
            raise ValueError(f"sequence {i}: expected shape (t, d) with t, d >= 1, got {tuple(z.shape)}")
        if z.shape[1] != out[0].shape[1]:
            raise ValueError(
                f"sequence {i}: dim {z.shape[1]} differs from sequence 0's dim {out[0].shape[1]}"
            )
        if not z.is_floating_point():
            raise ValueError(f"sequence {i}: expected a floating-point tensor, got {z.dtype}")
    return out


def _groups(seqs: list[torch.Tensor]) -> Iterable[list[int]]:
    """Consecutive runs of sequence indices holding at most `_CHUNK_NUMEL` numbers (or one sequence)."""
    group: list[int] = []
    numel = 0
    for i, z in enumerate(seqs):
        if group and numel + z.numel() > _CHUNK_NUMEL:
            yield group
            group, numel = [], 0
        group.append(i)
        numel += z.numel()
    if group:
        yield group


def _batches(
    seqs: list[torch.Tensor], device: torch.device | str | None = None
) -> Iterable[tuple[list[int], torch.Tensor]]:
    """Groups of equal-length sequences of bounded size: (indices, Z (b, t, d) float64), NaN/Inf checked.

    Z is a fresh tensor (callers may normalise it in place) on `device`, or where the group's first
    sequence is when None; each sequence is moved there in its own dtype before the conversion.
    """
    groups: dict[int, list[int]] = {}
    for i, z in enumerate(seqs):
        groups.setdefault(z.shape[0], []).append(i)
    for t, idx in groups.items():
        d = seqs[idx[0]].shape[1]
        step = max(1, _CHUNK_NUMEL // (t * d))
        for k in range(0, len(idx), step):
            chunk = idx[k : k + step]
            where = seqs[chunk[0]].device if device is None else device
            Z = torch.empty((len(chunk), t, d), dtype=torch.float64, device=where)
            for j, i in enumerate(chunk):
                Z[j].copy_(seqs[i].to(where))  # converts to float64 without an extra float64 temporary
            finite = torch.isfinite(Z.sum(1)).all(1)  # NaN and Inf propagate into the sums
            if not bool(finite.all()):
                raise ValueError(f"sequence {chunk[int((~finite).nonzero()[0])]}: contains NaN or Inf")
            yield chunk, Z


class EntropyAccumulator:
    """The second pass of `stream_entropy`: the matrix entropy of each sequence of one layer, batch by batch.

    >>> acc = EntropyAccumulator("layer-by-layer")
    >>> for seqs in batches:          # each a (n, t, d) tensor or a list of (t_i, d) tensors
    ...     acc.update(seqs)
    >>> res = acc.result()            # EntropyResult: values (n_seq,), mean, std, ci_low, ci_high

    The "zscore" normalisation needs `feature_stats`, a `FeatureMoments` of every sequence of the layer
    (filled in a first pass; `stream_entropy` does both passes). Knobs (`alpha`, `normalize`, `eps`)
    override the preset. Equal-length sequences are processed together in float64 chunks of at most 128 MiB,
    on `device` (None: where the sequences are; see the module docstring).
    """

    def __init__(
        self,
        preset: str | EntropyConfig = "lime",
        *,
        alpha: float | None = None,
        normalize: Normalization | None = None,
        eps: float | None = None,
        feature_stats: FeatureMoments | None = None,
        ci_level: float = 0.95,
        n_boot: int = 1000,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.config = entropy_config(preset, alpha=alpha, normalize=normalize, eps=eps)
        self.device = device
        if self.config.normalize == "zscore" and feature_stats is None:
            raise ValueError(
                "the 'zscore' normalisation needs the layer's feature moments first: pass feature_stats= "
                "(a FeatureMoments of all its sequences), or use stream_entropy / layer_entropy"
            )
        self.feature_stats = feature_stats
        self.ci_level, self.n_boot, self.seed = ci_level, n_boot, seed
        self._count = 0  # sequences seen
        self._dim: int | None = None
        self._done: list[tuple[list[int], torch.Tensor]] = []  # (positions, entropies)

    def update(self, seqs: torch.Tensor | np.ndarray | Iterable[torch.Tensor]) -> EntropyAccumulator:
        """Add sequences: a (n, t, d) tensor or an iterable of (t_i, d) tensors (lengths may differ)."""
        seqs = _as_sequences(seqs)
        if not seqs:
            return self
        if self._dim is None:
            self._dim = seqs[0].shape[1]
        elif seqs[0].shape[1] != self._dim:
            raise ValueError(
                f"EntropyAccumulator: got dim {seqs[0].shape[1]}, earlier sequences had {self._dim}"
            )
        # Collected first and committed at the end, so that a bad sequence leaves the accumulator unchanged.
        done = []
        for chunk, Z in _batches(seqs, self.device):
            done.append(([self._count + i for i in chunk], _entropy(self._normalize_(Z), self.config)))
        self._done += done
        self._count += len(seqs)
        return self

    def _normalize_(self, Z: torch.Tensor) -> torch.Tensor:
        """Normalise Z (b, t, d) float64 in place per the config (no full-size temporaries) and return it."""
        if self.config.normalize == "zscore":
            assert self.feature_stats is not None  # required by __init__ for "zscore"
            denom = (self.feature_stats.std + self.config.eps).to(Z.device)
            if not bool((denom > 0).all()):
                raise ValueError("z-score: a feature has zero std and eps = 0; set eps > 0")
            return Z.sub_(self.feature_stats.mean.to(Z.device)).div_(denom)
        if self.config.normalize == "center-l2":  # as F.normalize: rows of norm < 1e-12 stay ~0
            Z.sub_(Z.mean(-2, keepdim=True))
            return Z.div_(torch.linalg.vector_norm(Z, dim=-1, keepdim=True).clamp_min_(1e-12))
        return Z

    def result(self) -> EntropyResult:
        """`EntropyResult` of everything passed to `update` so far."""
        if self._dim is None:
            raise ValueError("EntropyAccumulator: no sequences were given")
        values = np.empty(self._count)
        for pos, ent in self._done:
            values[pos] = ent.cpu().numpy()
        s = summarize(values, level=self.ci_level, n_boot=self.n_boot, seed=self.seed)
        return EntropyResult(
            values=values, mean=s.mean, std=s.std, ci_low=s.ci_low, ci_high=s.ci_high, config=self.config
        )


Sequences = torch.Tensor | np.ndarray | Iterable[torch.Tensor]


def stream_entropy(
    chunks: Callable[[], Iterable[Sequences]],
    preset: str | EntropyConfig = "lime",
    *,
    alpha: float | None = None,
    normalize: Normalization | None = None,
    eps: float | None = None,
    ci_level: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> EntropyResult:
    """Entropy statistics of one layer whose sequences arrive in batches (see the module docstring).

    Args:
        chunks: returns a fresh iterable of batches, each a (n, t, d) tensor or a list of (t_i, d) tensors,
            e.g. ``lambda: acts.iter_sequences("values", 3)``; called twice for the "zscore" normalisation
            (the feature moments, then the entropies), once otherwise. Memory holds one batch at a time.
        preset, alpha, normalize, eps: as `entropy_config`.
        ci_level, n_boot, seed: the bootstrap CI of the mean (`lime_probe.probes.stats.summarize`).
        device: where the moments, Gram matrices and eigenvalues are computed, e.g. "cuda" for
            activations extracted to the host from a model on a GPU; None: where each batch's sequences are.

    Returns:
        `EntropyResult`: per-sequence values (n_seq,) in input order, mean, std, CI.
    """
    config = entropy_config(preset, alpha=alpha, normalize=normalize, eps=eps)
    moments = None
    if config.normalize == "zscore":
        moments, seen = FeatureMoments(), 0
        for seqs in chunks():
            seqs = _as_sequences(seqs)
            for group in _groups(seqs):  # one update per group: few small torch calls for short sequences
                rows = torch.cat([seqs[i] for i in group])
                if not bool(all_finite(rows)):
                    bad = next(i for i in group if not bool(all_finite(seqs[i])))
                    raise ValueError(f"sequence {seen + bad}: contains NaN or Inf")
                moments.update(rows if device is None else rows.to(device))
            seen += len(seqs)
    acc = EntropyAccumulator(
        config, feature_stats=moments, ci_level=ci_level, n_boot=n_boot, seed=seed, device=device
    )
    for seqs in chunks():
        acc.update(seqs)
    return acc.result()


def layer_entropy(seqs: Sequences, preset: str | EntropyConfig = "lime", **knobs) -> EntropyResult:
    """Entropy statistics of one layer's sequences ((n, t, d) or a list of (t_i, d)) held in memory:
    `stream_entropy` of a single batch. `knobs` are those of `stream_entropy` (alpha, normalize, eps,
    ci_level, n_boot, seed, device)."""
    seqs = _as_sequences(seqs)
    return stream_entropy(lambda: [seqs], preset, **knobs)


def layer_entropies(
    per_layer: Mapping[int, torch.Tensor | np.ndarray | Sequence[torch.Tensor]],
    preset: str | EntropyConfig = "lime",
    progress: bool = True,
    **knobs,
) -> dict[int, EntropyResult]:
    """`layer_entropy` of every layer of {layer: sequences} -> {layer: EntropyResult}, with a progress bar."""
    if not per_layer:
        raise ValueError("layer_entropies: no layers given")
    return {
        layer: layer_entropy(seqs, preset, **knobs)
        for layer, seqs in tqdm(per_layer.items(), desc="entropy", unit="layer", disable=not progress)
    }
