"""Token separability (paper Sec. 5.3): can a linear probe tell apart the occurrences of a few words?

The paper collects the representations of every occurrence of " is", " are", " was" and " were"
(1,668 of each) and, per layer, reports five-fold classification accuracies (Fig. 2b); collapsed layers
mix the words up. The paper does not name the classifier; the default follows the official code's only
probe (src/analysis/classification.py), ``method="adam-linear"``, exactly:

- rows laid out class by class in the given class order (as the official code concatenates each word's
  occurrences), the class's index being its output unit;
- plain shuffled `KFold` (5 folds, ``random_state=seed``; the official seed is 42), computed once and used
  for every layer;
- ``torch.manual_seed(seed)`` once, then for every layer and fold in order: `DataLoader`s over the train
  (batch 64, shuffled) and test (batch 64) rows, one ``nn.Linear`` on the raw features, Adam at lr 1e-2,
  cross-entropy, **one epoch**; the fold's accuracy is the mean of the per-test-batch accuracies (which
  over-weights a last, smaller batch, as the official code does); mean and std (ddof=0) over folds.

Its accuracy is therefore a one-epoch linear probe's, not the best linear separation: a converged
classifier reaches the ceiling on the CPU models. ``method="logreg"`` is our converged alternative: a
standardised (z-scored on the training folds) multinomial logistic regression (lbfgs; a
ConvergenceWarning becomes a ValueError naming the layer and fold and asking for a larger `max_iter`)
with stratified shuffled folds. Classes are balanced by subsampling each to the rarest class's count
(seeded) before either probe; the majority-class rate is reported beside.

Words of several tokens (numbers such as " 100" ... " 103" under most tokenizers, paper Fig. 4a/8):
`word_spans` finds their occurrences as token spans and `pool_spans` turns each span into one row,
from its last sub-token (the default; the state that has read the whole word) or the mean over its
sub-tokens. The choice is ours (the paper does not say); record it with the results.

Folds run in ``n_jobs`` processes (joblib) with results bit-identical to ``n_jobs=1``: every fit runs at one
torch and one BLAS/OpenMP thread in both cases (so the summation order never depends on the machine), and
each adam-linear fold starts from the torch generator state the serial loop would reach (found by a cheap
pass of the same draws; see `_adam_linear_layers`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import KFold, StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.parallel import Parallel, delayed
from threadpoolctl import ThreadpoolController
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from lime_probe.extraction.sites import DEFAULT_WORDS

Method = Literal["logreg", "adam-linear"]
SubToken = Literal["last", "mean"]
LayerFeatures = Mapping[Any, np.ndarray | torch.Tensor] | Sequence[np.ndarray | torch.Tensor]


@dataclass(frozen=True)
class ProbeResult:
    """Per-layer cross-validated accuracy of a linear probe.

    layers (L,) as given; accuracy_mean / accuracy_std (L,); fold_accuracy (L, n_splits);
    majority_baseline: accuracy of always predicting the most frequent class; n_rows: rows used.
    """

    layers: list
    accuracy_mean: np.ndarray
    accuracy_std: np.ndarray
    fold_accuracy: np.ndarray
    majority_baseline: float
    n_rows: int
    method: str


def _py(x: Any) -> Any:
    """A numpy scalar as the Python value, for readable error messages."""
    return x.item() if isinstance(x, np.generic) else x


def word_token_ids(tokenizer: Any, words: Sequence[str] = DEFAULT_WORDS) -> dict[str, int]:
    """Map each word to its single token id under `tokenizer` (encoded without special tokens).

    Rule: a word must encode to exactly one token that is not the unknown token; anything else is
    rejected with a ValueError (leading spaces matter: for BPE tokenizers " is" and "is" differ).
    """
    if not words:
        raise ValueError("word_token_ids: no words given")
    out: dict[str, int] = {}
    unk = getattr(tokenizer, "unk_token_id", None)
    for word in words:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            pieces = tokenizer.convert_ids_to_tokens(ids)
            raise ValueError(
                f"word {word!r} is {len(ids)} tokens {pieces} for this tokenizer; token separability needs "
                "single-token words (check the leading space)"
            )
        if unk is not None and ids[0] == unk:
            raise ValueError(f"word {word!r} maps to the unknown token for this tokenizer")
        if ids[0] in out.values():
            other = next(w for w, i in out.items() if i == ids[0])
            raise ValueError(f"words {other!r} and {word!r} map to the same token id {ids[0]}")
        out[word] = ids[0]
    return out


def word_rows(
    token_ids: np.ndarray | torch.Tensor, word_ids: Mapping[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `token_ids` (n_rows,) that are one of the words -> (row indices (m,), word labels (m,))."""
    token_ids = np.asarray(token_ids)
    by_id = {i: w for w, i in word_ids.items()}
    rows = np.flatnonzero(np.isin(token_ids, list(by_id)))
    labels = np.array([by_id[int(t)] for t in token_ids[rows]], dtype=object)
    return rows, labels


def word_pieces(tokenizer: Any, words: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Each word's token ids under `tokenizer` (encoded without special tokens; one or several).

    Rejects words that encode to nothing or to the unknown token, and two words with the same ids.
    """
    if isinstance(words, str) or not words:
        raise ValueError(f"words must be a non-empty list of strings, got {words!r}")
    unk = getattr(tokenizer, "unk_token_id", None)
    out: dict[str, tuple[int, ...]] = {}
    for word in words:
        ids = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not ids:
            raise ValueError(f"word {word!r} encodes to no tokens")
        if unk is not None and unk in ids:
            raise ValueError(f"word {word!r} contains the unknown token for this tokenizer")
        other = next((w for w, i in out.items() if i == ids), None)
        if other is not None:
            raise ValueError(f"words {other!r} and {word!r} encode to the same tokens {list(ids)}")
        out[word] = ids
    return out


def word_spans(
    token_ids: np.ndarray | torch.Tensor,
    offsets: np.ndarray | torch.Tensor,
    tokenizer: Any,
    words: Sequence[str],
) -> tuple[np.ndarray, np.ndarray]:
    """Occurrences of `words` (one or several tokens each) in extracted token rows.

    token_ids (n_rows,) and offsets (n_seq+1,) as in `Activations` extracted with every token kept
    (no `token_ids` filter). An occurrence is the word's exact token sequence inside one sequence that
    is a whole word: the next token does not start with a letter or digit (so " 10" is not found in
    " 10" + "3"), and, for a word without leading whitespace, the previous token does not end with one.
    Returns (spans (m, 2) of row [start, end), word labels (m,)), in row order.
    """
    pieces = word_pieces(tokenizer, words)
    token_ids = np.asarray(token_ids)
    offsets = np.asarray(offsets)
    text: dict[int, str] = {}

    def decoded(i: int) -> str:
        if i not in text:
            text[i] = tokenizer.decode([i])
        return text[i]

    spans, labels = [], []
    for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        seq = token_ids[lo:hi].tolist()
        for start in range(len(seq)):
            for word, ids in pieces.items():
                end = start + len(ids)
                if tuple(seq[start:end]) != ids:
                    continue
                if end < len(seq) and decoded(seq[end])[:1].isalnum():
                    continue
                if start > 0 and not word[:1].isspace() and decoded(seq[start - 1])[-1:].isalnum():
                    continue
                spans.append((lo + start, lo + end))
                labels.append(word)
    return np.array(spans, dtype=np.int64).reshape(-1, 2), np.array(labels, dtype=object)


def pool_spans(X: np.ndarray | torch.Tensor, spans: np.ndarray, subtoken: SubToken = "last") -> np.ndarray:
    """One row per span of X (n_rows, d) -> (m, d): the span's last row or the mean of its rows."""
    X = X.detach().cpu().numpy() if isinstance(X, torch.Tensor) else np.asarray(X)
    spans = np.asarray(spans)
    if subtoken == "last":
        return X[spans[:, 1] - 1]
    if subtoken == "mean":
        return np.stack([X[a:b].mean(0) for a, b in spans.tolist()]) if len(spans) else X[:0]
    raise ValueError(f"subtoken must be 'last' or 'mean', got {subtoken!r}")


def balance_classes(
    labels: np.ndarray | Sequence, seed: int = 0, n_per_class: int | None = None
) -> np.ndarray:
    """Indices (sorted) of a class-balanced subsample: `n_per_class` rows of each class, by default the
    rarest class's count; seeded, so the same labels and seed always give the same rows."""
    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    n = int(counts.min()) if n_per_class is None else n_per_class
    if n > counts.min():
        rare = _py(classes[counts.argmin()])
        raise ValueError(f"class {rare!r} has only {counts.min()} rows, fewer than n_per_class={n}")
    rng = np.random.default_rng(seed)
    keep = [rng.choice(np.flatnonzero(labels == c), size=n, replace=False) for c in classes]
    return np.sort(np.concatenate(keep))


def _layer_items(features: LayerFeatures) -> list[tuple[Any, np.ndarray]]:
    items = list(features.items()) if isinstance(features, Mapping) else list(enumerate(features))
    if not items:
        raise ValueError("no layers given")
    out: list[tuple[Any, np.ndarray]] = []
    for layer, X in items:
        X = X.detach().cpu().numpy() if isinstance(X, torch.Tensor) else np.asarray(X)
        if X.ndim != 2:
            raise ValueError(f"layer {layer}: features must have shape (n, d), got {X.shape}")
        if not np.isfinite(X).all():
            raise ValueError(f"layer {layer}: features contain NaN or Inf")
        if out and X.shape[0] != out[0][1].shape[0]:
            raise ValueError(
                f"layer {layer}: {X.shape[0]} rows, but layer {out[0][0]} has {out[0][1].shape[0]}"
            )
        out.append((layer, X))
    return out


def _check_labels(y: np.ndarray, n_rows: int, n_splits: int, what: str) -> None:
    if y.ndim != 1 or y.shape[0] != n_rows:
        raise ValueError(f"{what}: labels must have shape ({n_rows},) to match the features, got {y.shape}")
    classes, counts = np.unique(y, return_counts=True)
    if classes.size < 2:
        raise ValueError(f"{what}: need at least 2 classes, got {[_py(c) for c in classes]}")
    if counts.min() < n_splits:
        rare = _py(classes[counts.argmin()])
        raise ValueError(
            f"{what}: class {rare!r} has only {counts.min()} rows; {n_splits}-fold cross-validation needs "
            f"at least {n_splits} per class"
        )


def _check_method(method: str) -> None:
    if method not in ("logreg", "adam-linear"):
        raise ValueError(f"method must be 'logreg' or 'adam-linear', got {method!r}")


def fit_logreg(X_train: np.ndarray, y_train: np.ndarray, C: float, max_iter: int, where: str = "") -> Any:
    """A standardised logistic regression fitted to convergence.

    X_train (n, d), y_train (n,). A ConvergenceWarning becomes a ValueError starting with `where`
    (e.g. "layer 3, fold 1: ") that asks for a larger `max_iter` or a smaller `C`.
    """
    model = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=max_iter))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        try:
            return model.fit(X_train, y_train)
        except ConvergenceWarning:
            raise ValueError(
                f"{where}logistic regression did not converge in max_iter={max_iter}; raise max_iter or lower C"
            ) from None


def _adam_linear_fold(
    X_train: np.ndarray, y_train: np.ndarray, X_test: np.ndarray, y_test: np.ndarray, n_classes: int
) -> float:
    """One fold of the official probe, in the official code's order of random draws (global torch RNG).

    X_* (n, d) raw features, y_* (n,) class indices. The train loader's shuffle and the linear layer's
    init draw from the global torch generator, so the caller seeds it once for all layers and folds.
    Returns the mean over test batches of each batch's accuracy.
    """
    trainset = TensorDataset(
        torch.tensor(X_train, dtype=torch.float32), torch.tensor(y_train, dtype=torch.long)
    )
    testset = TensorDataset(torch.tensor(X_test, dtype=torch.float32), torch.tensor(y_test, dtype=torch.long))
    trainloader = DataLoader(trainset, batch_size=64, shuffle=True)
    testloader = DataLoader(testset, batch_size=64, shuffle=False)
    clf = torch.nn.Linear(trainset[0][0].shape[-1], n_classes)
    ce = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(clf.parameters(), lr=1e-2)
    clf.train()
    for inputs, targets in trainloader:  # one epoch
        loss = ce(clf(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    clf.eval()
    with torch.no_grad():
        accs = [(clf(inputs).argmax(-1) == targets).float().mean().item() for inputs, targets in testloader]
    return float(np.mean(accs))


@cache
def _threadpools() -> ThreadpoolController:
    """The BLAS and OpenMP thread pools loaded in this process (scanned once: a scan takes milliseconds)."""
    return ThreadpoolController()


def _single_threaded(task: Any, *args: Any) -> Any:
    """``task(*args)`` at one torch thread and one BLAS/OpenMP thread, restored after.

    In every process and for every ``n_jobs``: a fold's arithmetic (and so its result) then never depends on
    the thread count, and tiny multi-threaded kernels are slower anyway (thread wake-ups dominate).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _threadpools().limit(limits=1):
            return task(*args)
    finally:
        torch.set_num_threads(threads)


def _run_folds(task: Any, jobs: list[tuple], n_jobs: int, desc: str, progress: bool) -> list:
    """``[task(*args) for args in jobs]``, each single-threaded, in ``n_jobs`` joblib processes (1: in order,
    in this process). The progress bar counts folds handed out (a few ahead of those finished)."""
    args = tqdm(jobs, desc=desc, unit="fold", disable=not progress)
    return Parallel(n_jobs=n_jobs)(delayed(_single_threaded)(task, *a) for a in args)


def _adam_linear_task(
    X: np.ndarray,
    y_index: np.ndarray,
    train: np.ndarray,
    test: np.ndarray,
    n_classes: int,
    state: torch.Tensor,
) -> tuple[float, torch.Tensor]:
    """One fold of the official probe from the global torch generator state ``state`` -> (accuracy, the
    generator's state after it)."""
    torch.set_rng_state(state)
    acc = _adam_linear_fold(X[train], y_index[train], X[test], y_index[test], n_classes)
    return acc, torch.get_rng_state()


def _adam_linear_layers(
    items: list[tuple[Any, np.ndarray]],
    y_index: np.ndarray,
    n_classes: int,
    folds: list,
    seed: int,
    desc: str,
    progress: bool,
    n_jobs: int = 1,
) -> np.ndarray:
    """The official probe over every layer and fold -> accuracies (n_layers, n_folds).

    The official code seeds torch once (``seed``) and runs layer by layer, fold by fold, on the global
    generator. A fold's draws (the linear layer's init, one seed per data-loader pass) do not depend on its
    rows, so the same folds run on one row each (a millisecond) give the generator state at the start of
    every fold; each fold then runs from its state, in any process, and must end where the next one starts
    (checked: a torch whose draws depended on the rows would fail loudly, never silently differ). The
    caller's generator is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        starts = []
        for _, X in items:
            for train, test in folds:
                starts.append(torch.get_rng_state())
                _adam_linear_fold(X[train[:1]], y_index[train[:1]], X[test[:1]], y_index[test[:1]], n_classes)
        starts.append(torch.get_rng_state())
        jobs = [
            (X, y_index, train, test, n_classes, starts[li * len(folds) + k])
            for li, (_, X) in enumerate(items)
            for k, (train, test) in enumerate(folds)
        ]
        out = _run_folds(_adam_linear_task, jobs, n_jobs, desc, progress)
    for k, (_, end) in enumerate(out):
        if not torch.equal(end, starts[k + 1]):
            raise RuntimeError(
                "adam-linear probe: a fold's random draws depend on its rows under this torch version, so "
                "folds cannot start from precomputed generator states; please report it"
            )
    return np.array([acc for acc, _ in out]).reshape(len(items), len(folds))


def _logreg_task(
    X: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray, C: float, max_iter: int, where: str
) -> float:
    """One fold of the logistic-regression probe -> its test accuracy."""
    clf = fit_logreg(X[train], y[train], C, max_iter, where=where)
    return float((clf.predict(X[test]) == y[test]).mean())


def _class_index(y: np.ndarray, classes: Sequence | None) -> tuple[np.ndarray, int]:
    """Each label's position in ``classes`` (default: the sorted distinct labels) -> ((n,), n_classes)."""
    order = list(np.unique(y)) if classes is None else list(classes)
    unknown = sorted({_py(v) for v in y} - {_py(c) for c in order}, key=str)
    if unknown:
        raise ValueError(f"labels {unknown} are not among the classes {[_py(c) for c in order]}")
    index = {_py(c): i for i, c in enumerate(order)}
    return np.array([index[_py(v)] for v in y], dtype=np.int64), len(order)


def probe_layers(
    features: LayerFeatures,
    labels: np.ndarray | Sequence,
    splitter: Any,
    groups: np.ndarray | None = None,
    method: Method = "adam-linear",
    C: float = 1.0,
    max_iter: int = 10_000,
    seed: int = 0,
    progress: bool = True,
    desc: str = "probe",
    classes: Sequence | None = None,
    n_jobs: int = 1,
) -> ProbeResult:
    """Cross-validated linear probe per layer with a given sklearn splitter (shared with the BLiMP probe).

    features: {layer: (n, d)} or [(n, d)]; labels (n,); groups (n,) for group-aware splitters;
    classes: the class order, i.e. each class's output unit of the adam-linear probe (default: sorted).
    The folds are split once and used for every layer. n_jobs: processes fitting the (layer, fold) pairs
    (joblib's convention: -1 for every core); the results are bit-identical for every value.
    """
    _check_method(method)
    items = _layer_items(features)
    y = np.asarray(labels)
    if y.shape != (items[0][1].shape[0],):
        raise ValueError(
            f"labels must have shape ({items[0][1].shape[0]},) to match the features, got {y.shape}"
        )
    folds = list(splitter.split(items[0][1], y, groups))
    if method == "adam-linear":
        acc = _adam_linear_layers(items, *_class_index(y, classes), folds, seed, desc, progress, n_jobs)
    else:
        jobs = [
            (X, y, train, test, C, max_iter, f"layer {layer}, fold {k}: ")
            for layer, X in items
            for k, (train, test) in enumerate(folds)
        ]
        acc = np.array(_run_folds(_logreg_task, jobs, n_jobs, desc, progress)).reshape(len(items), len(folds))
    _, counts = np.unique(y, return_counts=True)
    return ProbeResult(
        layers=[layer for layer, _ in items],
        accuracy_mean=acc.mean(1),
        accuracy_std=acc.std(1),
        fold_accuracy=acc,
        majority_baseline=float(counts.max() / counts.sum()),
        n_rows=int(y.shape[0]),
        method=method,
    )


def token_separability(
    features: LayerFeatures,
    labels: np.ndarray | Sequence,
    method: Method = "adam-linear",
    n_splits: int = 5,
    balance: bool = True,
    n_per_class: int | None = None,
    seed: int = 0,
    C: float = 1.0,
    max_iter: int = 10_000,
    progress: bool = True,
    classes: Sequence | None = None,
    n_jobs: int = 1,
) -> ProbeResult:
    """Per-layer accuracy of a linear probe telling the word classes apart (see the module docstring).

    features: {layer: (n, d)} or [(n, d)], the representations of n word occurrences (rows aligned
    across layers; e.g. `acts[site][layer][rows]` with `rows, labels = word_rows(...)`);
    labels (n,): the word of each row. balance: subsample every class to `n_per_class` (default: the
    rarest class's count; the paper has 1,668 per word) before cross-validation. classes: the class
    order (default: sorted), e.g. the words as given: the adam-linear probe lays rows out class by
    class in this order, as the official code, and folds them with plain shuffled `KFold`; logreg
    uses `StratifiedKFold`. ``seed=42`` is the official code's seed. n_jobs: processes fitting the folds
    (bit-identical results for every value; `probe_layers`).
    """
    _check_method(method)
    y = np.asarray(labels)
    items = _layer_items(features)
    _check_labels(y, items[0][1].shape[0], 1, "token_separability")
    if balance:
        keep = balance_classes(y, seed=seed, n_per_class=n_per_class)
        items = [(layer, X[keep]) for layer, X in items]
        y = y[keep]
    _check_labels(y, items[0][1].shape[0], n_splits, "token_separability")
    if method == "adam-linear":
        by_class = np.argsort(_class_index(y, classes)[0], kind="stable")
        items = [(layer, X[by_class]) for layer, X in items]
        y = y[by_class]
        splitter = KFold(n_splits=n_splits, shuffle=True, random_state=seed)
    else:
        splitter = StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed)
    return probe_layers(
        dict(items),
        y,
        splitter,
        method=method,
        C=C,
        max_iter=max_iter,
        seed=seed,
        progress=progress,
        desc="separability",
        classes=classes,
        n_jobs=n_jobs,
    )
