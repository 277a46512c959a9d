"""Text loading, packing and its cache; the BPE tokenizer."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from lime_model import data
from lime_model.digests import tokenizer_hash
from lime_model.tokenization import char_tokenizer, load_tokenizer, train_bpe

TXT = "first doc line 1\nfirst doc line 2\n\n  \nsecond doc\n \n\n\nthird doc\n"


def test_txt_documents_are_blank_line_separated(tmp_path):
    (tmp_path / "a.txt").write_text(TXT)
    assert data.load_texts(str(tmp_path / "a.txt")) == [
        "first doc line 1\nfirst doc line 2",
        "second doc",
        "third doc",
    ]
    assert data.load_texts(str(tmp_path / "a.txt"), max_texts=2) == [
        "first doc line 1\nfirst doc line 2",
        "second doc",
    ]


def test_jsonl_parquet_and_folders(tmp_path):
    (tmp_path / "train-1.jsonl").write_text(
        json.dumps({"text": "j1"}) + "\n\n" + json.dumps({"text": "j2", "x": 1}) + "\n"
    )
    pq.write_table(pa.table({"text": ["p1", "", "p2"], "id": [1, 2, 3]}), tmp_path / "train-2.parquet")
    (tmp_path / "valid.txt").write_text("v1\n\nv2\n")
    (tmp_path / "notes.md").write_text("ignored")
    assert data.load_texts(str(tmp_path / "train-2.parquet")) == ["p1", "p2"]
    assert data.load_texts(str(tmp_path), split="train") == ["j1", "j2", "p1", "p2"]
    assert data.load_texts(str(tmp_path), split="valid") == ["v1", "v2"]
    assert data.load_texts(str(tmp_path)) == ["j1", "j2", "p1", "p2", "v1", "v2"]


def test_bad_data_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="data not found"):
        data.load_texts(str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="no .* files"):
        data.load_texts(str(tmp_path))
    (tmp_path / "empty.txt").write_text("\n  \n\n")
    with pytest.raises(ValueError, match="no text in"):
        data.load_texts(str(tmp_path / "empty.txt"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        data.load_texts(str(tmp_path / "bad.jsonl"))
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported"):
        data.load_texts(str(tmp_path / "t.csv"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nt.parquet")
    with pytest.raises(ValueError, match='no "text" column'):
        data.load_texts(str(tmp_path / "nt.parquet"))


def test_pack_matches_a_plain_loop():
    docs = [[5, 6, 7], [8], [], [9, 10, 11, 12, 13]]
    stream = []
    for d in docs:
        stream += d + [0]
    for seq_len in (2, 3, 4, 7):
        n = len(stream) // seq_len
        expected = [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)]
        got = data.pack(docs, eos_id=0, seq_len=seq_len)
        assert got.dtype == np.int32 and got.tolist() == expected


def test_packed_sequences_decode_to_the_documents_and_are_cached(tmp_path, monkeypatch):
    tok = char_tokenizer("abcdefghij ")
    texts = ["abc def", "ghij", "a b c d e f g h"]
    seqs = data.packed_sequences(texts, tok, seq_len=5, cache_dir=tmp_path)
    stream = [i for t in texts for i in [*tok.encode(t, add_special_tokens=False), tok.eos_token_id]]
    assert seqs.shape == (len(stream) // 5, 5) and seqs.reshape(-1).tolist() == stream[: seqs.size]
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".npy"]

    def boom(*a, **k):
        raise AssertionError("tokenized again despite the cache")

    monkeypatch.setattr(data, "tokenize_and_pack", boom)
    again = data.packed_sequences(texts, tok, seq_len=5, cache_dir=tmp_path)
    assert np.array_equal(again, seqs)
    with pytest.raises(AssertionError, match="tokenized again"):  # another seq_len is another key
        data.packed_sequences(texts, tok, seq_len=6, cache_dir=tmp_path)
    with pytest.raises(AssertionError, match="tokenized again"):  # other texts too
        data.packed_sequences(texts[:2], tok, seq_len=5, cache_dir=tmp_path)


def test_too_little_text_for_one_sequence(tmp_path):
    with pytest.raises(ValueError, match="fewer tokens than one sequence"):
        data.packed_sequences(["ab"], char_tokenizer("ab"), seq_len=16, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_bpe_is_deterministic_lossless_and_loadable(tmp_path):
    texts = [f"The cat number {i} sat on the mat, and the dog {i % 7} barked." for i in range(200)]
    tok = train_bpe(texts, vocab_size=300)
    assert 259 < len(tok) <= 300
    assert tokenizer_hash(train_bpe(texts, vocab_size=300)) == tokenizer_hash(tok)
    sample = "Ünïcode & the mat\n\tbarked!"
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert (
        AutoTokenizer.from_pretrained(tmp_path).encode(sample) == loaded.encode(sample) == tok.encode(sample)
    )
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        train_bpe(texts, vocab_size=100)


def test_wikitext_documents(shared_data):
    texts = data.load_texts(str(shared_data / "wikitext-2" / "valid.txt"), max_texts=50)
    assert len(texts) == 50 and all(t.strip() for t in texts)
    assert texts[0].strip().startswith("=")  # WikiText starts each article with its " = Title = " line
    raw = (shared_data / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")
    assert all(t in raw for t in texts[:10])


def test_hub_specs_stream_the_named_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return iter([{"text": "a"}, {"text": ""}, {"text": "b"}, {"text": "c"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert data.load_texts("hf:org/corpus:sub:validation", max_texts=2) == ["a", "b"]
    assert data.load_texts("hf:wikitext", split="test") == ["a", "b", "c"]
    assert data.load_texts("hf:org/corpus::train") == ["a", "b", "c"]
    assert calls == [
        ("org/corpus", "sub", "validation", True),
        ("wikitext", None, "test", True),
        ("org/corpus", None, "train", True),
    ]
    with pytest.raises(ValueError, match="hf:NAME"):
        data.load_texts("hf:")


def no_reading(*a, **k):
    raise AssertionError("the texts were read despite the cache")


def test_a_cached_local_source_is_not_read_again_until_the_file_changes(tmp_path, monkeypatch):
    tok = char_tokenizer("abcdefghij ")
    path = tmp_path / "t.txt"
    path.write_text("abc def\n\nghij\n\na b c d e f g h\n")
    source = data.TextSource(str(path))
    first = data.packed_sequences(source, tok, seq_len=5, cache_dir=tmp_path / "cache")
    # an independent packing of the same documents from the list
    assert np.array_equal(first, data.tokenize_and_pack(["abc def", "ghij", "a b c d e f g h"], tok, 5))
    with monkeypatch.context() as m:
        m.setattr(data, "_file_documents", no_reading)
        again = data.packed_sequences(source, tok, seq_len=5, cache_dir=tmp_path / "cache")
        assert np.array_equal(again, first) and isinstance(again, np.memmap)
        with pytest.raises(AssertionError, match="were read"):  # another max_texts is another key
            data.packed_sequences(
                data.TextSource(str(path), max_texts=2), tok, seq_len=5, cache_dir=tmp_path / "cache"
            )
        path.write_text("abc\n\nabc def ghij\n")  # rewritten (size changes): the key follows
        with pytest.raises(AssertionError, match="were read"):
            data.packed_sequences(source, tok, seq_len=5, cache_dir=tmp_path / "cache")
    changed = data.packed_sequences(source, tok, seq_len=5, cache_dir=tmp_path / "cache")
    assert np.array_equal(changed, data.tokenize_and_pack(["abc", "abc def ghij"], tok, 5))


def test_a_cached_hub_source_is_not_streamed_again(tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None, streaming=False):
        calls.append(name)
        return iter([{"text": "abc def"}, {"text": "ghij"}, {"text": "a b c d e f g h"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    tok = char_tokenizer("abcdefghij ")
    first = data.packed_sequences(data.TextSource("hf:org/c", "train"), tok, 5, tmp_path)
    assert calls == ["org/c"]
    assert np.array_equal(first, data.tokenize_and_pack(["abc def", "ghij", "a b c d e f g h"], tok, 5))
    monkeypatch.setattr(datasets, "load_dataset", no_reading)
    assert np.array_equal(
        data.packed_sequences(data.TextSource("hf:org/c", "train"), tok, 5, tmp_path), first
    )
    with pytest.raises(AssertionError, match="were read"):  # another split is another key
        data.packed_sequences(data.TextSource("hf:org/c", "test"), tok, 5, tmp_path)


def test_prepare_data_caches_the_trained_bpe_too(tmp_path, monkeypatch):
    from lime_model import train
    from lime_model.recipes import load_recipe

    path = tmp_path / "t.txt"
    path.write_text("\n\n".join(f"document {i} about cats and mats number {i % 7}" for i in range(40)))
    recipe = load_recipe("cpu-tiny", {"data": str(path), "cache_dir": str(tmp_path / "cache"), "seq_len": 16,
                                      "model": {"vocab_size": 300}})  # fmt: skip
    first = train.prepare_data(recipe)
    monkeypatch.setattr(data, "_file_documents", no_reading)
    second = train.prepare_data(recipe)
    assert tokenizer_hash(second.tokenizer) == tokenizer_hash(first.tokenizer)
    assert torch.equal(second.input_ids, first.input_ids)
    # the rows are the packed BPE tokens of the documents, computed here from scratch
    docs = path.read_text().split("\n\n")
    ids = [
        first.tokenizer(d, add_special_tokens=False)["input_ids"] + [first.tokenizer.eos_token_id]
        for d in docs
    ]
    stream = [i for row in ids for i in row]
    n = len(stream) // 16
    assert first.input_ids.tolist() == [stream[k * 16 : (k + 1) * 16] for k in range(n)]
