"""The cka analysis streams its texts in chunks and gives, within and across models, plain and debiased, what
the closed forms give on every token at once."""

import numpy as np
import pytest
from helpers import CORPUS, tiny_model, tiny_tokenizer
from test_similarity import debiased_cka, kernel_cka

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.tracing import extract
from lime_probe.probes.similarity import effective_ranks
from lime_probe.specs import ANALYSES
from lime_probe.specs.base import Checkpoint
from lime_probe.specs.cka import CHUNK_SEQUENCES

TEXTS = [f"{s} {t}" for s in CORPUS for t in CORPUS[:3]]  # 18 texts: three chunks
KW = {"max_length": 24, "max_tokens": 300}  # the budget runs out inside the last chunk


@pytest.fixture(scope="module")
def cks():
    tok = tiny_tokenizer()
    return [Checkpoint(f"m{seed}", f"m{seed}", tiny_model("llama", tok, seed=seed), tok) for seed in (0, 1)]


def all_rows(ck):
    """{layer: (n, d) float64} of every token at once, as one extract call measures them."""
    acts = extract(ck.model, ck.tokenizer, TEXTS, sites="hidden", progress=False, **KW)
    return {la: acts["hidden"][la].double().numpy() for la in acts.layers("hidden")}


@pytest.mark.parametrize("debiased", [False, True])
def test_streamed_cka_within_and_across_models_equals_the_closed_forms(cks, debiased):
    assert len(TEXTS) > 2 * CHUNK_SEQUENCES
    res = ANALYSES["cka"].run(cks, TEXTS, Extraction(**KW), across_models=True, debiased=debiased)
    cka = debiased_cka if debiased else kernel_cka
    A, B = all_rows(cks[0]), all_rows(cks[1])
    assert {r["n_tokens"] for r in res.rows} == {next(iter(A.values())).shape[0]} == {KW["max_tokens"]}
    for label, feats in (("m0", A), ("m1", B)):
        got = res.extra["cka"][label]
        assert got["layers"] == list(feats)
        want = [[cka(X, Y) for Y in feats.values()] for X in feats.values()]
        np.testing.assert_allclose(got["cka"], want, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(
            got["effective_rank"],
            effective_ranks(list(feats.values()), center=True, progress=False),
            rtol=1e-9,
        )
    (across,) = res.extra["cka_across"]
    assert across["models"] == ["m0", "m1"]
    want = np.array([[cka(X, Y) for Y in B.values()] for X in A.values()])
    np.testing.assert_allclose(across["cka"], want, rtol=1e-9, atol=1e-12)
    assert np.abs(want).min() > 0.05 and want.max() < 0.999  # two random models: far from equal
    best = res.tables["cka_across_hidden"]
    assert [r["most_similar_layer"] for r in best] == [list(B)[j] for j in want.argmax(1)]
    assert [r["cka_same_layer"] for r in best] == pytest.approx(np.diag(want).tolist())
    figures = ANALYSES["cka"].plot(res)
    assert set(figures) == {"cka_hidden_m0", "cka_hidden_m1", "cka_hidden_m0_vs_m1", "effective_rank_hidden"}
    # every layer axis says how it counts: hidden's X_0 is the embeddings, as on the other figures
    counted = "layer l (X_0 = embeddings, X_l = output of block l)"
    within, versus = figures["cka_hidden_m0"].axes[0], figures["cka_hidden_m0_vs_m1"].axes[0]
    assert " ".join(within.get_xlabel().split()) == " ".join(within.get_ylabel().split()) == counted
    assert " ".join(versus.get_xlabel().split()) == f"m1 {counted}"
    assert " ".join(versus.get_ylabel().split()) == f"m0 {counted}"
    assert figures["effective_rank_hidden"].axes[0].get_xlabel() == counted


def test_cka_without_across_needs_no_shared_tokenizer(cks):
    other = tiny_tokenizer(vocab_size=280)
    third = Checkpoint("m2", "m2", tiny_model("llama", other, seed=2), other)
    res = ANALYSES["cka"].run([cks[0], third], TEXTS, Extraction(**KW))
    assert "cka_across" not in res.extra and not res.tables
    np.testing.assert_allclose(
        res.extra["cka"]["m2"]["cka"],
        [[kernel_cka(X, Y) for Y in all_rows(third).values()] for X in all_rows(third).values()],
        rtol=1e-9,
    )
    with pytest.raises(ValueError, match="'m0' and 'm2' tokenize the data differently"):
        ANALYSES["cka"].run([cks[0], third], TEXTS, Extraction(**KW), across_models=True)
    with pytest.raises(ValueError, match="--across-models needs two or more checkpoints"):
        ANALYSES["cka"].run(cks[:1], TEXTS, Extraction(**KW), across_models=True)
    with pytest.raises(ValueError, match="no texts given"):
        ANALYSES["cka"].run(cks[:1], iter([]), Extraction(**KW))
