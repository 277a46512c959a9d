"""Fixed-length token windows against an independent packing loop, and their use for entropy; the check
that the data fits the tokenizer."""

import warnings

import numpy as np
import pytest
import torch
import transformers as tf
from helpers import CORPUS, tiny_config, tiny_model, tiny_tokenizer

from lime_probe.extraction.tracing import extract
from lime_probe.extraction.windows import (
    UNKNOWN_REFUSE,
    UNKNOWN_WARN,
    DataWarning,
    check_unknown_tokens,
    default_window,
    max_positions,
    token_windows,
    unknown_token_share,
)
from lime_probe.probes.entropy import layer_entropy


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def documents(n: int, sentences: int, seed: int) -> list[str]:
    """`n` documents of `sentences` sentences each, drawn from the tiny corpus."""
    g = np.random.default_rng(seed)
    return [" ".join(g.choice(CORPUS, size=sentences)) for _ in range(n)]


def reference_stream(texts, tok) -> list[int]:
    """Packing written out: BOS + tokens + EOS per non-empty document, concatenated."""
    out = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        if ids:
            out += [tok.bos_token_id, *ids, tok.eos_token_id]
    return out


def test_windows_are_consecutive_chunks_of_the_packed_stream(tok):
    texts = documents(30, 3, seed=0) + ["", "   "]  # blank documents are skipped
    stream = reference_stream(texts, tok)
    w = 20
    chunks = [stream[i : i + w] for i in range(0, len(stream) - w + 1, w)]
    everything = token_windows(texts, tok, window=w)
    assert everything == chunks  # all complete windows, in order, remainder dropped
    picked = token_windows(texts, tok, window=w, num_windows=7, seed=3)
    assert len(picked) == 7 and all(len(x) == w for x in picked)
    rest = iter(chunks)  # an ordered subsequence of the chunks: distinct windows, in text order
    assert all(any(x == c for c in rest) for x in picked)


def test_windows_reproducible_by_seed_and_tokenizer_instance(tok, tmp_path):
    texts = documents(40, 2, seed=1)
    a = token_windows(texts, tok, window=16, num_windows=10, seed=5)
    assert a == token_windows(texts, tok, window=16, num_windows=10, seed=5)
    assert a != token_windows(texts, tok, window=16, num_windows=10, seed=6)
    tok.save_pretrained(tmp_path)  # a second checkpoint's copy of the same tokenizer
    other = tf.AutoTokenizer.from_pretrained(tmp_path)
    assert other is not tok
    assert token_windows(texts, other, window=16, num_windows=10, seed=5) == a
    assert token_windows(texts, tiny_tokenizer(), window=16, num_windows=10, seed=5) == a


def test_window_errors(tok):
    texts = documents(3, 1, seed=0)
    n = len(reference_stream(texts, tok))
    with pytest.raises(
        ValueError, match=rf"{n} tokens = 1 complete window\(s\) of {n // 2 + 1}; asked for 2"
    ):
        token_windows(texts, tok, window=n // 2 + 1, num_windows=2)
    with pytest.raises(ValueError, match="window must be an integer >= 2"):
        token_windows(texts, tok, window=1)
    with pytest.raises(ValueError, match="num_windows must be a positive integer"):
        token_windows(texts, tok, window=4, num_windows=0)
    with pytest.raises(ValueError, match="texts must be a list of strings"):
        token_windows("one string", tok, window=4)


def test_default_window_is_official_length_capped_by_positions(tok):
    assert default_window(tiny_config("llama", 300)) == (128, "max_positions")
    assert max_positions(tiny_config("gpt2", 300)) == 128  # n_positions
    assert default_window(tiny_config("llama", 300, max_position_embeddings=4096)) == (2048, "official")
    assert default_window(tiny_model("llama", tok)) == (128, "max_positions")
    assert default_window(tiny_config("llama", 300), preferred=64) == (64, "official")


def test_extract_takes_windows_as_given(tok):
    model = tiny_model("llama", tok)
    windows = token_windows(documents(20, 3, seed=2), tok, window=24, num_windows=5, seed=0)
    acts = extract(
        model, tok, windows, sites="hidden", layers=[0], max_length=24, pretokenized=True, progress=False
    )
    assert acts.offsets.diff().tolist() == [24] * 5
    assert acts.token_ids.tolist() == sum(windows, [])
    # X_0 is the embedding of each given id: no BOS added, nothing dropped
    emb = model.get_input_embeddings()(torch.tensor(sum(windows, [])))
    torch.testing.assert_close(acts["hidden"][0], emb.detach())
    with pytest.raises(ValueError, match="token sequence 0 has 24 tokens, over max_length=16"):
        extract(model, tok, windows, max_length=16, pretokenized=True, progress=False)
    with pytest.raises(ValueError, match="pretokenized=True: texts must be lists of integer token ids"):
        extract(model, tok, ["a text"], pretokenized=True, progress=False)


def overlap(a, b) -> bool:
    return a.ci_low <= b.ci_high and b.ci_low <= a.ci_high


def test_window_entropy_does_not_depend_on_document_length(tok):
    """The length effect of the issue: on one fixed random model, per-document entropy separates short and
    long documents of the same text, windows of one length drawn from either set agree within their CIs."""
    model = tiny_model("llama", tok, seed=0)
    short, long = documents(300, 1, seed=10), documents(40, 8, seed=11)

    def entropy(texts, **kw):
        acts = extract(model, tok, texts, sites="values", layers=[1], progress=False, **kw)
        return layer_entropy(acts.sequences("values", 1), "lime", n_boot=500)

    by_doc = entropy(short), entropy(long)
    assert not overlap(*by_doc)  # the test can see a length effect
    by_window = [
        entropy(
            token_windows(texts, tok, window=48, num_windows=40, seed=0), max_length=48, pretokenized=True
        )
        for texts in (short, long)
    ]
    assert overlap(*by_window), [(r.mean, r.ci_low, r.ci_high) for r in by_window]


def test_packing_whole_documents_does_not_warn_about_the_model_length(caplog):
    """A document longer than the tokenizer's model_max_length is cut into windows afterwards, so
    transformers' "Token indices sequence length is longer ... indexing errors" warning does not apply."""
    short = tiny_tokenizer()
    short.model_max_length = 16
    texts = [" ".join(CORPUS * 4)]  # one document of far more than 16 tokens
    windows = token_windows(texts, short, window=16)
    assert len(windows) > 4
    assert "indexing errors" not in caplog.text
    from lime_model.data import tokenize_and_pack  # the trainer's packing into rows, likewise

    assert tokenize_and_pack(texts, short, seq_len=16).shape[1] == 16
    assert "indexing errors" not in caplog.text
    short("the cat is on the mat " * 20)  # the tokenizer itself still warns where it applies
    assert "indexing errors" in caplog.text


def digits_tokenizer():
    """A tokenizer whose vocabulary lacks every letter: digits and arithmetic only (the demo's kind)."""
    from lime_model.tokenization import char_tokenizer

    return char_tokenizer("0123456789+-*/()= ")


def test_unknown_token_share_counts_the_unknown_token():
    digits = digits_tokenizer()
    seqs = [digits.encode(t, add_special_tokens=False) for t in ("1+2=3", "the cat 12", "999")]
    plain = [c for t in ("1+2=3", "the cat 12", "999") for c in t]  # one token per character
    expected = sum(c not in "0123456789+-*/()= " for c in plain) / len(plain)
    assert unknown_token_share(seqs, digits) == pytest.approx(expected) == pytest.approx(6 / 18)
    gpt2_like = tiny_tokenizer()
    gpt2_like.unk_token = gpt2_like.eos_token  # GPT-2: one token for unk, bos and eos: no unknown token
    assert unknown_token_share([[1, 2, 2]], gpt2_like) is None


def test_text_that_does_not_fit_the_tokenizer_is_refused_before_extraction(monkeypatch):
    digits = digits_tokenizer()
    model = tiny_model("llama", digits)
    english = ["the cat is on the mat 12", "they were 3 and 4"]
    forwards = []
    monkeypatch.setattr("lime_probe.extraction.tracing.trace_batch", lambda *a, **k: forwards.append(1))
    with pytest.raises(ValueError, match=r"does not fit the tokenizer: \d+\.\d% of the \d+ measured tokens"):
        extract(model, digits, english, progress=False)
    assert forwards == []  # refused before any forward pass
    windows = token_windows(english * 5, digits, window=16)
    with pytest.raises(ValueError, match="--allow-unknown-tokens"):
        extract(model, digits, windows, max_length=16, pretokenized=True, progress=False)
    monkeypatch.undo()
    with pytest.warns(DataWarning, match="unknown token '<|unk|>'"):
        acts = extract(model, digits, english, progress=False, allow_unknown_tokens=True)
    assert acts.n_sequences == 2
    # between the two thresholds: measured, with a warning; under the lower one: silent
    seq = [4] * 95 + [digits.unk_token_id] * 5
    with pytest.warns(DataWarning, match="5.0% of the 100 measured tokens"):
        check_unknown_tokens([seq], digits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_unknown_tokens([[4] * 99 + [digits.unk_token_id]], digits)  # 1 %: at the threshold, silent
        check_unknown_tokens([[4] * 10], digits)
    assert UNKNOWN_WARN == 0.01 and UNKNOWN_REFUSE == 0.10
