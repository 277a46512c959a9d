"""BLiMP (Warstadt et al. 2020): 67 paradigms of 1,000 minimal pairs (a grammatical and an
ungrammatical sentence differing minimally). Two uses, both per paradigm:

- **Probe** (paper Sec. 5.3, Table 2, Appendix D): mean-pooled per-layer representations of the good and
  bad sentences, a logistic-regression probe good vs bad (the paper's; standardising the features first is
  ours) with 5-fold cross-validation grouped by `pairID` (the paper splits by minimal pair: the two
  sentences of a pair never straddle train and test), mean accuracy per layer.
- **Minimal-pair scoring**, the field's standard, as lm-evaluation-harness: each sentence is scored by
  the sum of its tokens' log-probabilities given a one-token prefix, the tokenizer's BOS token (its EOS
  token where it has no BOS, as the harness does), and a pair is correct when good > bad (strictly; an
  exact tie, practically only for identical token sequences, counts as wrong). The harness scores the
  sentence after a space (its BLiMP task's target delimiter): ``leading_space=True`` does too and gives
  its per-pair log-probabilities; the default (False, ours) scores the sentence as it tokenizes at the
  start of a text. With a BPE tokenizer the two tokenize the first word differently.

For a causal LM both come from one forward pass over the scored sequences (`scoring_sequences`: the prefix,
then the sentence's tokens): the probe mean-pools every position of that sequence (ours; for a tokenizer
that adds BOS itself this is the sentence as it tokenizes, for one that adds nothing the prefix is an extra
first token), and `extract(..., logprobs=True)` returns the scores (`minimal_pair_scores`).

The paper's Table 2 protocol (`paper_layers`, `fit_pairs`, `blimp_layer_table`, `blimp_table`): probes on
mean-pooled values and hidden states of the upper blocks (10-16 of 16; the same upper fraction, 7/16, for
other depths), reported as the paper's Tables 2 and 11 list them, per block: the mean over tasks +- a spread;
and as one number per model and site: each task's mean over those blocks, then the mean over tasks +- a
spread (ours). The spread (`SPREADS`) is by default "folds", the mean over tasks of each task's std over its
five CV folds (a reading: both captions say "(5-fold CV)" and Fig. 2 gives "standard deviation over five
cross-validation folds"); "tasks" is the std over tasks of the task accuracies.

Phenomena are the `linguistics_term` field of the released data: 13 values, since it lists the two
s-selection paradigms apart where the BLiMP paper's 12 phenomena fold them into argument structure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from sklearn.model_selection import GroupKFold
from tqdm.auto import tqdm

from lime_probe.probes.router_weights import unwrap_model
from lime_probe.probes.separability import LayerFeatures, Method, ProbeResult, probe_layers
from lime_probe.protocol import BLIMP_SPREADS, PAPER_LAYER_FRACTION

HUB_ID = "nyu-mll/blimp"
# What a table's "+-" is: "folds", the mean over tasks of each task's std over CV folds (the default), or
# "tasks", the std over tasks of the task accuracies (both ddof=0).
Spread = Literal["folds", "tasks"]
SPREADS = BLIMP_SPREADS
REQUIRED_FIELDS = ("sentence_good", "sentence_bad", "UID", "pairID", "linguistics_term")


def _check_fields(columns: Sequence[str], where: str) -> None:
    missing = [f for f in REQUIRED_FIELDS if f not in columns]
    if missing:
        raise ValueError(
            f"{where}: not BLiMP data, missing field(s) {missing} (needs {list(REQUIRED_FIELDS)})"
        )


def _local_files(source: Path, paradigms: Sequence[str] | None) -> list[Path]:
    if source.is_file():
        return [source]
    files = sorted(source.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no BLiMP .jsonl files in {source}")
    if paradigms is None:
        return files
    by_name = {f.stem: f for f in files}
    unknown = [p for p in paradigms if p not in by_name]
    if unknown:
        raise ValueError(
            f"paradigm(s) {unknown} not in {source}; available: {sorted(by_name)[:5]}... ({len(by_name)})"
        )
    return [by_name[p] for p in paradigms]


def _read_jsonl(path: Path) -> list[dict]:
    """The records of one BLiMP JSONL file, each checked for `REQUIRED_FIELDS`."""
    from lime_model.data import jsonl_records

    try:
        lines = list(jsonl_records(path))
    except ValueError as e:
        raise ValueError(f"could not read BLiMP JSONL {e}") from None
    records = []
    for n, record in lines:
        _check_fields(list(record), f"{path}:{n}")
        records.append(record)
    if not records:
        raise ValueError(f"{path}: empty file")
    return records


def _records_to_dataset(records: Sequence[dict], where: str) -> Any:
    """A `datasets.Dataset` with the union of the records' fields (None where a record lacks one).

    Paradigm files differ in their optional fields (`one_prefix_*`, `two_prefix_*`, `crucial_item`, ...),
    so one schema cannot be inferred from the first file (as `load_dataset("json")` does).
    """
    import datasets

    columns = list(dict.fromkeys(k for r in records for k in r))
    try:
        return datasets.Dataset.from_dict({c: [r.get(c) for r in records] for c in columns})
    except (TypeError, ValueError, OverflowError) as e:  # pyarrow: a field with mixed types across records
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"could not read BLiMP JSONL {where}: {first}") from None


def load_blimp(
    source: str | os.PathLike | Sequence[str | os.PathLike] = HUB_ID, paradigms: Sequence[str] | None = None
) -> Any:
    """BLiMP rows as a `datasets.Dataset` with at least the fields `REQUIRED_FIELDS`.

    source: a folder of `<paradigm>.jsonl` files (e.g. the 67 files of the release), one or more JSONL
    files, or the hub id "nyu-mll/blimp" (needs a network; one dataset config per paradigm).
    paradigms: paradigm names (UIDs) to keep; all by default.
    """
    import datasets

    if paradigms is not None and (isinstance(paradigms, str) or not paradigms):
        raise ValueError(f"paradigms must be a non-empty list of paradigm names, got {paradigms!r}")
    if isinstance(source, (str, os.PathLike)) and str(source) == HUB_ID and not Path(source).exists():
        names = list(paradigms) if paradigms is not None else datasets.get_dataset_config_names(HUB_ID)
        parts = [datasets.load_dataset(HUB_ID, name, split="train") for name in names]
        ds = datasets.concatenate_datasets(parts)
        _check_fields(ds.column_names, HUB_ID)
        return ds
    sources = [Path(source)] if isinstance(source, (str, os.PathLike)) else [Path(s) for s in source]
    if not sources:
        raise ValueError("load_blimp: no source given")
    files = []
    for src in sources:
        if not src.exists():
            raise FileNotFoundError(f"BLiMP source not found: {src}")
        # A single folder: pick the paradigms' files by name; otherwise the UID filter below selects.
        files += _local_files(src, paradigms if len(sources) == 1 and src.is_dir() else None)
    ds = _records_to_dataset([r for f in files for r in _read_jsonl(f)], str(source))
    if paradigms is not None:
        wanted = set(paradigms)
        ds = ds.filter(lambda uid: uid in wanted, input_columns="UID")
        missing = wanted - set(ds.unique("UID"))
        if missing:
            raise ValueError(f"paradigm(s) {sorted(missing)} not found in {source}")
    if len(ds) == 0:
        raise ValueError(f"no BLiMP rows in {source}")
    return ds


# ---------------------------------------------------------------------------------------------------
# The paper's protocol (Table 2)


def paper_layers(n_layers: int, site: str = "values") -> list[int]:
    """Layer indices of `site` (as `lime_probe.extract` numbers them) for the paper's BLiMP layer range.

    The top round(7/16 * n_layers) blocks (half rounds up; at least one): blocks 10-16 of 16, 1-indexed.
    Block b's values/keys are index b-1 of their site; its output is ``hidden`` index b.
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    if site == "final":
        raise ValueError("site 'final' has a single layer; the BLiMP layer range applies to per-block sites")
    count = max(1, math.floor(PAPER_LAYER_FRACTION * n_layers + 0.5))
    blocks = range(n_layers - count + 1, n_layers + 1)
    return list(blocks) if site == "hidden" else [b - 1 for b in blocks]


def fit_pairs(
    data: Any, tokenizer: Any, max_positions: int | None, leading_space: bool = False
) -> tuple[np.ndarray, dict[str, int]]:
    """Pairs whose two sentences fit the model: (indices of the kept rows, {paradigm: pairs skipped}).

    A sentence fits when it has at most `max_positions` tokens both as extracted (with the tokenizer's
    special tokens) and as scored (`scoring_sequences`, with `leading_space`); None keeps everything.
    Every paradigm is listed in the counts (0 when nothing was skipped).

    Raises:
        ValueError: naming the paradigm(s) all of whose pairs are too long.
    """
    uids = np.asarray(list(data["UID"]), dtype=object)
    keep = np.ones(len(uids), dtype=bool)
    if max_positions is not None:
        for column in ("sentence_good", "sentence_bad"):
            sentences = list(data[column])
            # measured here, so no "longer than the maximum sequence length" warning (verbose=False)
            with_special = tokenizer(sentences, verbose=False)["input_ids"]
            scored = _encode(tokenizer, sentences, leading_space)
            lengths = [max(len(a), len(b) + 1) for a, b in zip(with_special, scored, strict=True)]
            keep &= np.array(lengths) <= max_positions
    skipped = {p: int((~keep[uids == p]).sum()) for p in sorted(set(uids))}
    empty = [p for p in skipped if not keep[uids == p].any()]
    if empty:
        raise ValueError(
            f"BLiMP paradigm(s) {empty}: every pair has a sentence longer than the model's "
            f"{max_positions} positions"
        )
    return np.flatnonzero(keep), skipped


def _check_spread(spread: str) -> None:
    if spread not in SPREADS:
        raise ValueError(f"spread must be one of {SPREADS}, got {spread!r}")


def _spread(task_acc: np.ndarray, fold_acc: np.ndarray, spread: Spread) -> float:
    """The "+-" of one table cell from each task's accuracy (tasks,) and its per-fold accuracy (tasks,
    folds): "folds", the mean over tasks of each task's std over folds; "tasks", the std over tasks."""
    return float(fold_acc.std(1).mean() if spread == "folds" else task_acc.std())


def _layers_of(per_task: Mapping[str, ProbeResult], where: str) -> list:
    layers = {tuple(r.layers) for r in per_task.values()}
    if len(layers) != 1:
        raise ValueError(f"{where} probe different layers {layers}")
    return list(layers.pop())


def blimp_table(
    results: Mapping[tuple[str, str], Mapping[str, ProbeResult]], spread: Spread = "folds"
) -> list[dict]:
    """Table 2 rows from probe results {(model, site): {task: ProbeResult}}, one row per (model, site).

    A task's accuracy is its mean CV accuracy over the probed layers (probe `paper_layers` only), its fold
    accuracies the mean over those layers of each fold's; each row holds `accuracy_mean` over tasks,
    `accuracy_std` (`spread`: "folds", the mean over tasks of each task's fold std, or "tasks", the std over
    tasks; ddof=0), `spread`, `n_tasks`, the probed `layers`, and `tasks`: {task: accuracy}.
    """
    _check_spread(spread)
    rows = []
    for (model, site), per_task in results.items():
        if not per_task:
            raise ValueError(f"blimp_table: no tasks for model {model!r}, site {site!r}")
        layers = _layers_of(per_task, f"blimp_table: tasks of model {model!r}, site {site!r}")
        accuracy = {task: float(np.mean(r.accuracy_mean)) for task, r in per_task.items()}
        values = np.array(list(accuracy.values()))
        folds = np.array([np.asarray(r.fold_accuracy).mean(0) for r in per_task.values()])  # (tasks, folds)
        rows.append(
            {
                "model": model,
                "site": site,
                "accuracy_mean": float(values.mean()),
                "accuracy_std": _spread(values, folds, spread),
                "spread": spread,
                "n_tasks": len(values),
                "layers": layers,
                "tasks": accuracy,
            }
        )
    return rows


def blimp_layer_table(
    results: Mapping[tuple[str, str], Mapping[str, ProbeResult]], spread: Spread = "folds"
) -> list[dict]:
    """Table 2/11 rows (one accuracy per layer) from probe results {(model, site): {task: ProbeResult}}.

    One row per (model, site, probed layer): `block` (1-indexed, as the paper numbers layers: a per-block
    site's index + 1, ``hidden``'s index, the output of that block), `layer` (the site's index),
    `accuracy_mean` over tasks of that layer's CV accuracy, `accuracy_std` (`spread`: "folds", the mean
    over tasks of each task's std over folds, or "tasks", the std over tasks; ddof=0), `spread` and
    `n_tasks`.
    """
    _check_spread(spread)
    rows = []
    for (model, site), per_task in results.items():
        layers = _layers_of(per_task, f"blimp_layer_table: tasks of model {model!r}, site {site!r}")
        acc = np.array([r.accuracy_mean for r in per_task.values()])  # (tasks, layers)
        folds = np.array([r.fold_accuracy for r in per_task.values()])  # (tasks, layers, folds)
        for k, layer in enumerate(layers):
            rows.append(
                {
                    "model": model,
                    "site": site,
                    "block": int(layer) if site == "hidden" else int(layer) + 1,
                    "layer": layer,
                    "accuracy_mean": float(acc[:, k].mean()),
                    "accuracy_std": _spread(acc[:, k], folds[:, k], spread),
                    "spread": spread,
                    "n_tasks": len(acc),
                }
            )
    return rows


# ---------------------------------------------------------------------------------------------------
# Probe


def blimp_probe(
    good: LayerFeatures,
    bad: LayerFeatures,
    pair_ids: Sequence | np.ndarray,
    n_splits: int = 5,
    method: Method = "logreg",
    seed: int = 0,
    C: float = 1.0,
    max_iter: int = 10_000,
    progress: bool = True,
    n_jobs: int = 1,
) -> ProbeResult:
    """Good-vs-bad probe of one paradigm: per layer, CV accuracy of a logistic regression (paper Sec. 5.3).

    good, bad: {layer: (n_pairs, d)} or [(n_pairs, d)], the mean-pooled representation of each pair's
    good and bad sentence (row k of both is pair `pair_ids[k]`); 5-fold `GroupKFold` by pair (shuffled,
    seeded). n_jobs: processes fitting the folds (bit-identical results for every value;
    `separability.probe_layers`). Returns a `ProbeResult` (accuracy per layer, majority baseline 0.5).
    """
    pair_ids = np.asarray(pair_ids)
    g_items = dict(good) if isinstance(good, Mapping) else dict(enumerate(good))
    b_items = dict(bad) if isinstance(bad, Mapping) else dict(enumerate(bad))
    if list(g_items) != list(b_items):
        raise ValueError(
            f"good and bad features must have the same layers, got {list(g_items)} and {list(b_items)}"
        )
    if len(np.unique(pair_ids)) < n_splits:
        raise ValueError(f"blimp_probe: {len(np.unique(pair_ids))} pairs are too few for {n_splits}-fold CV")
    features = {}
    for layer in g_items:
        G, B = np.asarray(g_items[layer]), np.asarray(b_items[layer])
        if G.shape != B.shape or G.ndim != 2 or G.shape[0] != pair_ids.shape[0]:
            raise ValueError(
                f"layer {layer}: good {G.shape} and bad {B.shape} must both be (n_pairs={pair_ids.shape[0]}, d)"
            )
        features[layer] = np.concatenate([G, B])
    labels = np.repeat([1, 0], pair_ids.shape[0])
    splitter = GroupKFold(n_splits=n_splits, shuffle=True, random_state=seed)
    return probe_layers(
        features,
        labels,
        splitter,
        groups=np.concatenate([pair_ids, pair_ids]),
        method=method,
        C=C,
        max_iter=max_iter,
        seed=seed,
        progress=progress,
        desc="BLiMP probe",
        n_jobs=n_jobs,
    )


# ---------------------------------------------------------------------------------------------------
# Minimal-pair scoring


def prefix_token_id(tokenizer: Any) -> int:
    """The one-token context every sentence is scored after: BOS, else EOS (as lm-evaluation-harness)."""
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            return int(token)
    raise ValueError("the tokenizer has neither a BOS nor an EOS token to use as the scoring prefix")


def _encode(tokenizer: Any, sentences: Sequence[str], leading_space: bool) -> list[list[int]]:
    """Each sentence's token ids without special tokens, after a space with `leading_space`."""
    texts = [" " + s for s in sentences] if leading_space else list(sentences)
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def scoring_sequences(
    tokenizer: Any, sentences: Sequence[str], leading_space: bool = False
) -> list[list[int]]:
    """The token ids each sentence is scored as: `prefix_token_id`, then the sentence encoded without
    special tokens (after a space with `leading_space`, lm-evaluation-harness's convention) -> one list
    per sentence. ValueError for a sentence with no tokens."""
    prefix = prefix_token_id(tokenizer)
    encoded = _encode(tokenizer, sentences, leading_space)
    for s, ids in zip(sentences, encoded, strict=True):
        if not ids:
            raise ValueError(f"sentence {s!r} has no tokens")
    return [[prefix, *ids] for ids in encoded]


def sentence_logprobs(
    model: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    batch_size: int = 32,
    progress: bool = True,
    leading_space: bool = False,
) -> np.ndarray:
    """Sum of token log-probabilities of each sentence after the prefix token -> (n,) float64.

    Tokens are the sentence encoded without special tokens (after a space with `leading_space`:
    `scoring_sequences`); batches (sorted by length to limit padding) are right-padded with an attention
    mask, so padding never changes a score.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not sentences:
        raise ValueError("sentence_logprobs: no sentences given")
    from lime_probe.extraction.forward import token_logprobs

    module = unwrap_model(model)
    seqs = scoring_sequences(tokenizer, sentences, leading_space)
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    longest = max(len(s) for s in seqs)
    if limit is not None and longest > limit:
        raise ValueError(
            f"a sentence has {longest} tokens with the prefix, over the model's {limit} positions"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else seqs[0][0]
    device = next(module.parameters()).device
    order = np.argsort([len(s) for s in seqs], kind="stable")
    out = np.empty(len(seqs))
    was_training = module.training
    module.eval()
    try:
        with torch.inference_mode():
            for start in tqdm(
                range(0, len(seqs), batch_size), desc="scoring", unit="batch", disable=not progress
            ):
                idx = order[start : start + batch_size]
                width = max(len(seqs[i]) for i in idx)
                ids = torch.full((len(idx), width), pad, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):
                    ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
                    mask[row, : len(seqs[i])] = 1
                ids, mask = ids.to(device), mask.to(device)
                logits = module(input_ids=ids, attention_mask=mask).logits
                out[idx] = token_logprobs(logits, ids, mask).cpu().numpy()
    finally:
        module.train(was_training)
    return out


@dataclass(frozen=True)
class BlimpScores:
    """Minimal-pair results. Per pair (n,): logprob_good, logprob_bad, correct (good > bad), paradigm,
    phenomenon. per_paradigm: accuracy over each paradigm's pairs; per_phenomenon: the mean of its
    paradigms' accuracies; mean_over_paradigms: the unweighted mean of per_paradigm (the usual
    "BLiMP accuracy", equal to the accuracy over all pairs when every paradigm has 1,000 pairs);
    mean_over_phenomena: the unweighted mean of per_phenomenon (weights phenomena equally)."""

    logprob_good: np.ndarray
    logprob_bad: np.ndarray
    correct: np.ndarray
    paradigm: np.ndarray
    phenomenon: np.ndarray
    per_paradigm: dict[str, float]
    per_phenomenon: dict[str, float]
    mean_over_paradigms: float
    mean_over_phenomena: float


def score_minimal_pairs(
    model: Any,
    tokenizer: Any,
    data: Any,
    batch_size: int = 32,
    progress: bool = True,
    leading_space: bool = False,
) -> BlimpScores:
    """Score BLiMP pairs (a `load_blimp` dataset, or any mapping of column lists with `REQUIRED_FIELDS`);
    `leading_space`: each sentence after a space, as lm-evaluation-harness scores it (`scoring_sequences`)."""
    columns = list(getattr(data, "column_names", None) or data.keys())
    _check_fields(columns, "score_minimal_pairs data")
    good, bad = list(data["sentence_good"]), list(data["sentence_bad"])
    if not good:
        raise ValueError("score_minimal_pairs: no pairs given")
    scores = sentence_logprobs(
        model, tokenizer, good + bad, batch_size=batch_size, progress=progress, leading_space=leading_space
    )
    return minimal_pair_scores(scores[: len(good)], scores[len(good) :], data)


def minimal_pair_scores(lp_good: np.ndarray, lp_bad: np.ndarray, data: Any) -> BlimpScores:
    """`BlimpScores` from each pair's summed log-probabilities (n,) of its good and bad sentence (as
    `sentence_logprobs` or ``extract(..., logprobs=True)`` on `scoring_sequences` give them) and the pairs'
    data (``UID`` and ``linguistics_term`` columns, row k = pair k)."""
    lp_good, lp_bad = np.asarray(lp_good, dtype=np.float64), np.asarray(lp_bad, dtype=np.float64)
    if lp_good.shape != lp_bad.shape or lp_good.shape != (len(data["UID"]),):
        raise ValueError(
            f"minimal_pair_scores: {lp_good.shape} good and {lp_bad.shape} bad scores for {len(data['UID'])} pairs"
        )
    correct = lp_good > lp_bad
    paradigm = np.array(list(data["UID"]), dtype=object)
    phenomenon = np.array(list(data["linguistics_term"]), dtype=object)
    per_paradigm = {p: float(correct[paradigm == p].mean()) for p in sorted(set(paradigm))}
    phenomenon_of = dict(zip(paradigm, phenomenon, strict=True))
    per_phenomenon = {
        ph: float(np.mean([acc for p, acc in per_paradigm.items() if phenomenon_of[p] == ph]))
        for ph in sorted(set(phenomenon))
    }
    return BlimpScores(
        logprob_good=lp_good,
        logprob_bad=lp_bad,
        correct=correct,
        paradigm=paradigm,
        phenomenon=phenomenon,
        per_paradigm=per_paradigm,
        per_phenomenon=per_phenomenon,
        mean_over_paradigms=float(np.mean(list(per_paradigm.values()))),
        mean_over_phenomena=float(np.mean(list(per_phenomenon.values()))),
    )
