"""Token separability on synthetic data with known answers, and its helpers."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lime_probe.probes.separability import balance_classes, token_separability, word_rows, word_token_ids

WORDS = np.array([" is", " are", " was", " were"], dtype=object)


def synthetic(n_per_class=(60, 45, 80, 50), d=6, separation=6.0, seed=0):
    """Layer 0: pure noise (chance); layer 1: well-separated class means (perfectly separable)."""
    g = np.random.default_rng(seed)
    y = np.concatenate([[w] * n for w, n in zip(WORDS, n_per_class, strict=True)])
    means = g.standard_normal((len(WORDS), d)) * separation
    idx = np.array([list(WORDS).index(w) for w in y])
    noise = g.standard_normal((len(y), d))
    return {0: noise, 1: means[idx] + 0.3 * noise}, y


def test_known_answers_logreg():
    feats, y = synthetic()
    res = token_separability(feats, y, method="logreg", progress=False)
    assert res.layers == [0, 1]
    assert res.n_rows == 4 * 45  # balanced to the rarest class
    assert res.majority_baseline == pytest.approx(0.25)
    assert res.accuracy_mean[1] == pytest.approx(1.0)
    assert abs(res.accuracy_mean[0] - 0.25) < 0.15  # noise: chance level
    assert res.fold_accuracy.shape == (2, 5)
    np.testing.assert_allclose(res.accuracy_std, res.fold_accuracy.std(1))


def test_logreg_folds_equal_sklearn_cross_val_score():
    feats, y = synthetic(n_per_class=(30, 30, 30, 30), separation=0.8, seed=1)
    res = token_separability(feats, y, method="logreg", balance=False, seed=3, progress=False)
    for layer in (0, 1):
        pipe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=10_000))
        cv = StratifiedKFold(5, shuffle=True, random_state=3)
        np.testing.assert_allclose(res.fold_accuracy[layer], cross_val_score(pipe, feats[layer], y, cv=cv))


@pytest.mark.slow
def test_adam_linear_known_answers_and_determinism():
    # One epoch of batch-64 Adam takes few steps: enough rows for ~50 of them.
    feats, y = synthetic(n_per_class=(1000, 1000, 1000, 1000), separation=8.0)
    res = token_separability(
        {k: torch.from_numpy(v) for k, v in feats.items()}, y, method="adam-linear", progress=False
    )
    assert res.method == "adam-linear"
    assert res.accuracy_mean[1] > 0.95
    assert abs(res.accuracy_mean[0] - 0.25) < 0.15
    again = token_separability(feats, y, method="adam-linear", progress=False)
    np.testing.assert_array_equal(res.fold_accuracy, again.fold_accuracy)


def official_evaluate_accuracy(per_word: list[np.ndarray], n_splits: int = 5) -> dict[int, tuple]:
    """A plain rewrite of the official code's probe (src/analysis/classification.py, evaluate_accuracy).

    per_word[i]: (n_layers, n_i, d), the occurrences of word i per layer. Returns {layer: (mean, std, fold
    accuracies)} of the test accuracy. Runs at one torch thread, as `token_separability` does.
    """
    from sklearn.model_selection import KFold
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    res = {}
    try:
        torch.manual_seed(42)
        for layer in range(per_word[0].shape[0]):
            X = np.concatenate([w[layer] for w in per_word])
            y = np.concatenate([[i] * w.shape[1] for i, w in enumerate(per_word)])
            test_accs_per_fold = []
            for train_idx, test_idx in KFold(n_splits=n_splits, shuffle=True, random_state=42).split(X):
                trainset = TensorDataset(
                    torch.tensor(X[train_idx], dtype=torch.float32),
                    torch.tensor(y[train_idx], dtype=torch.long),
                )
                testset = TensorDataset(
                    torch.tensor(X[test_idx], dtype=torch.float32),
                    torch.tensor(y[test_idx], dtype=torch.long),
                )
                trainloader = DataLoader(trainset, batch_size=64, shuffle=True)
                testloader = DataLoader(testset, batch_size=64, shuffle=False)
                clf = nn.Linear(trainset[0][0].shape[-1], len(per_word))
                ce = nn.CrossEntropyLoss()
                optimizer = torch.optim.Adam(clf.parameters(), lr=1e-2)
                test_accs = []
                for _epoch in range(1):
                    for inputs, targets in trainloader:
                        loss = ce(clf(inputs), targets)
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                    with torch.no_grad():
                        for inputs, targets in testloader:
                            test_accs.append((clf(inputs).argmax(-1) == targets).float().mean().item())
                test_accs_per_fold.append(np.mean(test_accs))
            res[layer] = (np.mean(test_accs_per_fold), np.std(test_accs_per_fold), test_accs_per_fold)
    finally:
        torch.set_num_threads(threads)
    return res


@pytest.mark.parametrize(
    "n_jobs", [1, pytest.param(2, marks=pytest.mark.slow)]
)  # 2: worker start-up takes seconds
def test_adam_linear_is_bit_identical_to_the_official_loop(n_jobs):
    """Fixed features, seed 42: the default probe equals the official loop bit for bit, although its rows
    come interleaved (as in a text) and it regroups them word by word in the given order; also with its
    folds fitted in two processes."""
    g = np.random.default_rng(7)
    counts, d, layers = (150, 130, 170, 140), 12, 3
    means = g.standard_normal((layers, 4, d))
    per_word = [
        (means[:, i, None, :] + 1.5 * g.standard_normal((layers, n, d))).astype(np.float32)
        for i, n in enumerate(counts)
    ]
    want = official_evaluate_accuracy(per_word)
    # the same rows interleaved as in a text (each word's occurrences keep their order), labelled by word
    X = np.concatenate(per_word, axis=1)
    y = np.concatenate([[w] * n for w, n in zip(WORDS, counts, strict=True)])
    perm = g.permutation(len(y))
    for w in WORDS:
        at = np.flatnonzero(y[perm] == w)
        perm[at] = np.sort(perm[at])
    before = torch.random.get_rng_state()
    got = token_separability(
        {la: torch.from_numpy(X[la][perm]) for la in range(layers)},
        y[perm],
        balance=False,
        seed=42,
        classes=list(WORDS),
        progress=False,
        n_jobs=n_jobs,
    )
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's generator is untouched
    assert got.method == "adam-linear"
    for la in range(layers):
        np.testing.assert_array_equal(got.fold_accuracy[la], want[la][2])
        assert (got.accuracy_mean[la], got.accuracy_std[la]) == (want[la][0], want[la][1])
    # a one-epoch probe on these features stays well below the ceiling a converged classifier reaches
    assert 0.3 < got.accuracy_mean.mean() < 0.99


@pytest.mark.parametrize("method", ["adam-linear", "logreg"])
@pytest.mark.slow
def test_parallel_folds_are_bit_identical_to_the_serial_run(method):
    feats, y = synthetic(n_per_class=(150, 120, 160, 130), d=10, separation=0.7, seed=2)
    feats[2] = np.tanh(feats[1] @ np.random.default_rng(3).standard_normal((10, 10)))
    torch.set_num_threads(2)  # the caller's thread count must not matter either
    try:
        serial = token_separability(feats, y, method=method, seed=5, classes=list(WORDS), progress=False)
        parallel = token_separability(
            feats, y, method=method, seed=5, classes=list(WORDS), progress=False, n_jobs=2
        )
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(1)
    assert 0.3 < serial.accuracy_mean.mean() < 0.99  # not at a floor or ceiling, where equality is cheap
    np.testing.assert_array_equal(parallel.fold_accuracy, serial.fold_accuracy)
    np.testing.assert_array_equal(parallel.accuracy_mean, serial.accuracy_mean)


def test_classes_must_cover_the_labels():
    X = np.random.default_rng(0).standard_normal((10, 3))
    with pytest.raises(ValueError, match=r"labels \['b'\] are not among the classes \['a'\]"):
        token_separability({0: X}, ["a", "b"] * 5, classes=["a"], progress=False)


def test_balance_classes():
    y = np.array(["a"] * 10 + ["b"] * 3 + ["c"] * 7)
    keep = balance_classes(y, seed=1)
    assert sorted(np.unique(y[keep], return_counts=True)[1]) == [3, 3, 3]
    np.testing.assert_array_equal(keep, balance_classes(y, seed=1))
    assert len(balance_classes(y, n_per_class=2)) == 6
    with pytest.raises(ValueError, match="class 'b' has only 3 rows"):
        balance_classes(y, n_per_class=5)


def word_level_tokenizer():
    vocab = {"[UNK]": 0, "is": 1, "are": 2, "was": 3, "were": 4, "the": 5, "cat": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_word_token_ids_and_rows():
    tok = word_level_tokenizer()
    ids = word_token_ids(tok)
    assert ids == {" is": 1, " are": 2, " was": 3, " were": 4}
    rows, labels = word_rows(torch.tensor([5, 1, 6, 4, 1, 0, 3]), ids)
    np.testing.assert_array_equal(rows, [1, 3, 4, 6])
    assert labels.tolist() == [" is", " were", " is", " was"]
    with pytest.raises(ValueError, match="'the cat' is 2 tokens"):
        word_token_ids(tok, ["the cat"])
    with pytest.raises(ValueError, match="unknown token"):
        word_token_ids(tok, ["dog"])
    with pytest.raises(ValueError, match="same token id"):
        word_token_ids(tok, ["is", " is"])


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (
            {"features": {0: np.zeros((8, 2)), 3: np.full((8, 2), np.nan)}},
            ValueError,
            "layer 3: features contain NaN",
        ),
        ({"labels": ["a"] * 4 + ["b"] * 4}, ValueError, "class 'a' has only 4 rows; 5-fold"),
        ({"labels": ["a"] * 7 + ["b"], "balance": False}, ValueError, "class 'b' has only 1 rows"),
        ({"labels": ["a"] * 8}, ValueError, "at least 2 classes"),
        ({"labels": ["a", "b"] * 3}, ValueError, "shape"),
        ({"features": {0: np.zeros((8, 2)), 1: np.zeros((7, 2))}}, ValueError, "layer 1: 7 rows"),
        ({"method": "svm"}, ValueError, "method"),
        ({"features": {}}, ValueError, "no layers"),
    ],
)
def test_bad_input(kwargs, err, match):
    args = {"features": {0: np.random.default_rng(0).standard_normal((8, 2))}, "labels": ["a", "b"] * 4}
    args.update(kwargs)
    with pytest.raises(err, match=match):
        token_separability(progress=False, **args)


@pytest.mark.parametrize("n_jobs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_non_convergence_is_a_settings_error(n_jobs):
    feats, y = synthetic(separation=0.5)
    where = "layer 0, fold 0" if n_jobs == 1 else r"layer \d, fold \d"  # in parallel: the first to fail
    with pytest.raises(ValueError, match=rf"^{where}: .*did not converge in max_iter=1; raise max_iter"):
        token_separability(feats, y, method="logreg", max_iter=1, progress=False, n_jobs=n_jobs)


def test_rows_carry_each_layers_mean_feature_norm_beside_both_probes():
    """The one-epoch probe reads raw features (scale matters), the converged one z-scores them (scale does
    not): the rows hold each layer's mean row norm, written out as a loop, and rescaling the features
    moves the first probe's accuracy but not the second's."""
    import math

    from lime_probe.specs.separability import separability_rows

    rng = np.random.default_rng(3)
    words = (" is", " are")
    y = np.array([w for w in words for _ in range(600)], dtype=object)  # 15 Adam steps a fold
    X = rng.normal(size=(1200, 4)) + np.where(y == " is", 2.0, -2.0)[:, None]
    feats = {0: X, 1: 0.01 * X}
    rows = {
        m: separability_rows({"m": (feats, y)}, site="values", classes=words, method=m)
        for m in ("adam-linear", "logreg")
    }
    for r in rows["logreg"]:
        want = sum(math.sqrt(sum(v * v for v in row)) for row in feats[r["layer"]]) / 1200
        assert r["feature_norm"] == pytest.approx(want, rel=1e-12)
    logreg = [r["accuracy_mean"] for r in rows["logreg"]]
    assert logreg[0] == pytest.approx(logreg[1], abs=1e-9)  # standardised: the scale is gone
    # the same layer position (so the same probe init and batches), raw against 100x smaller features
    raw = separability_rows({"m": ({0: X, 1: X}, y)}, site="values", classes=words, method="adam-linear")
    assert raw[1]["accuracy_mean"] - rows["adam-linear"][1]["accuracy_mean"] > 0.2


def test_rescaling_features_moves_the_one_epoch_probe_but_not_the_converged_one():
    """docs/probes.md: the one-epoch probe measures how fast Adam fits the raw features (their scale
    matters); the converged standardised probe measures separation (scale-free)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 32))
    y = np.repeat(np.arange(4), 100)
    X = (centres[y] + 1.5 * rng.normal(size=(400, 32))).astype(np.float32)
    scales = (1.0, 0.02)

    def acc(method, scale):
        res = token_separability({0: X * scale}, y, method=method, seed=0, progress=False)
        return float(res.accuracy_mean[0])

    logreg = [acc("logreg", s) for s in scales]
    one_epoch = [acc("adam-linear", s) for s in scales]
    assert logreg[0] == pytest.approx(logreg[1], abs=1e-6)
    assert one_epoch[0] - one_epoch[1] > 0.1  # the same classes, fitted far less in one epoch when small
