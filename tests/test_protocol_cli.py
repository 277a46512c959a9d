"""The measurement protocol from the command line: each option against a computation written here."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import CORPUS, save_tiny_checkpoint

from lime_probe import cli
from lime_probe.extraction.settings import Extraction

DOCS = CORPUS * 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {arch: save_tiny_checkpoint(root / arch, arch) for arch in ("llama", "lime")}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n\n".join(DOCS) + "\n")
    return path


def run_ok(capsys, *argv) -> str:
    code = cli.main([str(a) for a in argv] + ["--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out + err


def read_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def numpy_lime_entropy(seqs: list[np.ndarray], alpha: float = 0.5, eps: float = 1e-5) -> np.ndarray:
    """The official code's entropy per sequence, from the formula: z-score over all tokens of the layer,
    eigenvalues of each sequence's t x t Gram, p = lambda / trace, Renyi order alpha."""
    rows = np.concatenate(seqs).astype(np.float64)
    mu, sd = rows.mean(0), rows.std(0, ddof=1)
    out = []
    for z in seqs:
        z = (z.astype(np.float64) - mu) / (sd + eps)
        K = z @ z.T
        lam = np.linalg.eigvalsh(K)
        lam[lam < lam.max() * K.shape[0] * np.finfo(np.float64).eps] = 0.0
        p = lam / np.trace(K)
        out.append(np.log((p**alpha).sum()) / (1 - alpha))
    return np.array(out)


def manual_windows(tok, texts, window: int, count: int, seed: int) -> list[list[int]]:
    """[BOS] + tokens + [EOS] per document, concatenated, cut into windows, `count` drawn with `seed`."""
    stream = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        if ids:
            stream += [tok.bos_token_id, *ids, tok.eos_token_id]
    starts = [k * window for k in range(len(stream) // window)]
    picked = sorted(np.random.default_rng(seed).choice(starts, size=count, replace=False).tolist())
    return [stream[s : s + window] for s in picked]


@pytest.mark.slow  # ~11 s under load
def test_entropy_windows_equal_hand_built_windows(capsys, tmp_path, ckpts, text_file):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract

    out = tmp_path / "o"
    common = ["--data", text_file, "--site", "values", "--no-cache", "--seed", 2]
    run_ok(
        capsys, "entropy", "--ckpt", ckpts["llama"], "--ckpt", ckpts["lime"], *common,
        "--window", 16, "--num-windows", 6, "--out", out,
    )  # fmt: skip
    rows = read_rows(out / "entropy_values.json")
    for label in ("llama", "lime"):
        model, tok = load(ckpts[label])
        windows = manual_windows(tok, DOCS, 16, 6, seed=2)
        acts = extract(
            model, tok, windows, sites=["values"], max_length=16, pretokenized=True, progress=False
        )
        mine = [r for r in rows if r["model"] == label]
        assert [r["layer"] for r in mine] == acts.layers("values")
        for r in mine:
            seqs = [s.numpy() for s in acts.sequences("values", r["layer"])]
            assert [len(s) for s in seqs] == [16] * 6
            want = numpy_lime_entropy(seqs)
            np.testing.assert_allclose(r["entropy_mean"], want.mean(), rtol=1e-6)
            np.testing.assert_allclose(
                r["entropy_std"], want.std(), rtol=1e-5
            )  # ddof=0, as lime_probe.probes.stats
            assert (r["unit"], r["window"], r["window_source"], r["num_windows"]) == (
                "windows",
                16,
                "given",
                6,
            )
            assert r["n_sequences"] == 6
    # two checkpoints with one tokenizer saw the same windows
    assert len({r["windows_digest"] for r in rows}) == 1


@pytest.mark.slow  # ~40 s under load: 2048-token windows
def test_entropy_default_window_is_capped_by_max_positions(capsys, tmp_path, ckpts, text_file):
    out = tmp_path / "o"
    run_ok(
        capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--no-cache",
        "--num-windows", 2, "--out", out,
    )  # fmt: skip
    rows = read_rows(out / "entropy_values.json")
    assert {(r["window"], r["window_source"], r["num_windows"]) for r in rows} == {(128, "max_positions", 2)}
    from lime_probe.specs import ANALYSES, load_checkpoints

    result = ANALYSES["entropy"].run(
        load_checkpoints([str(ckpts["llama"])], None, "cpu"), DOCS, Extraction(), num_windows=2
    )
    assert "llama: 128 tokens (max_positions)" in result.text


@pytest.mark.slow  # ~23 s under load
def test_entropy_documents_mode_and_max_normalize(capsys, tmp_path, ckpts, text_file):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract

    out = tmp_path / "o"
    run_ok(
        capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--no-cache", "--unit", "documents",
        "--max-length", 12, "--preset", "layer-by-layer", "--max-normalize", "--out", out,
    )  # fmt: skip
    rows = read_rows(out / "entropy_values.json")
    model, tok = load(ckpts["llama"])
    acts = extract(model, tok, DOCS, sites=["values"], max_length=12, progress=False)
    for r in rows:
        want = []
        for z in acts.sequences("values", r["layer"]):  # Skean et al.: centre, L2 rows, clamp Gram, / log min
            c = z.numpy().astype(np.float64)
            c = c - c.mean(0)
            c /= np.linalg.norm(c, axis=1, keepdims=True)
            K = c @ c.T if c.shape[0] <= c.shape[1] else c.T @ c
            lam = np.linalg.eigvalsh(np.clip(K, 0, None))
            p = lam[lam > 0] / lam[lam > 0].sum()
            want.append(-(p * np.log(p)).sum() / np.log(min(c.shape)))
        np.testing.assert_allclose(r["entropy_mean"], np.mean(want), rtol=1e-6)
        assert r["unit"] == "documents" and r["window"] is None and r["max_normalize"] is True
        assert r["n_sequences"] == len(DOCS)


@pytest.mark.slow
def test_value_probes_report_values_and_routed_values_by_default(capsys, tmp_path, ckpts, text_file):
    """Default site: the W_V output for both models and, for LIMe (it routes), the routed values too, each
    measured as written here; LLaMA has no routed values and the text says so; the legend names both."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.separability import token_separability
    from lime_probe.specs import ANALYSES, load_checkpoints

    out = tmp_path / "o"
    run_ok(
        capsys, "entropy", "--ckpt", ckpts["lime"], "--ckpt", ckpts["llama"], "--data", text_file,
        "--unit", "documents", "--max-length", 16, "--no-cache", "--out", out,
    )  # fmt: skip
    rows = read_rows(out / "entropy_values.json")
    assert {(r["model"], r["site"]) for r in rows} == {
        ("lime", "values"), ("lime", "routed_values"), ("llama", "values")
    }  # fmt: skip
    model, tok = load(ckpts["lime"])
    acts = extract(model, tok, DOCS, sites=["values", "routed_values"], max_length=16, progress=False)
    for r in (r for r in rows if r["model"] == "lime"):
        seqs = [x.numpy() for x in acts.sequences(r["site"], r["layer"])]
        np.testing.assert_allclose(r["entropy_mean"], numpy_lime_entropy(seqs).mean(), rtol=1e-6)
    routed = {r["layer"]: r["entropy_mean"] for r in rows if r["site"] == "routed_values"}
    raw = {r["layer"]: r["entropy_mean"] for r in rows if (r["model"], r["site"]) == ("lime", "values")}
    assert routed[1] != raw[1]  # layer 1 reads layer 0's values too: a different representation

    cks = load_checkpoints([str(ckpts["lime"]), str(ckpts["llama"])], ["LIMe", "LLaMA"], "cpu")
    kw = Extraction(max_length=32)
    sep = ANALYSES["separability"].run(cks, DOCS, kw, seed=1, allow_small_samples=True)
    for label, ck in (("LIMe", ckpts["lime"]), ("LLaMA", ckpts["llama"])):
        model, tok = load(ck)
        sites = ["values", "routed_values"] if label == "LIMe" else ["values"]
        assert [r["site"] for r in sep.rows if r["model"] == label] == [s for s in sites for _ in range(2)]
        for site in sites:
            ids = {w: tok.encode(w, add_special_tokens=False)[0] for w in (" is", " are", " was", " were")}
            a = extract(
                model, tok, DOCS, sites=[site], token_ids=list(ids.values()), max_length=32, progress=False
            )
            y = np.array([{i: w for w, i in ids.items()}[int(t)] for t in a.token_ids], dtype=object)
            want = token_separability(dict(a[site].items()), y, seed=1, classes=list(ids), progress=False)
            got = [r["accuracy_mean"] for r in sep.rows if (r["model"], r["site"]) == (label, site)]
            np.testing.assert_array_equal(got, want.accuracy_mean)
    assert "routed values (what LIMe's heads attend to)" in sep.text and "No routing in LLaMA" in sep.text
    fig = next(iter(ANALYSES["separability"].plot(sep).values()))
    legend = [t.get_text() for t in fig.legends[0].texts]
    assert legend[:3] == [
        "LIMe: values (W_V output)", "LLaMA: values (W_V output)", "LIMe: routed values (what LIMe's heads attend to)"
    ]  # fmt: skip
    assert "one-epoch linear probe" in fig.axes[0].get_title()
    from lime_probe.output.console import format_table

    assert "one-epoch linear probe (official code's)" in format_table(sep.table())  # what the command prints
    tsne = ANALYSES["tsne"].run(cks, DOCS, kw, per_word=6, perplexity=3)
    assert [(r["model"], r["site"]) for r in tsne.summary] == [
        ("LIMe", "values"), ("LIMe", "routed_values"), ("LLaMA", "values")
    ]  # fmt: skip
    from helpers import write_blimp_dir

    from lime_probe.probes.blimp import load_blimp

    pairs = load_blimp(write_blimp_dir(tmp_path / "blimp"))
    bl = ANALYSES["blimp"].run(cks, pairs, kw, tasks="all", layers="all")
    assert list(dict.fromkeys((r["model"], r["site"]) for r in bl.summary)) == [
        ("LIMe", "values"), ("LIMe", "routed_values"), ("LIMe", "hidden"), ("LLaMA", "values"), ("LLaMA", "hidden")
    ]  # fmt: skip
    assert "No routing in LLaMA" in bl.text
    bars = ANALYSES["blimp"].plot(bl)["blimp_table2"].axes[0].get_legend_handles_labels()[1]
    assert "routed values (what LIMe's heads attend to)" in bars
    # an explicit site is that site alone
    only = ANALYSES["entropy"].run(cks[:1], DOCS, replace(kw, max_length=16), site="values", unit="documents")
    assert {r["site"] for r in only.rows} == {"values"} and "No routing" not in only.text


MULTI = (" garden", " happy", " clean", " rivers")  # 4-6 tokens each under the tiny tokenizer, 8 times each


def hand_pooled(model, tok, site: str, how: str) -> tuple[dict, np.ndarray]:
    """Every occurrence of MULTI found by scanning the token ids, pooled by hand ({layer: (n, d)}, labels)."""
    from lime_probe.extraction.tracing import extract

    acts = extract(model, tok, DOCS, sites=[site], max_length=32, progress=False)
    ids = acts.token_ids.tolist()
    pieces = {w: tok.encode(w, add_special_tokens=False) for w in MULTI}
    spans, labels = [], []
    bounds = acts.offsets.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        for i in range(lo, hi):
            for w, p in pieces.items():
                after = ids[i + len(p)] if i + len(p) < hi else None
                if ids[i : i + len(p)] == p and (after is None or not tok.decode([after])[0].isalnum()):
                    spans.append((i, i + len(p)))
                    labels.append(w)
    feats = {}
    for layer in acts[site]:
        X = acts[site][layer].numpy()
        feats[layer] = np.stack([X[a:b].mean(0) if how == "mean" else X[b - 1] for a, b in spans])
    return feats, np.array(labels, dtype=object)


@pytest.mark.parametrize("how", ["mean", "last"])
@pytest.mark.slow
def test_separability_of_multi_token_words_against_sklearn(capsys, tmp_path, ckpts, text_file, how):
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from lime_probe.extraction.loading import load

    out = tmp_path / "o"
    run_ok(
        capsys, "separability", "--ckpt", ckpts["lime"], "--data", text_file, "--words", *MULTI,
        "--subtoken", how, "--max-length", 32, "--no-cache", "--seed", 1, "--method", "logreg", "--out", out,
        "--allow-small-samples",
    )  # fmt: skip
    rows = [r for r in read_rows(out / "separability_values.json") if r["site"] == "values"]
    feats, y = hand_pooled(*load(ckpts["lime"]), "values", how)
    assert sorted(np.unique(y, return_counts=True)[1]) == [8, 8, 8, 8]  # balanced: no subsampling
    for r in rows:
        probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=10_000))
        cv = StratifiedKFold(5, shuffle=True, random_state=1)
        want = cross_val_score(probe, feats[r["layer"]], y, cv=cv)
        np.testing.assert_allclose([r["accuracy_mean"], r["accuracy_std"]], [want.mean(), want.std()])
        assert r["subtoken"] == how and r["n_rows"] == 32


@pytest.mark.parametrize("raw", [True, False])
@pytest.mark.slow
def test_tsne_l2_normalize_option_against_opentsne(capsys, tmp_path, ckpts, text_file, raw):
    from openTSNE import TSNE

    from lime_probe.extraction.loading import load

    out = tmp_path / "o"
    run_ok(
        capsys, "tsne", "--ckpt", ckpts["llama"], "--data", text_file, "--words", *MULTI, "--per-word", 8,
        "--perplexity", 4, "--layers", 1, "--max-length", 32, "--no-cache", "--out", out,
        *(["--no-l2-normalize"] if raw else []),
    )  # fmt: skip
    rows = read_rows(out / "tsne_values.json")
    feats, y = hand_pooled(*load(ckpts["llama"]), "values", "last")
    X = feats[1].astype(np.float64)
    if not raw:
        X = X / np.linalg.norm(X, axis=1, keepdims=True)
    want = np.asarray(TSNE(n_components=2, perplexity=4, random_state=0, n_jobs=1).fit(X))
    np.testing.assert_allclose([[r["x"], r["y"]] for r in rows], want, rtol=1e-6, atol=1e-8)
    assert [r["token"] for r in rows] == list(y) and {r["l2_normalize"] for r in rows} == {not raw}


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory) -> Path:
    """16 blocks as the paper's Table 2 models, 12 positions: the two 13-token pairs of PAIRS do not fit."""
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("deep"), "llama", num_hidden_layers=16, max_position_embeddings=12
    )


@pytest.mark.slow
def test_blimp_table2_protocol_by_hand(capsys, tmp_path, deep_ckpt):
    from helpers import write_blimp_dir
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.blimp import load_blimp

    data_dir = write_blimp_dir(tmp_path / "blimp")
    out = tmp_path / "o"
    run_ok(
        capsys, "blimp", "--ckpt", deep_ckpt, "--data", data_dir, "--tasks", "all", "--no-cache", "--seed", 1,
        "--spread", "tasks", "--out", out,
    )  # fmt: skip
    doc = json.loads((out / "blimp.json").read_text())
    rows = doc["rows"]
    # the paper's range: blocks 10-16 of 16 (values of block b: index b-1; hidden: output of block b)
    assert sorted({r["layer"] for r in rows if r["site"] == "values"}) == list(range(9, 16))
    assert sorted({r["layer"] for r in rows if r["site"] == "hidden"}) == list(range(10, 17))
    model, tok = load(deep_ckpt)
    data = load_blimp(data_dir)
    fits = [
        all(
            max(len(tok(s)["input_ids"]), len(tok(s, add_special_tokens=False)["input_ids"]) + 1) <= 12
            for s in pair
        )
        for pair in zip(data["sentence_good"], data["sentence_bad"], strict=True)
    ]
    uids = np.array(data["UID"])
    assert (
        doc["blimp"][deep_ckpt.name]["skipped_pairs"]
        == {q: int((~np.array(fits))[uids == q].sum()) for q in ("agreement_a", "agreement_b")}
        == {"agreement_a": 4, "agreement_b": 4}
    )
    # one task, one layer: hand-extracted mean-pooled values, standardised logreg, 5 folds grouped by pair
    part = data.select([i for i in range(len(data)) if fits[i] and uids[i] == "agreement_a"])
    # each sentence as the minimal-pair score reads it (ours): BOS (else EOS), then its tokens
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    good, bad = (
        extract(
            model,
            tok,
            [[prefix, *tok(s, add_special_tokens=False)["input_ids"]] for s in part[column]],
            sites=["values"],
            pool="mean",
            pretokenized=True,
            progress=False,
        )
        for column in ("sentence_good", "sentence_bad")
    )
    X = np.concatenate([good["values"][12].numpy(), bad["values"][12].numpy()])
    y = np.repeat([1, 0], len(part))
    groups = np.tile(np.array(part["pairID"]), 2)
    acc = []
    for train, test in GroupKFold(5, shuffle=True, random_state=1).split(X, y, groups):
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=10_000)).fit(X[train], y[train])
        acc.append((clf.predict(X[test]) == y[test]).mean())
    row = next(r for r in rows if (r["paradigm"], r["site"], r["layer"]) == ("agreement_a", "values", 12))
    np.testing.assert_allclose(row["probe_accuracy_mean"], np.mean(acc))
    assert row["n_pairs"] == 8 and row["n_skipped"] == 4
    # Table 2: a task's accuracy is its mean over the probed layers; mean and (--spread tasks) std (ddof=0) over
    # tasks; the default spread, over folds, is checked in test_blimp_protocol.py
    table = json.loads((out / "blimp_table2.json").read_text())["rows"]
    assert {t["spread"] for t in table} == {"tasks"}
    assert (out / "blimp_table2.csv").exists() and (out / "blimp_table2.png").exists()
    for t in table:
        tasks = [
            np.mean([r["probe_accuracy_mean"] for r in rows if (r["site"], r["paradigm"]) == (t["site"], q)])
            for q in ("agreement_a", "agreement_b")
        ]
        np.testing.assert_allclose([t["accuracy_mean"], t["accuracy_std"]], [np.mean(tasks), np.std(tasks)])
        assert t["n_tasks"] == 2
    assert {t["site"] for t in table} == {"values", "hidden"}
    # Tables 2/11 layout: per block (values of block b: index b-1), mean and std over the two tasks
    for t in json.loads((out / "blimp_table2_layers.json").read_text())["rows"]:
        per_task = [
            r["probe_accuracy_mean"] for r in rows if (r["site"], r["layer"]) == (t["site"], t["layer"])
        ]
        assert (
            t["block"] == (t["layer"] if t["site"] == "hidden" else t["layer"] + 1) and 10 <= t["block"] <= 16
        )
        np.testing.assert_allclose(
            [t["accuracy_mean"], t["accuracy_std"]], [np.mean(per_task), np.std(per_task)]
        )


@pytest.mark.slow  # ~8 s under load
def test_blimp_all_pairs_too_long_names_the_paradigm(capsys, tmp_path):
    from helpers import write_blimp_dir

    ckpt = save_tiny_checkpoint(tmp_path / "short", "llama", max_position_embeddings=8)
    code = cli.main(
        [str(a) for a in ("blimp", "--ckpt", ckpt, "--data", write_blimp_dir(tmp_path / "b"), "--tasks", "all",
                          "--no-cache", "--out", tmp_path / "o")]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "agreement_a" in err and "8 positions" in err and not (tmp_path / "o").exists()


# Appendix D's ten tasks in its order, each with Table 10's example pair (apostrophes as in the paper)
APPENDIX_D = [
    ("determiner_noun_agreement_with_adj_irregular_1", "Some waiters broke this lost foot.", "Some waiters broke this lost feet."),
    ("complex_NP_island", "Who aren’t most hospitals that hadn’t talked about most waitresses alarming?",
     "Who aren’t most waitresses alarming most hospitals that hadn’t talked about?"),
    ("regular_plural_subject_verb_agreement_2", "The students perform.", "The student perform."),
    ("determiner_noun_agreement_with_adj_2", "Cynthia scans these hard books.", "Cynthia scans this hard books."),
    ("determiner_noun_agreement_1", "Raymond is selling this sketch.", "Raymond is selling this sketches."),
    ("determiner_noun_agreement_2", "Some dog stunned this committee.", "Some dog stunned these committee."),
    ("irregular_plural_subject_verb_agreement_1", "Those radii have scared that teenager.",
     "Those radii has scared that teenager."),
    ("irregular_plural_subject_verb_agreement_2", "The women meet.", "The woman meet."),
    ("distractor_agreement_relational_noun", "A niece of most senators hasn’t descended most slopes.",
     "A niece of most senators haven’t descended most slopes."),
    ("determiner_noun_agreement_with_adjective_1", "Rebecca was criticizing those good documentaries.",
     "Rebecca was criticizing those good documentary."),
]  # fmt: skip


def test_table2_preset_is_appendix_d_with_table_10_examples(shared_data):
    from lime_probe.protocol import TABLE2_TASKS, protocol_rows

    assert list(TABLE2_TASKS) == [uid for uid, _, _ in APPENDIX_D]
    for uid, good, bad in APPENDIX_D:
        rows = [
            json.loads(line) for line in (shared_data / "blimp" / f"{uid}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 1000 and {r["UID"] for r in rows} == {uid}
        pairs = {(r["sentence_good"], r["sentence_bad"]) for r in rows}
        assert (good.replace("’", "'"), bad.replace("’", "'")) in pairs, uid
    row = next(r for r in protocol_rows() if (r["analysis"], r["setting"]) == ("blimp", "tasks"))
    assert (row["source"], row["where"]) == ("paper", "App. D")


@pytest.mark.slow  # ~19 s under load: every pair of ten paradigms
def test_blimp_defaults_to_every_pair_of_the_table2_tasks(shared_data):
    """The default run reads App. D's ten files and keeps all 1,000 pairs of each (no --max-pairs)."""
    from lime_probe.probes.blimp import load_blimp
    from lime_probe.specs import ANALYSES
    from lime_probe.specs.blimp import chosen_paradigms

    params = ANALYSES["blimp"].params()
    assert params.max_pairs is None and params.method == "logreg"
    data = load_blimp(shared_data / "blimp", chosen_paradigms(params))
    uids = np.asarray(data["UID"])
    assert {u: int((uids == u).sum()) for u in set(uids)} == {uid: 1000 for uid, _, _ in APPENDIX_D}


@pytest.mark.slow
def test_report_keeps_working_sections_and_lists_the_skipped(capsys, tmp_path, ckpts, text_file):
    from helpers import write_blimp_dir

    out = tmp_path / "r"
    code = cli.main(
        [str(a) for a in (
            "report", "--ckpt", ckpts["llama"], "--data", text_file, "--max-sequences", 2, "--no-cache",
            "--analyses", "entropy", "separability", "--unit", "documents", "--words", " is", " the",
            "--blimp", write_blimp_dir(tmp_path / "b"), "--tasks", "all", "--max-pairs", 6, "--out", out,
            "--threads", 1,
        )]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3, err  # written, and the exit status says a section is missing
    # ' is' occurs once in the first two documents: separability is skipped, the rest is written
    assert "skipped separability" in err and "too rare" in err
    assert err.strip().splitlines()[-1].startswith("lime-probe report: incomplete: 1 of 3 sections skipped")
    html = (out / "report.html").read_text()
    assert "Skipped sections" in html and "too rare in the data" in html
    assert "Matrix entropy of values" in html and "BLiMP probes and minimal pairs" in html
    names = {p.name for p in out.iterdir()}
    assert {"entropy_values.json", "blimp.json", "blimp_table2.csv"} <= names
    assert not any(n.startswith("separability") for n in names)
    table = json.loads((out / "blimp_table2.json").read_text())["rows"]
    assert {t["layers"] for t in table} == {"1", "2"}  # the paper's range of 2 blocks: the top block


def test_report_with_every_section_failing_is_exit_2(capsys, tmp_path, ckpts, text_file):
    code = cli.main(
        [str(a) for a in (
            "report", "--ckpt", ckpts["llama"], "--data", text_file, "--max-sequences", 2, "--no-cache",
            "--analyses", "separability", "--out", tmp_path / "r", "--threads", 1,
        )]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "every section failed: separability" in err and not (tmp_path / "r").exists()


def test_entropy_window_over_the_model_positions_is_exit_2(capsys, tmp_path, ckpts, text_file):
    argv = [
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--window",
        129,
        "--out",
        tmp_path / "o",
    ]
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "--window 129 is longer than llama's 128 positions" in err


@pytest.mark.slow  # ~70 s under load
def test_entropy_mixing_null_of_lime_by_its_own_router_is_its_routed_values_entropy(
    capsys, tmp_path, ckpts, text_file
):
    """--mix-router with LIMe mixing its own values: the mixed values are, token for token, what its heads
    read in the forward pass, so the entropy equals the routed_values site's. On LLaMA, the rows carry
    the null's site and its router, and equal the formula applied by hand to LLaMA's values."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.router_weights import mix_by_router

    base = ["entropy", "--data", text_file, "--no-cache", "--num-windows", 3, "--window", 16]
    run_ok(capsys, *base, "--ckpt", ckpts["lime"], "--out", tmp_path / "own")
    run_ok(capsys, *base, "--ckpt", ckpts["lime"], "--mix-router", ckpts["lime"], "--out", tmp_path / "mixed")
    own = {
        r["layer"]: r
        for r in read_rows(tmp_path / "own" / "entropy_values.json")
        if r["site"] == "routed_values"
    }
    mixed = read_rows(tmp_path / "mixed" / "entropy_values.json")
    assert {r["site"] for r in mixed} == {"router_mixed_values"} and len(mixed) == len(own) == 2
    for r in mixed:
        assert r["entropy_mean"] == pytest.approx(own[r["layer"]]["entropy_mean"], rel=1e-5)
        assert r["mix_router"] == str(ckpts["lime"])

    run_ok(capsys, *base, "--ckpt", ckpts["llama"], "--mix-router", ckpts["lime"], "--out", tmp_path / "null")
    null = read_rows(tmp_path / "null" / "entropy_values.json")
    windows = json.loads((tmp_path / "null" / "entropy_values.json").read_text())
    assert {r["site"] for r in null} == {"router_mixed_values"}
    llama, tok = load(ckpts["llama"])
    lime, _ = load(ckpts["lime"])
    from lime_probe.extraction.windows import token_windows

    ids = token_windows(DOCS, tok, 16, 3, seed=0)
    acts = extract(llama, tok, ids, sites=["values"], max_length=16, pretokenized=True)
    by_hand = mix_by_router(lime, {i: acts["values"][i] for i in acts.layers("values")})
    for r in null:
        seqs = [x.double().numpy() for x in by_hand[r["layer"]].split(16)]
        assert r["entropy_mean"] == pytest.approx(float(np.mean(numpy_lime_entropy(seqs))), rel=1e-5)
    assert (
        windows["rows"][0]["windows_digest"]
        == read_rows(tmp_path / "own" / "entropy_values.json")[0]["windows_digest"]
    )


def test_entropy_mixing_null_refuses_another_site(capsys, tmp_path, ckpts, text_file):
    code = cli.main(
        [
            str(a)
            for a in [
                "entropy",
                "--ckpt",
                ckpts["llama"],
                "--data",
                text_file,
                "--site",
                "hidden",
                "--mix-router",
                ckpts["lime"],
                "--out",
                tmp_path / "x",
            ]
        ]
    )
    assert code == 2 and "--mix-router mixes the values" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
