"""BLiMP loading, the grouped good-vs-bad probe, and minimal-pair scoring against a per-sentence loop."""

import json

import numpy as np
import pytest
import torch
from helpers import tiny_model
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lime_probe.probes.blimp import (
    blimp_probe,
    load_blimp,
    prefix_token_id,
    score_minimal_pairs,
    sentence_logprobs,
)

ROWS = [  # (UID, linguistics_term, good, bad)
    ("agr_a", "agreement", "the cat is here .", "the cat are here ."),
    ("agr_a", "agreement", "the cats are here .", "the cats is here ."),
    ("agr_a", "agreement", "a dog was here .", "a dog were here ."),
    ("agr_b", "agreement", "dogs were seen .", "dogs was seen ."),
    ("agr_b", "agreement", "the dog is seen .", "the dog are seen ."),
    ("isl_c", "island", "who is the cat ?", "who the cat is ?"),
    ("isl_c", "island", "what was seen ?", "what seen was ?"),
]


def make_tokenizer(words, bos=True):
    specials = ["<pad>", "[UNK]", "</s>"] + (["<s>"] if bos else [])
    vocab = {w: i for i, w in enumerate(specials + sorted(set(words)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"bos_token": "<s>"} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>", pad_token="<pad>", **extra
    )


def words_of(rows):
    return [w for r in rows for s in r[2:] for w in s.split()]


def loop_logprob(model, tok, sentence, prefix):
    """One sentence at a time, no padding: sum_k log p(token_k | prefix, tokens_<k)."""
    ids = [prefix] + tok.encode(sentence, add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return sum(float(logp[k - 1, ids[k]]) for k in range(1, len(ids)))


def as_columns(rows):
    return {
        "UID": [r[0] for r in rows],
        "linguistics_term": [r[1] for r in rows],
        "sentence_good": [r[2] for r in rows],
        "sentence_bad": [r[3] for r in rows],
        "pairID": [str(i) for i in range(len(rows))],
    }


@pytest.mark.parametrize("bos", [True, False])
def test_sentence_logprobs_match_per_sentence_loop(bos):
    tok = make_tokenizer(words_of(ROWS), bos=bos)
    model = tiny_model("llama", tok)
    prefix = tok.convert_tokens_to_ids("<s>" if bos else "</s>")
    assert prefix_token_id(tok) == prefix
    sentences = [r[2] for r in ROWS] + [r[3] for r in ROWS] + ["cat"]
    got = sentence_logprobs(model, tok, sentences, batch_size=3, progress=False)
    want = [loop_logprob(model, tok, s, prefix) for s in sentences]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_score_minimal_pairs_aggregates():
    tok = make_tokenizer(words_of(ROWS))
    model = tiny_model("llama", tok, seed=1)
    res = score_minimal_pairs(model, tok, as_columns(ROWS), batch_size=4, progress=False)
    prefix = tok.bos_token_id
    correct = [
        loop_logprob(model, tok, g, prefix) > loop_logprob(model, tok, b, prefix) for _, _, g, b in ROWS
    ]
    np.testing.assert_array_equal(res.correct, correct)
    para = {
        u: np.mean([c for (uu, *_), c in zip(ROWS, correct, strict=True) if uu == u])
        for u in ("agr_a", "agr_b", "isl_c")
    }
    assert res.per_paradigm == pytest.approx(para)
    phen = {"agreement": (para["agr_a"] + para["agr_b"]) / 2, "island": para["isl_c"]}
    assert res.per_phenomenon == pytest.approx(phen)
    assert res.mean_over_paradigms == pytest.approx(np.mean(list(para.values())))
    assert res.mean_over_phenomena == pytest.approx(np.mean(list(phen.values())))


def test_scoring_bad_input():
    tok = make_tokenizer(words_of(ROWS))
    model = tiny_model("llama", tok, max_position_embeddings=64)
    with pytest.raises(ValueError, match="missing field"):
        score_minimal_pairs(model, tok, {"sentence_good": ["a"], "sentence_bad": ["b"]})
    with pytest.raises(ValueError, match="has no tokens"):
        sentence_logprobs(model, tok, ["the cat", ""], progress=False)
    with pytest.raises(ValueError, match="over the model's 64 positions"):
        sentence_logprobs(model, tok, ["cat " * 70], progress=False)
    tok2 = make_tokenizer(words_of(ROWS), bos=False)
    tok2.eos_token = None
    with pytest.raises(ValueError, match="neither a BOS nor an EOS"):
        prefix_token_id(tok2)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for i, (uid, term, good, bad) in enumerate(rows):
            f.write(
                json.dumps(
                    {
                        "sentence_good": good,
                        "sentence_bad": bad,
                        "field": "syntax",
                        "linguistics_term": term,
                        "UID": uid,
                        "pairID": str(i),
                    }
                )
                + "\n"
            )


def test_load_blimp_local(tmp_path):
    for uid in ("agr_a", "agr_b", "isl_c"):
        write_jsonl(tmp_path / f"{uid}.jsonl", [r for r in ROWS if r[0] == uid])
    ds = load_blimp(tmp_path)
    assert len(ds) == len(ROWS) and sorted(set(ds["UID"])) == ["agr_a", "agr_b", "isl_c"]
    sub = load_blimp(tmp_path, paradigms=["agr_b"])
    assert list(sub["sentence_good"]) == [r[2] for r in ROWS if r[0] == "agr_b"]
    one = load_blimp(tmp_path / "isl_c.jsonl")
    assert len(one) == 2
    with pytest.raises(ValueError, match=r"paradigm\(s\) \['nope'\] not in"):
        load_blimp(tmp_path, paradigms=["nope"])
    with pytest.raises(FileNotFoundError, match="not found"):
        load_blimp(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text(json.dumps({"good": "a", "bad": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"missing field\(s\) \['sentence_good'"):
        load_blimp(bad)
    broken = tmp_path / "broken"
    broken.mkdir()
    write_jsonl(broken / "agr_a.jsonl", ROWS[:2])
    with open(broken / "agr_a.jsonl", "a") as f:
        f.write('{"sentence_good": "unterminated\n')
    with pytest.raises(ValueError, match="could not read BLiMP JSONL"):
        load_blimp(broken)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no BLiMP .jsonl"):
        load_blimp(tmp_path / "empty")


def test_load_blimp_paradigms_with_different_optional_fields(tmp_path):
    """Regression: two 30-line paradigm files whose optional fields differ (as in the release, where
    only some paradigms carry `one_prefix_*`). `load_dataset("json")` took the schema from the first
    file and failed on the second ("An error occurred while generating the dataset")."""
    base = {
        "field": "syntax",
        "simple_LM_method": True,
        "one_prefix_method": False,
        "two_prefix_method": False,
        "lexically_identical": True,
    }
    island = [
        {
            "sentence_good": f"who did {i} see ?",
            "sentence_bad": f"who {i} did see ?",
            **base,
            "linguistics_term": "island_effects",
            "UID": "adjunct_island",
            "pairID": str(i),
        }
        for i in range(30)
    ]
    anaphor = [
        {
            "sentence_good": f"she {i} helps herself .",
            "sentence_bad": f"she {i} helps himself .",
            **base,
            "one_prefix_prefix": f"she {i} helps",
            "one_prefix_word_good": "herself",
            "one_prefix_word_bad": "himself",
            "linguistics_term": "anaphor_agreement",
            "UID": "anaphor_gender_agreement",
            "pairID": str(i),
        }
        for i in range(30)
    ]
    for name, records in (("adjunct_island", island), ("anaphor_gender_agreement", anaphor)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = load_blimp(tmp_path)
    # adjunct_island sorts first; the rows it lacks fields for read as None
    want = [{**dict.fromkeys(anaphor[0]), **r} for r in island + anaphor]
    assert len(ds) == 60 and set(ds.column_names) == set(anaphor[0])
    assert [ds[i] for i in range(len(ds))] == want
    assert list(load_blimp(tmp_path, paradigms=["adjunct_island"])["pairID"]) == [str(i) for i in range(30)]
    (tmp_path / "adjunct_island.jsonl").write_text(json.dumps({**island[0], "pairID": 0}) + "\n")
    with pytest.raises(ValueError, match="could not read BLiMP JSONL"):  # pairID an int here, a string there
        load_blimp(tmp_path)


def test_blimp_probe_known_answers_and_grouped_folds():
    g = np.random.default_rng(0)
    n, d = 40, 6
    base = g.standard_normal((n, d)) * 3
    base[:, 0] *= 0.1  # little spread along the direction that separates good from bad
    shift = np.zeros(d)
    shift[0] = 4.0
    pair_ids = np.array([f"p{i}" for i in range(n)])
    good = {0: base + 0.1 * g.standard_normal((n, d)), 1: base + shift}  # layer 1: shifted along a direction
    bad = {0: base + 0.1 * g.standard_normal((n, d)), 1: base}
    res = blimp_probe(good, bad, pair_ids, progress=False)
    assert res.majority_baseline == 0.5 and res.n_rows == 2 * n
    assert res.accuracy_mean[1] == pytest.approx(1.0)
    assert res.accuracy_mean[0] < 0.75  # good and bad indistinguishable
    X = np.concatenate([good[0], bad[0]])
    y = np.repeat([1, 0], n)
    pipe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=10_000))
    cv = GroupKFold(5, shuffle=True, random_state=0)
    want = cross_val_score(pipe, X, y, groups=np.concatenate([pair_ids, pair_ids]), cv=cv)
    np.testing.assert_allclose(res.fold_accuracy[0], want)
    with pytest.raises(ValueError, match="too few for 5-fold"):
        blimp_probe({0: base[:3]}, {0: base[:3]}, pair_ids[:3], progress=False)
    with pytest.raises(ValueError, match="layer 0: good"):
        blimp_probe({0: base}, {0: base[:5]}, pair_ids, progress=False)


@pytest.mark.parametrize("method", ["logreg", "adam-linear"])
@pytest.mark.slow
def test_blimp_probe_parallel_folds_are_bit_identical(method):
    g = np.random.default_rng(1)
    n, d = 120, 8
    base = g.standard_normal((n, d))
    good = {la: base + 0.3 * la * np.eye(d)[0] + g.standard_normal((n, d)) for la in range(3)}
    bad = {la: base + g.standard_normal((n, d)) for la in range(3)}
    pair_ids = np.array([f"p{i}" for i in range(n)])
    serial = blimp_probe(good, bad, pair_ids, method=method, seed=4, progress=False)
    parallel = blimp_probe(good, bad, pair_ids, method=method, seed=4, progress=False, n_jobs=2)
    assert len(np.unique(serial.fold_accuracy)) > 3  # varied accuracies: equality means something
    np.testing.assert_array_equal(parallel.fold_accuracy, serial.fold_accuracy)


def test_real_blimp_files(shared_data):
    ds = load_blimp(
        shared_data / "blimp", paradigms=["anaphor_gender_agreement", "adjunct_island", "wh_island"]
    )
    assert len(ds) == 3000
    assert set(ds["UID"]) == {"anaphor_gender_agreement", "adjunct_island", "wh_island"}
    small = ds.filter(lambda pid: int(pid) < 3, input_columns="pairID")
    assert len(small) == 9
    sentences = list(small["sentence_good"]) + list(small["sentence_bad"])
    tok = make_tokenizer([w for s in sentences for w in s.split()])
    model = tiny_model("llama", tok)
    res = score_minimal_pairs(model, tok, small, batch_size=4, progress=False)
    assert set(res.per_paradigm) == set(ds["UID"])
    assert set(res.per_phenomenon) == {"anaphor_agreement", "island_effects"}
    want = [loop_logprob(model, tok, s, tok.bos_token_id) for s in small["sentence_good"]]
    np.testing.assert_allclose(res.logprob_good, want, atol=1e-4)


def test_load_blimp_hub_code_path(monkeypatch):
    """The hub path, with `datasets`' hub calls replaced by local stand-ins (no network here)."""
    import datasets

    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict(
            {k: v for k, v in as_columns([r for r in ROWS if r[0] == config]).items()}
        )

    monkeypatch.setattr(datasets, "get_dataset_config_names", lambda name: ["agr_a", "isl_c"])
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    ds = load_blimp("nyu-mll/blimp")
    assert calls == [("nyu-mll/blimp", "agr_a", "train"), ("nyu-mll/blimp", "isl_c", "train")]
    assert len(ds) == 5
    calls.clear()
    assert len(load_blimp("nyu-mll/blimp", paradigms=["isl_c"])) == 2
    assert calls == [("nyu-mll/blimp", "isl_c", "train")]


@pytest.mark.parametrize("bos", [True, False])
def test_blimp_analysis_scores_and_probes_in_one_pass_with_the_loops_scores(bos):
    import datasets

    from lime_probe.specs import ANALYSES, Checkpoint, Extraction

    rows = [r for r in ROWS for _ in range(3)]  # at least 5 pairs per paradigm for 5-fold CV
    tok = make_tokenizer(words_of(rows), bos=bos)
    model = tiny_model("llama", tok, seed=2)
    prefix = tok.convert_tokens_to_ids("<s>" if bos else "</s>")
    seen = []  # sentences through the model: each once, no second scoring pass
    model.model.embed_tokens.register_forward_hook(lambda mod, args, out: seen.append(len(args[0])))
    result = ANALYSES["blimp"].run(
        [Checkpoint("m", "m", model, tok)],
        datasets.Dataset.from_dict(as_columns(rows)),
        Extraction(batch_size=2),  # several batches
        tasks="all",
        layers="all",
        sites=("hidden",),
    )
    assert sum(seen) == 2 * len(rows)
    correct = [
        loop_logprob(model, tok, g, prefix) > loop_logprob(model, tok, b, prefix) for _, _, g, b in rows
    ]
    want = {
        u: np.mean([c for (uu, *_), c in zip(rows, correct, strict=True) if uu == u])
        for u in ("agr_a", "agr_b", "isl_c")
    }
    got = result.extra["blimp"]["m"]["minimal_pairs"]["per_paradigm"]
    assert got == pytest.approx(want)
    assert {r["paradigm"]: r["minimal_pair_accuracy"] for r in result.summary} == pytest.approx(want)
