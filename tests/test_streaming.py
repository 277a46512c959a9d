"""Streaming input to `extract` (generators, files, datasets): read block by block, the list's exact results."""

import itertools
import json

import pytest
import torch
from helpers import save_tiny_checkpoint, tiny_model, tiny_tokenizer

import lime_probe.extraction.tracing as tracing
from lime_probe import cli
from lime_probe.extraction.planning import plan_sites
from lime_probe.extraction.tracing import Corpus, extract

TEXTS = [f"document {i} says " + "the cat sat on the mat " * (i % 5 + 1) for i in range(40)]
SITES = ["hidden", "values"]
KW = {"sites": SITES, "batch_tokens": 48, "progress": False}  # several blocks (`small_blocks`)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model("llama", tok)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several blocks and tokenizer chunks over TEXTS, so a stream crosses their boundaries."""
    monkeypatch.setattr(tracing, "SHARD_BYTES", 4000)
    monkeypatch.setattr(tracing, "TOKENIZE_CHUNK", 7)


def assert_identical(a, b):
    assert torch.equal(a.offsets, b.offsets) and torch.equal(a.token_ids, b.token_ids)
    assert a.sites == b.sites
    for site in a:
        for layer in a[site]:
            assert torch.equal(a[site][layer], b[site][layer]), (site, layer)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        assert torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_tokens": 48},
        {"pool": "mean", "batch_tokens": 48},
        {"token_ids": [5, 6, 7, 8, 9, 10], "logprobs": True, "batch_tokens": 48},
        {"max_tokens": 200, "batch_size": 3},
    ],
)
def test_a_generator_gives_exactly_the_lists_activations(model, tok, kw):
    listed = extract(model, tok, TEXTS, sites=SITES, progress=False, **kw)
    streamed = extract(model, tok, (t for t in TEXTS), sites=SITES, progress=False, **kw)
    assert_identical(streamed, listed)


def test_the_stream_is_read_block_by_block(model, tok, monkeypatch):
    read, first_forward = [], []
    forward = tracing.trace_batch

    def counting(*a, **k):
        first_forward.append(len(read))
        return forward(*a, **k)

    def texts():
        for t in TEXTS:
            read.append(t)
            yield t

    monkeypatch.setattr(tracing, "trace_batch", counting)
    acts = extract(model, tok, texts(), sites="hidden", batch_tokens=48, progress=False)
    assert acts.n_sequences == len(TEXTS) == len(read)
    # the first batch ran with one block and one tokenizer chunk read, long before the stream's end
    assert first_forward[0] < len(TEXTS) // 2


def test_pooled_blocks_hold_tokens_independent_of_the_corpus_size_at_default_settings(model, monkeypatch):
    """Pooled rows (one per document) of a small model never fill a block's `SHARD_BYTES`: the block is
    bounded in tokens too, so the tokens held at once do not grow with the number of documents."""
    monkeypatch.setattr(tracing, "SHARD_BYTES", 32 * 2**20)  # the default, not `small_blocks`'
    row_bytes = plan_sites(model, ["hidden"], None, width=0).row_bytes  # every layer, one row per document

    def largest_block(n_docs: int) -> int:
        docs = ([7] * 32 for _ in range(n_docs))  # 32 tokens each
        blocks = tracing._blocks(docs, row_bytes, False, None, tracing.DEFAULT_BATCH_TOKENS)
        return max(sum(map(len, block)) for block in blocks)

    assert largest_block(20_000) == largest_block(200_000) <= tracing.BLOCK_TOKENS + 32


def test_a_block_of_batch_size_batches_ends_with_a_whole_batch(monkeypatch):
    """With ``batch_size``, a block holds a whole number of batches: one that filled `SHARD_BYTES` at 15
    sequences in batches of 8 ran a batch of 7 beside each full one (32 sequences: 5 forward passes)."""
    monkeypatch.setattr(tracing, "SHARD_BYTES", 15 * 10)  # full at the 15th sequence of 10-byte rows
    docs = [[7] * 10 for _ in range(32)]
    blocks = list(tracing._blocks(docs, 1, True, 8, tracing.DEFAULT_BATCH_TOKENS))
    assert [len(b) for b in blocks] == [16, 16]


def test_an_endless_stream_stops_at_the_token_budget(model, tok):
    streamed = extract(model, tok, itertools.cycle(TEXTS), sites=SITES, max_tokens=300, progress=False)
    assert len(streamed.token_ids) == 300
    assert_identical(streamed, extract(model, tok, TEXTS, sites=SITES, max_tokens=300, progress=False))


def test_files_and_datasets_stream_their_texts(model, tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "t.txt").write_text("\n\n".join(TEXTS) + "\n")
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS))
    )
    listed = extract(model, tok, TEXTS[:30], sites=SITES, progress=False)
    for name in ("t.txt", "t.jsonl"):
        corpus = Corpus(tmp_path / name, max_texts=30)
        assert list(corpus) == TEXTS[:30] == list(corpus)  # read afresh each time
        assert_identical(extract(model, tok, corpus, sites=SITES, progress=False), listed)
    rows = datasets.Dataset.from_dict({"id": list(range(30)), "text": TEXTS[:30]}).to_iterable_dataset()
    assert_identical(extract(model, tok, rows, sites=SITES, progress=False), listed)


def test_a_stream_shares_the_lists_cache(model, tok, tmp_path):
    (tmp_path / "t.txt").write_text("\n\n".join(TEXTS) + "\n")
    cache = tmp_path / "cache"
    streamed = extract(model, tok, Corpus(tmp_path / "t.txt"), cache_dir=cache, **KW)
    assert len(streamed.shards) > 1  # written shard by shard
    listed = extract(model, tok, TEXTS, cache_dir=cache, **KW)
    assert listed.shards == streamed.shards  # the list found the stream's entry complete
    assert_identical(listed, extract(model, tok, TEXTS, **KW))

    def whole_layer(name):
        raise AssertionError(f"iter_sequences read all of {name} at once")

    listed._cat = whole_layer  # reading back shard by shard never concatenates a layer
    chunks = list(listed.iter_sequences("values", 1, chunk=16))
    assert torch.equal(torch.cat([x for c in chunks for x in c]), streamed["values"][1])
    with pytest.raises(ValueError, match="not a one-pass iterator"):
        extract(model, tok, iter(TEXTS), cache_dir=cache, **KW)


@pytest.mark.parametrize(
    ("texts", "kw", "message"),
    [
        (iter([]), {}, "texts is empty"),
        (iter(["fine", 3]), {}, "item 1 is a int"),
        (iter([{"body": "x"}]), {}, "row 0 of the data has no 'text' field"),
        (iter(["fine", ""]), {}, "text 1 tokenizes to no tokens"),
        (iter([[5, 6], "x"]), {"pretokenized": True}, "item 1 is not"),
        (iter([[5] * 9]), {"pretokenized": True, "max_length": 8}, "token sequence 0 has 9 tokens"),
        ({"text": "a mapping"}, {}, "texts must be a list of strings"),
    ],
)
def test_bad_streams_are_clear_errors(model, tok, texts, kw, message):
    with pytest.raises(ValueError, match=message):
        extract(model, tok, texts, sites="hidden", progress=False, **kw)


def test_per_document_entropy_reads_data_lazily_and_windows_whole(tmp_path, capsys, monkeypatch):
    import lime_model.data
    from lime_probe.specs import ANALYSES
    from lime_probe.specs.base import load_checkpoints
    from lime_probe.specs.data import load_data
    from lime_probe.specs.entropy import EntropyParams

    data = tmp_path / "t.txt"
    data.write_text("\n\n".join(TEXTS) + "\n")
    spec = ANALYSES["entropy"]

    def load(params):  # as the command reads --data: lazily where the analysis streams it
        return load_data(spec.data_kind, str(data), 30, params=params, lazy=spec.streams(params))

    assert isinstance(load(EntropyParams(unit="documents")), Corpus)
    assert load(EntropyParams(unit="windows")) == TEXTS[:30]  # drawn from all

    first_document = lime_model.data.load_texts

    def whole(*a, max_texts=None, **k):  # the checks before work read the first document only
        if max_texts != 1:
            raise AssertionError("per-document entropy must not read --data whole")
        return first_document(*a, max_texts=max_texts, **k)

    ckpt = save_tiny_checkpoint(tmp_path / "llama", "llama")
    monkeypatch.setattr(lime_model.data, "load_texts", whole)
    argv = ["entropy", "--ckpt", ckpt, "--data", data, "--unit", "documents", "--site", "values"]
    code = cli.main([str(a) for a in [*argv, "--max-sequences", 30, "--out", tmp_path / "out"]])
    assert code == 0, capsys.readouterr().err
    monkeypatch.undo()
    rows = json.loads((tmp_path / "out" / "entropy_values.json").read_text())["rows"]
    cks = load_checkpoints([str(ckpt)], ["llama"])
    want = ANALYSES["entropy"].run(cks, TEXTS[:30], None, unit="documents", site="values").rows
    assert [r["n_sequences"] for r in rows] == [30] * len(want)
    assert [r["entropy_mean"] for r in rows] == pytest.approx([r["entropy_mean"] for r in want], rel=1e-12)


def test_cka_reads_data_lazily(tmp_path, capsys, monkeypatch):
    import lime_model.data
    from lime_probe.specs import ANALYSES
    from lime_probe.specs.base import load_checkpoints

    data = tmp_path / "t.txt"
    data.write_text("\n\n".join(TEXTS) + "\n")

    first_document = lime_model.data.load_texts

    def whole(*a, max_texts=None, **k):  # the checks before work read the first document only
        if max_texts != 1:
            raise AssertionError("cka must not read --data whole")
        return first_document(*a, max_texts=max_texts, **k)

    ckpt = save_tiny_checkpoint(tmp_path / "llama", "llama")
    monkeypatch.setattr(lime_model.data, "load_texts", whole)
    argv = ["cka", "--ckpt", ckpt, "--data", data, "--max-sequences", 30, "--out", tmp_path / "out"]
    assert cli.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    monkeypatch.undo()
    rows = json.loads((tmp_path / "out" / "cka_hidden.json").read_text())["rows"]
    want = ANALYSES["cka"].run(load_checkpoints([str(ckpt)], ["llama"]), TEXTS[:30]).rows
    assert [r["n_tokens"] for r in rows] == [r["n_tokens"] for r in want]
    assert [r["effective_rank"] for r in rows] == pytest.approx(
        [r["effective_rank"] for r in want], rel=1e-12
    )


@pytest.mark.slow
def test_the_memory_bench_runs_at_a_toy_size():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bench = [
        sys.executable,
        str(root / "bench" / "extract_streaming.py"),
        "--docs",
        "20",
        "--shard-mib",
        "0.01",
    ]
    out = subprocess.run(bench, capture_output=True, text=True, cwd=root, check=True).stdout
    assert re.findall(r"^(\w+)$", out, re.M) == ["mean", "cache"]
    assert len(re.findall(r"^ +200 documents", out, re.M)) == 2  # 10N read through, in both modes
    assert all(0.5 < float(r) < 2 for r in re.findall(r"10N / N: ([\d.]+)", out))
