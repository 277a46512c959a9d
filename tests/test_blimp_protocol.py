"""The paper's BLiMP protocol: layer range, long-sentence skipping, Table-2 rows, folds grouped by pair."""

import numpy as np
import pytest
from helpers import PAIRS, tiny_tokenizer

import lime_probe.probes.blimp as blimp
from lime_probe.probes.blimp import blimp_layer_table, blimp_probe, blimp_table, fit_pairs, paper_layers
from lime_probe.probes.separability import ProbeResult


def test_paper_layers_are_blocks_10_to_16_of_16():
    assert paper_layers(16, "values") == list(range(9, 16))  # blocks 10..16, 0-indexed value sites
    assert paper_layers(16, "hidden") == list(range(10, 17))  # X_b is block b's output
    assert paper_layers(2, "values") == [1] and paper_layers(1, "hidden") == [1]


@pytest.mark.parametrize("n_layers", range(1, 65))
def test_paper_layers_keep_the_upper_seven_sixteenths(n_layers):
    count = max(1, (7 * n_layers + 8) // 16)  # 7/16 of the blocks, half rounded up, integer arithmetic
    assert paper_layers(n_layers, "values") == list(range(n_layers - count, n_layers))
    assert paper_layers(n_layers, "hidden") == list(range(n_layers - count + 1, n_layers + 1))


def test_paper_layers_errors():
    with pytest.raises(ValueError, match="positive integer"):
        paper_layers(0)
    with pytest.raises(ValueError, match="site 'final'"):
        paper_layers(16, "final")


def pairs_data():
    long = " ".join(["the cat is on the mat"] * 6) + "."
    rows = [(g, b, "short_p") for g, b in PAIRS] + [(long, b, "mixed_p") for _, b in PAIRS[:2]]
    rows += [(g, b, "mixed_p") for g, b in PAIRS[2:]] + [(long, long, "long_p")]
    good, bad, uid = map(list, zip(*rows, strict=True))
    return {"sentence_good": good, "sentence_bad": bad, "UID": uid}


def test_fit_pairs_skips_long_sentences_per_paradigm():
    tok = tiny_tokenizer()
    data = pairs_data()

    def fits(s, limit):  # as extracted (BOS/EOS the tokenizer adds) and as scored (prefix + tokens)
        return max(len(tok(s)["input_ids"]), len(tok.encode(s, add_special_tokens=False)) + 1) <= limit

    limit = 16
    good, bad = data["sentence_good"], data["sentence_bad"]
    want = [i for i in range(len(good) - 1) if fits(good[i], limit) and fits(bad[i], limit)]
    with pytest.raises(ValueError, match=r"paradigm\(s\) \['long_p'\]: every pair .* 16 positions"):
        fit_pairs(data, tok, limit)
    data = {k: v[:-1] for k, v in data.items()}  # without the all-long paradigm
    kept, skipped = fit_pairs(data, tok, limit)
    assert kept.tolist() == want
    assert skipped == {"mixed_p": 2, "short_p": 0}
    kept, skipped = fit_pairs(data, tok, None)
    assert kept.tolist() == list(range(len(data["UID"]))) and set(skipped.values()) == {0}


# fold offsets (mean 0) added to a task's accuracy: fold std 0.02 for "a", 0.04 for "b" (ddof=0)
WIGGLE = {
    "a": 0.02 * np.array([1, -1, 1, -1, 0]) * np.sqrt(5 / 4),
    "b": 0.04 * np.array([1, -1, 0, 1, -1]) * np.sqrt(5 / 4),
}


def result(acc_per_layer, layers, wiggle=None):
    """A ProbeResult whose every layer's five folds are its accuracy plus `wiggle` (default: none)."""
    acc = np.asarray(acc_per_layer, dtype=float)
    folds = acc[:, None] + (np.zeros(5) if wiggle is None else np.asarray(wiggle))[None, :]
    return ProbeResult(layers, folds.mean(1), folds.std(1), folds, 0.5, 100, "logreg")


def test_blimp_table_mean_over_tasks_and_either_spread():
    res = {
        ("LIMe", "values"): {
            "a": result([0.9, 0.8], [9, 10], WIGGLE["a"]),
            "b": result([0.6, 0.7], [9, 10], WIGGLE["b"]),
        },
        ("LLaMA", "hidden"): {"a": result([0.5], [16]), "b": result([0.7], [16]), "c": result([0.9], [16])},
    }
    assert np.std(WIGGLE["a"]) == pytest.approx(0.02) and np.std(WIGGLE["b"]) == pytest.approx(0.04)
    rows = blimp_table(res)  # default: the mean over tasks of each task's fold std
    per_task = [0.85, 0.65]
    assert rows[0]["model"] == "LIMe" and rows[0]["site"] == "values" and rows[0]["layers"] == [9, 10]
    assert rows[0]["accuracy_mean"] == pytest.approx(np.mean(per_task))
    assert rows[0]["accuracy_std"] == pytest.approx(0.03) and rows[0]["spread"] == "folds"
    assert rows[0]["tasks"] == pytest.approx({"a": 0.85, "b": 0.65})
    assert rows[1]["n_tasks"] == 3 and rows[1]["accuracy_std"] == 0.0  # folds that agree
    over = blimp_table(res, spread="tasks")
    assert [r["accuracy_mean"] for r in over] == [r["accuracy_mean"] for r in rows]  # only the +- changes
    assert over[0]["accuracy_std"] == pytest.approx(np.std(per_task)) and over[0]["spread"] == "tasks"
    assert over[1]["accuracy_std"] == pytest.approx(np.std([0.5, 0.7, 0.9]))
    with pytest.raises(ValueError, match="different layers"):
        blimp_table({("m", "values"): {"a": result([0.5], [1]), "b": result([0.5], [2])}})
    with pytest.raises(ValueError, match="spread must be one of"):
        blimp_table(res, spread="layers")


def test_blimp_layer_table_fold_spread_is_the_mean_of_each_tasks_fold_std():
    res = {("LIMe", "values"): {"a": result([0.9], [9], WIGGLE["a"]), "b": result([0.6], [9], WIGGLE["b"])}}
    (folds,) = blimp_layer_table(res)
    (tasks,) = blimp_layer_table(res, spread="tasks")
    assert folds["accuracy_mean"] == tasks["accuracy_mean"] == pytest.approx(0.75)
    assert (folds["accuracy_std"], folds["spread"]) == (pytest.approx(0.03), "folds")
    assert (tasks["accuracy_std"], tasks["spread"]) == (pytest.approx(0.15), "tasks")


def test_blimp_layer_table_is_one_row_per_block_over_tasks():
    """Tables 2/11 list layers: per (model, site, layer), mean and std over tasks; blocks numbered from 1."""
    res = {
        ("LIMe", "values"): {"a": result([0.9, 0.8], [9, 10]), "b": result([0.6, 0.7], [9, 10])},
        ("LIMe", "hidden"): {"a": result([0.5, 0.6], [10, 11]), "b": result([0.7, 0.9], [10, 11])},
    }
    rows = blimp_layer_table(res, spread="tasks")
    got = {
        (r["site"], r["block"]): (r["layer"], r["accuracy_mean"], r["accuracy_std"], r["n_tasks"])
        for r in rows
    }
    assert got == {
        ("values", 10): (9, pytest.approx(0.75), pytest.approx(0.15), 2),
        ("values", 11): (10, pytest.approx(0.75), pytest.approx(0.05), 2),
        ("hidden", 10): (10, pytest.approx(0.6), pytest.approx(0.1), 2),
        ("hidden", 11): (11, pytest.approx(0.75), pytest.approx(0.15), 2),
    }
    with pytest.raises(ValueError, match="different layers"):
        blimp_layer_table({("m", "values"): {"a": result([0.5], [1]), "b": result([0.5], [2])}})


def test_grouped_folds_keep_both_sentences_of_a_pair_together(monkeypatch):
    seen = {}
    real = blimp.probe_layers

    def spy(features, labels, splitter, groups=None, **kw):
        seen["folds"] = list(splitter.split(features[0], labels, groups))
        seen["groups"] = groups
        return real(features, labels, splitter, groups=groups, **kw)

    monkeypatch.setattr(blimp, "probe_layers", spy)
    g = np.random.default_rng(0)
    n = 23
    pair_ids = np.array([f"pair{i}" for i in g.permutation(n)])
    blimp_probe({0: g.normal(size=(n, 4))}, {0: g.normal(size=(n, 4))}, pair_ids, progress=False)
    assert seen["groups"].tolist() == pair_ids.tolist() * 2  # rows: the good sentences, then the bad ones
    fold_of = {}
    for k, (_, test) in enumerate(seen["folds"]):
        for row in test:
            fold_of.setdefault(pair_ids[row % n], set()).add(k)
    assert len(fold_of) == n and all(len(f) == 1 for f in fold_of.values())
    counts = [sum(1 for _, t in seen["folds"] for r in t if pair_ids[r % n] == p) for p in pair_ids]
    assert counts == [2] * n  # each pair tested exactly once, both sentences in that fold
