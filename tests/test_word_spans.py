"""Multi-token words (numbers such as 100-103) for separability: spans against character offsets, and the
probe on pooled sub-tokens against a hand-built feature matrix + sklearn."""

import re

import numpy as np
import pytest
from helpers import tiny_tokenizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from lime_probe.probes.separability import pool_spans, token_separability, word_pieces, word_spans

NUMBERS = (" 100", " 101", " 102", " 103")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_numbers_are_several_tokens(tok):
    pieces = word_pieces(tok, NUMBERS)
    assert all(len(p) > 1 for p in pieces.values())
    with pytest.raises(ValueError, match="encode to the same tokens"):
        word_pieces(tok, [" 100", " 100"])


def test_spans_match_whole_words_found_in_the_characters(tok):
    texts = [
        "It is 100 and 101, not 1003 or 1002.",
        "The 103 cats were 102 and 100",
        "x100 is 101",  # "x100" has no space before the number: not the word " 100"
    ]
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    token_ids = np.concatenate([np.array(x) for x in enc["input_ids"]])
    offsets = np.cumsum([0] + [len(x) for x in enc["input_ids"]])
    want = []  # from the characters: a space, the number, then no further digit or letter
    for i, (text, marks) in enumerate(zip(texts, enc["offset_mapping"], strict=True)):
        for m in re.finditer(r" (100|101|102|103)(?![0-9A-Za-z])", text):
            first = next(k for k, (a, b) in enumerate(marks) if a <= m.start() < b)
            last = next(k for k, (a, b) in enumerate(marks) if a < m.end() <= b)
            want.append((offsets[i] + first, offsets[i] + last + 1, m.group(0)))
    spans, labels = word_spans(token_ids, offsets, tok, NUMBERS)
    assert [(a, b, w) for (a, b), w in zip(spans.tolist(), labels, strict=True)] == want
    assert sorted(set(labels)) == list(NUMBERS) and len(want) == 6


@pytest.mark.parametrize("subtoken", ["last", "mean"])
def test_separability_of_pooled_sub_tokens_matches_sklearn(tok, subtoken):
    g = np.random.default_rng(0)
    pieces = word_pieces(tok, NUMBERS)
    filler = tok.encode(" is", add_special_tokens=False)
    ids, offsets, where, y = [], [0], [], []
    for _ in range(12):  # sequences: filler, then each number twice in random order, filler between
        seq = list(filler)
        for w in g.permutation(list(NUMBERS) * 2):
            where.append((len(ids) + len(seq), len(ids) + len(seq) + len(pieces[w])))
            y.append(w)
            seq += list(pieces[w]) + filler
        ids += seq
        offsets.append(len(ids))
    X = g.normal(size=(len(ids), 6))
    for (a, b), w in zip(where, y, strict=True):  # a weak class signal on every sub-token
        X[a:b, NUMBERS.index(w)] += 0.8
    spans, labels = word_spans(np.array(ids), np.array(offsets), tok, NUMBERS)
    assert spans.tolist() == [list(s) for s in where] and labels.tolist() == y
    F = pool_spans(X, spans, subtoken)
    hand = np.stack([X[b - 1] if subtoken == "last" else X[a:b].mean(0) for a, b in where])
    np.testing.assert_array_equal(F, hand)
    res = token_separability({0: F}, labels, method="logreg", balance=False, seed=3, progress=False)
    pipe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=10_000))
    want = cross_val_score(pipe, hand, np.array(y), cv=StratifiedKFold(5, shuffle=True, random_state=3))
    np.testing.assert_allclose(res.fold_accuracy[0], want)


def test_pool_spans_rejects_unknown_choice():
    with pytest.raises(ValueError, match="subtoken must be 'last' or 'mean'"):
        pool_spans(np.zeros((3, 2)), np.array([[0, 2]]), "first")
