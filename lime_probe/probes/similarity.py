"""Layer-to-layer similarity and per-layer dimensionality (beyond the paper).

- Linear CKA (Kornblith et al. 2019): for column-centred X (n, d1) and Y (n, d2) of the same n rows
  (tokens), CKA = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F), in [0, 1]; 1 for identical representations,
  invariant to orthogonal transforms and isotropic scaling of either side.
- Debiased linear CKA (Kornblith et al. 2019, Sec. 3 and App. C): HSIC replaced by the unbiased estimator
  HSIC_1 of Song et al. (2012),
  HSIC_1(K, L) = [tr(K~ L~) + 1^T K~ 1 1^T L~ 1 / ((n-1)(n-2)) - 2/(n-2) 1^T K~ L~ 1] / (n(n-3)),
  K = X X^T and L = Y Y^T with their diagonals zeroed (K~, L~). Plain CKA is biased towards 1 when n is not
  much larger than the widths (two unrelated random matrices of 100 rows and width 500 score about 0.8);
  the debiased one is near 0 for them, can be slightly negative, and needs n >= 4.
- Across models: layer i of one checkpoint against layer j of another, on the same token rows
  (`cka_matrix(features, other)`).
- Streaming (`CkaStream`): the statistics both CKAs need, accumulated batch by batch of token rows, so no
  layer's activations are held beyond a batch. Memory, in float64: the cross-products of every pair of
  layers compared, 8 (sum_l d_l)^2 bytes for one model's layers against each other (16 layers of width 256:
  134 MB; of width 768: 1.2 GB) plus 8 (sum_l d_l)(sum_m d_m) for each pair of models compared; flat in
  the number of tokens (holding the activations instead takes 4 n sum_l d_l bytes). Choose fewer layers
  to bound it.
- Effective rank (Roy & Vetterli 2007): exp of the Shannon entropy of the singular values normalised to
  sum to 1, between 1 and rank(X); of the matrix as given unless `center=True`.

All computations are in float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from lime_probe.extraction.transfer import all_finite

Features = Sequence[torch.Tensor | np.ndarray] | Mapping[int, torch.Tensor | np.ndarray]


def _matrix(X: torch.Tensor | np.ndarray, name: str, min_rows: int = 2) -> torch.Tensor:
    X = torch.as_tensor(X)
    if X.ndim != 2 or X.shape[0] < min_rows or X.shape[1] < 1:
        raise ValueError(
            f"{name}: expected shape (n, d) with n >= {min_rows} and d >= 1, got {tuple(X.shape)}"
        )
    if not bool(all_finite(X)):
        raise ValueError(f"{name}: contains NaN or Inf")
    return X.to(torch.float64)


def _centered(X: torch.Tensor, name: str) -> torch.Tensor:
    Xc = X - X.mean(0)
    if not bool(Xc.abs().max() > 0):
        raise ValueError(f"{name}: every feature is constant over the rows, so CKA is undefined")
    return Xc


def _layers(features: Features, what: str = "layer", min_rows: int = 1) -> tuple[list, list[torch.Tensor]]:
    items = list(features.items()) if isinstance(features, Mapping) else list(enumerate(features))
    if not items:
        raise ValueError("no layers given")
    names = [k for k, _ in items]
    mats = [_matrix(X, f"{what} {k}", min_rows) for k, X in items]
    for k, X in zip(names, mats, strict=True):
        if X.shape[0] != mats[0].shape[0]:
            raise ValueError(
                f"{what} {k}: {X.shape[0]} rows, but {what} {names[0]} has {mats[0].shape[0]}; CKA needs the same rows"
            )
    return names, mats


def _min_rows(debiased: bool) -> int:
    return 4 if debiased else 2  # HSIC_1 divides by n - 3


def _hsic_grams(K: torch.Tensor, L: torch.Tensor, debiased: bool) -> torch.Tensor:
    """HSIC of two Gram matrices (n, n) of column-centred features, up to a factor that depends on n only:
    <K, L>_F (plain), or Song et al.'s HSIC_1 (debiased; see the module doc)."""
    if not debiased:
        return (K * L).sum()
    n = K.shape[0]
    K, L = K.clone().fill_diagonal_(0), L.clone().fill_diagonal_(0)
    k1, l1 = K.sum(0), L.sum(0)
    return ((K * L).sum() + k1.sum() * l1.sum() / ((n - 1) * (n - 2)) - 2 * (k1 @ l1) / (n - 2)) / (
        n * (n - 3)
    )


class _CrossStats:
    """Sums over token rows from which HSIC between every layer of P and every layer of Q follows.

    Fed batches of rows: P [(b, d_i)] and Q [(b, d_j)] (or Q = P), float64. Keeps n, the layers' column
    sums, the cross-products C = Z_P^T Z_Q (sum_i d_i, sum_j d_j) of the concatenated layers, and for HSIC_1
    the row norms' r_a = ||x_a||^2 cross terms: sum_a r_a q_a (L_P, L_Q), X^T q (sum d_i, L_Q),
    r^T Y (L_P, sum d_j) and sum_a r_a, sum_a q_a.
    """

    def __init__(self) -> None:
        self.n = 0
        self.sums: list[torch.Tensor] = []

    def update(self, P: list[torch.Tensor], Q: list[torch.Tensor] | None = None) -> None:
        ZP, RP = torch.cat(P, 1), torch.stack([X.square().sum(1) for X in P], 1)
        ZQ, RQ = (ZP, RP) if Q is None else (torch.cat(Q, 1), torch.stack([Y.square().sum(1) for Y in Q], 1))
        terms = [ZP.sum(0), ZQ.sum(0), ZP.T @ ZQ, RP.T @ RQ, ZP.T @ RQ, RP.T @ ZQ, RP.sum(0), RQ.sum(0)]
        if not self.sums:
            self.dims_p, self.dims_q = [X.shape[1] for X in P], [Y.shape[1] for Y in (P if Q is None else Q)]
            self.sums = terms
        else:
            for acc, t in zip(self.sums, terms, strict=True):
                acc += t
        self.n += ZP.shape[0]

    def hsic(self, debiased: bool) -> torch.Tensor:
        """HSIC (plain or HSIC_1, scaled as `_hsic_grams`) of every layer pair -> (L_P, L_Q)."""
        n = self.n
        sp, sq, C, rq, xq, ry, r_sum, q_sum = self.sums
        op, oq = np.cumsum([0, *self.dims_p]), np.cumsum([0, *self.dims_q])
        out = torch.empty(len(self.dims_p), len(self.dims_q), dtype=torch.float64)
        for i in range(len(self.dims_p)):
            pi = slice(op[i], op[i + 1])
            mu_i = sp[pi] / n
            for j in range(len(self.dims_q)):
                qj = slice(oq[j], oq[j + 1])
                mu_j = sq[qj] / n
                Cc = C[pi, qj] - n * torch.outer(mu_i, mu_j)  # the centred rows' cross-product
                out[i, j] = Cc.square().sum()
                if debiased:  # HSIC_1 of the centred rows (it is translation invariant) from the sums
                    mi, mj = mu_i @ mu_i, mu_j @ mu_j
                    rc = r_sum[i] - n * mi  # sum_a ||x_a - mu_i||^2
                    qc = q_sum[j] - n * mj
                    rqc = (  # sum_a ||x_a - mu_i||^2 ||y_a - mu_j||^2
                        rq[i, j]
                        - 2 * (ry[i, qj] @ mu_j)
                        - 2 * (mu_i @ xq[pi, j])
                        + 4 * (mu_i @ C[pi, qj] @ mu_j)
                        + mj * r_sum[i]
                        + mi * q_sum[j]
                        - 3 * n * mi * mj
                    )
                    # centred: K~ 1 = -diag(K), so 1^T K~ L~ 1 = sum_a r_a q_a and 1^T K~ 1 = -sum_a r_a
                    out[i, j] = (out[i, j] - n / (n - 2) * rqc + rc * qc / ((n - 1) * (n - 2))) / (
                        n * (n - 3)
                    )
        return out


def _cka(hsic: torch.Tensor, self_p: torch.Tensor, self_q: torch.Tensor, names_p, names_q, debiased: bool):
    """CKA from the HSIC of every pair (L_P, L_Q) and each layer's HSIC with itself (L_P,), (L_Q,)."""
    for names, h in ((names_p, self_p), (names_q, self_q)):
        bad = [k for k, v in zip(names, h.tolist(), strict=True) if not v > 0]
        if bad and not debiased:
            raise ValueError(f"layer {bad[0]}: every feature is constant over the rows, so CKA is undefined")
        if bad:
            raise ValueError(
                f"layer {bad[0]}: its debiased HSIC with itself is not positive (too few tokens, or constant "
                "features), so debiased CKA is undefined"
            )
    cka = hsic / torch.outer(self_p.sqrt(), self_q.sqrt())
    return (cka if debiased else cka.clamp(0.0, 1.0)).numpy()


def linear_cka(X: torch.Tensor | np.ndarray, Y: torch.Tensor | np.ndarray, debiased: bool = False) -> float:
    """Linear CKA (or debiased linear CKA) between X (n, d1) and Y (n, d2), rows paired (e.g. the same
    tokens at two layers)."""
    return float(cka_matrix([X], [Y], debiased=debiased, progress=False)[0, 0])


def cka_matrix(
    features: Features, other: Features | None = None, debiased: bool = False, progress: bool = True
) -> np.ndarray:
    """Linear CKA between every pair of layers: features [(n, d_l)] or {layer: (n, d_l)} -> (L, L); with
    ``other`` (another model's layers on the same n rows) every layer of ``features`` against every layer of
    ``other`` -> (L, L_other). debiased: HSIC_1 in place of HSIC (see the module doc).

    Rows must be the same tokens in every layer. Uses (n, n) Gram matrices when n is at most the largest
    width, otherwise feature cross-products (one `CkaStream` batch). Cost: about L^2 n d^2 / 2 flops for
    n > d (L n^2 d otherwise); for many tokens a random subsample of rows keeps it cheap, or `CkaStream`
    streams them.
    """
    names, mats = _layers(features, min_rows=_min_rows(debiased))
    names_q, mats_q = (names, mats) if other is None else _layers(other, min_rows=_min_rows(debiased))
    if mats_q[0].shape[0] != mats[0].shape[0]:
        raise ValueError(
            f"the two models have {mats[0].shape[0]} and {mats_q[0].shape[0]} rows; CKA needs the same rows"
        )
    mats = [_centered(X, f"layer {k}") for k, X in zip(names, mats, strict=True)]
    mats_q = (
        mats if other is None else [_centered(X, f"layer {k}") for k, X in zip(names_q, mats_q, strict=True)]
    )
    n = mats[0].shape[0]
    if n > max(X.shape[1] for X in [*mats, *mats_q]):
        stream = CkaStream(n_models=1 if other is None else 2, across=other is not None)
        stream.update(mats) if other is None else stream.update(mats, mats_q)
        return stream.cka(0, 0 if other is None else 1, debiased=debiased)
    grams = [X @ X.T for X in mats]
    grams_q = grams if other is None else [Y @ Y.T for Y in mats_q]
    hsic = torch.empty(len(grams), len(grams_q), dtype=torch.float64)
    for i in tqdm(range(len(grams)), desc="CKA", unit="layer", disable=not progress):
        for j in range(len(grams_q)):
            if other is None and j < i:
                hsic[i, j] = hsic[j, i]
            else:
                hsic[i, j] = _hsic_grams(grams[i], grams_q[j], debiased)
    if other is None:
        self_p = self_q = hsic.diagonal()
    else:
        self_p = torch.stack([_hsic_grams(K, K, debiased) for K in grams])
        self_q = torch.stack([_hsic_grams(K, K, debiased) for K in grams_q])
    return _cka(hsic, self_p, self_q, names, names_q, debiased)


class CkaStream:
    """Linear CKA, plain and debiased, between layers of one or several models from token rows fed batch by
    batch (see the module doc for the memory it needs).

    ``update(*models)``: one batch, for each model its layers [(b, d_l)] or {layer: (b, d_l)} on the same b
    token rows (the same layers in every batch). ``cka(a)``: model a's layers against each other (L_a, L_a);
    with ``across=True``, ``cka(a, b)``: model a's layers against model b's (L_a, L_b). Equal to `cka_matrix`
    on all the rows at once, up to rounding. ``effective_ranks(a)``: each layer's centred effective rank.

    Each layer is shifted by its first batch's mean before its sums are taken (CKA and HSIC_1 do not change
    under a shift), so large means cost no precision.
    """

    def __init__(self, n_models: int = 1, across: bool = False) -> None:
        self.n_models, self.across = n_models, across
        self.names: list[list] = []
        self.shifts: list[list[torch.Tensor]] = []
        self.within = [_CrossStats() for _ in range(n_models)]
        self.pairs = {
            (a, b): _CrossStats() for a in range(n_models) for b in range(a + 1, n_models) if across
        }

    @property
    def n(self) -> int:
        """Token rows seen so far."""
        return self.within[0].n

    def update(self, *models: Features) -> None:
        if len(models) != self.n_models:
            raise ValueError(f"CkaStream.update: {len(models)} models given, expected {self.n_models}")
        batch: list[list[torch.Tensor]] = []
        for m, features in enumerate(models):
            names, mats = _layers(features, f"model {m} layer")
            if batch and mats[0].shape[0] != batch[0][0].shape[0]:
                raise ValueError(
                    f"CkaStream.update: model {m} has {mats[0].shape[0]} rows, model 0 {batch[0][0].shape[0]}; "
                    "the models must be given the same token rows"
                )
            if len(self.names) <= m:
                self.names.append(names)
                self.shifts.append([X.mean(0) for X in mats])
            elif names != self.names[m]:
                raise ValueError(f"CkaStream.update: model {m} has layers {names}, earlier {self.names[m]}")
            batch.append([X - c for X, c in zip(mats, self.shifts[m], strict=True)])
        for m, stats in enumerate(self.within):
            stats.update(batch[m])
        for (a, b), stats in self.pairs.items():
            stats.update(batch[a], batch[b])

    def cka(self, a: int = 0, b: int | None = None, debiased: bool = False) -> np.ndarray:
        """CKA of model a's layers against model b's (default: against its own) -> (L_a, L_b)."""
        if self.n < _min_rows(debiased):
            raise ValueError(
                f"{'debiased ' if debiased else ''}CKA needs at least {_min_rows(debiased)} token rows, got {self.n}"
            )
        self_p = self.within[a].hsic(debiased)
        if b is None or b == a:
            return _cka(self_p, self_p.diagonal(), self_p.diagonal(), self.names[a], self.names[a], debiased)
        if (min(a, b), max(a, b)) not in self.pairs:
            raise ValueError("CkaStream: models are compared with each other only with across=True")
        hsic = self.pairs[min(a, b), max(a, b)].hsic(debiased)
        self_q = self.within[b].hsic(debiased)
        return _cka(
            hsic if a < b else hsic.T,
            self_p.diagonal(),
            self_q.diagonal(),
            self.names[a],
            self.names[b],
            debiased,
        )

    def effective_ranks(self, a: int = 0) -> np.ndarray:
        """The centred effective rank (`effective_rank(X, center=True)`) of each of model a's layers -> (L_a,),
        from the eigenvalues of its centred Gram X_c^T X_c (the squared singular values of X_c)."""
        stats = self.within[a]
        sums, C = stats.sums[0], stats.sums[2]
        o = np.cumsum([0, *stats.dims_p])
        out = []
        for i, k in enumerate(self.names[a]):
            s, mu = slice(o[i], o[i + 1]), sums[o[i] : o[i + 1]] / stats.n
            gram = C[s, s] - stats.n * torch.outer(mu, mu)
            try:
                lam = torch.linalg.eigvalsh(gram)
                # eigenvalues within rounding of 0 (matrix_rank's tolerance) are 0: their square roots
                # would pass for singular values of about 1e-8 of the largest
                lam = torch.where(lam > lam.max() * len(lam) * torch.finfo(lam.dtype).eps, lam, 0.0)
                out.append(_entropy_rank(lam.sqrt()))
            except ValueError as e:
                raise ValueError(f"layer {k}: {e}") from None
        return np.array(out)


def _entropy_rank(s: torch.Tensor) -> float:
    """exp of the Shannon entropy of the singular values s normalised to sum to 1."""
    if not bool(s.sum() > 0):
        raise ValueError("effective_rank: the matrix is all zeros")
    p = s / s.sum()
    return float(torch.exp(-torch.special.xlogy(p, p).sum()))


def effective_rank(X: torch.Tensor | np.ndarray, center: bool = False) -> float:
    """Effective rank of X (n, d): exp(-sum p_i log p_i) with p = singular values / their sum.

    center: subtract the column means first (the rank of the token cloud around its mean).
    """
    X = _matrix(X, "effective_rank")
    if center:
        X = X - X.mean(0)
    return _entropy_rank(torch.linalg.svdvals(X))


def effective_ranks(features: Features, center: bool = False, progress: bool = True) -> np.ndarray:
    """`effective_rank` of every layer: [(n_l, d_l)] or {layer: (n_l, d_l)} -> (L,) in input order."""
    items = list(features.items()) if isinstance(features, Mapping) else list(enumerate(features))
    if not items:
        raise ValueError("no layers given")
    out = []
    for k, X in tqdm(items, desc="effective rank", unit="layer", disable=not progress):
        try:
            out.append(effective_rank(X, center=center))
        except ValueError as e:
            raise ValueError(f"layer {k}: {e}") from None
    return np.array(out)
