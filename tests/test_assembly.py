"""`Assembly` places batches that ran in any order, with sequences sorted any way, at the rows a plain
loop over the input gives: each sequence's rows in input order, in the dtype `host_dtype` holds them in."""

import random

import pytest
import torch

from lime_probe.extraction import assembly as assembly_module
from lime_probe.extraction.assembly import Assembly, host_dtype, row_counts


def expected_rows(seqs, features, pool, select):
    """Rows of every sequence in input order, written from the definition: a row per token (per kept
    token with `select`), or one per sequence when pooled."""
    rows, ids = [], []
    for i, seq in enumerate(seqs):
        if pool == "mean":
            rows.append(features[i].mean(0, keepdim=True))
            ids.append(-1)
            continue
        rows.append(features[i][:0])  # a sequence without a kept token adds no row
        for t, token in enumerate(seq):
            if select is None or token in select:
                rows.append(features[i][t : t + 1])
                ids.append(token)
    return torch.cat(rows), torch.tensor(ids, dtype=torch.long)


def batch_rows(seqs, features, local, pool, select):
    """What a traced batch of sequences `local` (in that order) gives: their rows one after another."""
    return expected_rows([seqs[i] for i in local], [features[i] for i in local], pool, select)[0]


@pytest.mark.parametrize("min_rows", [0, 10**9])  # every batch in slices / every batch by index
@pytest.mark.parametrize(("pool", "select"), [("none", None), ("none", {3, 5, 7}), ("mean", None)])
def test_batches_in_any_order_land_where_a_loop_over_the_input_puts_them(monkeypatch, min_rows, pool, select):
    monkeypatch.setattr(assembly_module, "MIN_ROWS_PER_RUN", min_rows)
    rng = random.Random(0)
    first = 5  # the block starts at input sequence 5
    seqs = [[rng.randrange(10) for _ in range(rng.randrange(1, 9))] for _ in range(13)]
    features = [torch.randn(len(s), 4).to(torch.bfloat16) for s in seqs]
    order = list(range(len(seqs)))
    rng.shuffle(order)
    order[2:6] = sorted(order[2:6])  # a run of consecutive sequences inside a batch
    batches = [order[:6], order[6:7], order[7:]]
    rng.shuffle(batches)
    ids = None if select is None else torch.tensor(sorted(select))
    result = Assembly(seqs, first, pool, ids)
    for local in batches:
        rows = {"values/0": batch_rows(seqs, features, local, pool, select)}
        rows["logprobs"] = torch.tensor([float(i) for i in local], dtype=torch.float64)
        result.place([first + i for i in local], rows)
    want, want_ids = expected_rows(seqs, features, pool, select)
    done = result.result()
    assert done["values/0"].dtype == torch.bfloat16 and torch.equal(
        done["values/0"], want
    )  # held as they came
    assert torch.equal(done["token_ids"], want_ids)
    assert torch.equal(done["logprobs"], torch.arange(len(seqs), dtype=torch.float64))
    counts = [1 if pool == "mean" else sum(select is None or t in select for t in s) for s in seqs]
    assert done["offsets"].tolist() == [sum(counts[:i]) for i in range(len(seqs) + 1)]
    assert int(done["n_tokens"]) == sum(map(len, seqs))


def test_rows_are_held_in_their_dtype_but_for_the_unusual():
    assert [host_dtype(d) for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)] == [
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]
    assert host_dtype(torch.float8_e4m3fn) == torch.float32


def test_row_counts_follow_the_token_selection():
    seqs = [[1, 2, 3], [4], [2, 2, 9, 1]]
    assert row_counts(seqs, "none", None).tolist() == [3, 1, 4]
    assert row_counts(seqs, "none", torch.tensor([2, 4])).tolist() == [1, 1, 2]
    assert row_counts(seqs, "none", torch.tensor([7])).tolist() == [0, 0, 0]
    assert row_counts(seqs, "mean", None).tolist() == [1, 1, 1]


def test_a_batch_whose_rows_disagree_with_its_tokens_is_refused():
    result = Assembly([[1, 2], [3]], 0, "none", None)
    with pytest.raises(RuntimeError, match="3 expected rows gave 2"):
        result.place([0, 1], {"hidden/0": torch.zeros(2, 4)})
    with pytest.raises(IndexError, match="not all in 0..1"):
        result.place([1, 2], {"hidden/0": torch.zeros(2, 4)})
