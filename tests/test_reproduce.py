"""`lime-probe reproduce --size tiny` end to end on the shared data: outputs, differences recomputed
independently from the per-run tables, resumption, and the Table-2 task list."""

import csv
import json
import math
import shutil
from itertools import product

import numpy as np
import pytest
from scipy import stats as sps

from lime_probe import cli
from lime_probe.protocol import TABLE2_TASKS
from lime_probe.studies.lm import SIZES

pytestmark = pytest.mark.slow  # each study test shares a module fixture that trains the tiny study end to end


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def repro(shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("repro")
    code = cli.main(
        ["reproduce", "--data", str(shared_data), "--size", "tiny", "--out", str(out), "--threads", "1"]
    )
    assert code == 0
    return out


def test_table2_tasks_are_ten_blimp_paradigms(shared_data):
    assert len(TABLE2_TASKS) == len(set(TABLE2_TASKS)) == 10
    assert all((shared_data / "blimp" / f"{t}.jsonl").is_file() for t in TABLE2_TASKS)


def test_writes_every_table_and_figure(repro):
    res = repro / "results"
    for stem in ("perplexity", "entropy", "separability", "blimp", "differences", "router"):
        assert (res / f"{stem}.csv").is_file() and (res / f"{stem}.json").is_file()
    for fig in (
        "entropy_values",
        "entropy_difference",
        "separability_values",
        "loss_vs_flops",
        "tsne_values",
    ):
        assert (res / f"{fig}.png").stat().st_size > 1000
    text = (res / "findings.md").read_text()
    assert "perplexity" in text and text.count("| ") > 5
    meta = json.loads((res / "differences.json").read_text())["meta"]
    assert meta["threads"]["torch_threads"] >= 1 and "deterministic" in meta["threads"]
    routers = json.loads((res / "router.json").read_text())["routers"]
    assert {label: r["initial"] for label, r in routers.items()} == {
        f"LIMe s{s}": f"step 0, rebuilt from the run's seed {s}" for s in (0, 1)
    }  # each run's own step 0 beside its trained routers
    assert all((res / f"router_LIMe_s{s}.png").is_file() for s in (0, 1))


def test_differences_match_a_recomputation_from_the_per_run_tables(repro):
    res = repro / "results"
    ppl = {(r["model"], int(r["seed"])): float(r["perplexity"]) for r in read_csv(res / "perplexity.csv")}
    seeds = sorted({s for _, s in ppl})
    a = np.array([ppl["LIMe", s] for s in seeds])
    b = np.array([ppl["LLaMA", s] for s in seeds])
    ci = sps.ttest_rel(a, b).confidence_interval(0.95)
    row = next(r for r in read_csv(res / "differences.csv") if r["measure"] == "perplexity")
    assert float(row["diff_mean"]) == pytest.approx((a - b).mean())
    assert (float(row["ci_low"]), float(row["ci_high"])) == pytest.approx((ci.low, ci.high))
    # Perplexity is exp of the mean token NLL the same table reports.
    for r in read_csv(res / "perplexity.csv"):
        assert float(r["perplexity"]) == pytest.approx(math.exp(float(r["loss"])))
    # Per-layer entropy difference = mean over seeds of (LIMe - LLaMA) of the per-run window means.
    ent = {
        (r["model"], int(r["seed"]), int(r["layer"])): float(r["entropy_mean"])
        for r in read_csv(res / "entropy.csv")
    }
    layer0 = next(
        r for r in read_csv(res / "differences.csv") if r["measure"] == "value entropy" and r["layer"] == "0"
    )
    expected = np.mean([ent["LIMe", s, 0] - ent["LLaMA", s, 0] for s in seeds])
    assert float(layer0["diff_mean"]) == pytest.approx(expected)


def hand_sign_flip_p(d):
    """Share of the 2^n sign patterns whose |sum| reaches the observed |sum|, by enumeration."""
    d = list(d)
    sums = [
        abs(sum(s * x for s, x in zip(signs, d, strict=True))) for signs in product((1, -1), repeat=len(d))
    ]
    return np.mean([v >= abs(sum(d)) - 1e-12 for v in sums])


def hand_holm(p):
    order = np.argsort(p)
    out, running = np.empty(len(p)), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def test_primary_endpoints_carry_p_values_and_mde_and_layers_are_exploratory(repro):
    res = repro / "results"
    rows = read_csv(res / "differences.csv")
    ppl = {(r["model"], int(r["seed"])): float(r["perplexity"]) for r in read_csv(res / "perplexity.csv")}
    a, b = (np.array([ppl[m, s] for s in (0, 1)]) for m in ("LIMe", "LLaMA"))
    row = next(r for r in rows if r["measure"] == "perplexity")
    assert row["endpoint"] == "primary" and row["model"] == "LIMe" and row["reference"] == "LLaMA"
    assert float(row["p_t"]) == pytest.approx(sps.ttest_rel(a, b).pvalue)
    assert float(row["p_sign_flip"]) == hand_sign_flip_p(a - b)
    # the MDE: the effect a paired t-test at 2 seeds detects with 80 % power (scipy's noncentral t)
    mde, sd = float(row["mde"]), (a - b).std(ddof=1)
    crit, nc = sps.t.ppf(0.975, 1), float(row["mde"]) * np.sqrt(2) / sd
    assert sps.nct.sf(crit, 1, nc) == pytest.approx(0.8, abs=1e-6) and mde > 0  # lower tail ~0 here
    # per layer: exploratory, no verdict, Holm and BH over the layers of the measure
    ent = {
        (r["model"], int(r["seed"]), int(r["layer"])): float(r["entropy_mean"])
        for r in read_csv(res / "entropy.csv")
    }
    layers = [r for r in rows if r["measure"] == "value entropy" and r["layer"] != "mean"]
    assert [r["layer"] for r in layers] == ["0", "1"]
    assert {r["endpoint"] for r in layers} == {"exploratory"} and {r["verdict"] for r in layers} == {
        "exploratory"
    }
    p = np.array(
        [sps.ttest_rel(*([ent[m, s, la] for s in (0, 1)] for m in ("LIMe", "LLaMA"))).pvalue for la in (0, 1)]
    )
    assert [float(r["p_t"]) for r in layers] == pytest.approx(list(p))
    assert [float(r["p_holm"]) for r in layers] == pytest.approx(list(hand_holm(p)))
    assert [float(r["q_bh"]) for r in layers] == pytest.approx(list(sps.false_discovery_control(p)))
    # two seeds are below the bootstrap's minimum: no seeds x windows column
    assert "ci_low_seeds_x_windows" not in rows[0]
    text = (res / "findings.md").read_text()
    assert "sign-flip" in text and "MDE" in text and "## Per layer (exploratory)" in text
    assert "holds" not in text.split("## Per layer")[1]


def test_a_rerun_reuses_everything_and_an_interrupted_one_redoes_only_what_is_missing(repro, shared_data):
    measure = repro / "measure"
    files = sorted(measure.rglob("*.json"))
    before = {p: p.stat().st_mtime_ns for p in files}
    weights = {p: p.stat().st_mtime_ns for p in (repro / "train").rglob("model.safetensors")}
    missing = measure / "entropy" / "llama-s1.json"
    kept = missing.read_text()
    missing.unlink()
    code = cli.main(["reproduce", "--data", str(shared_data), "--size", "tiny", "--out", str(repro)])
    assert code == 0
    assert {p: p.stat().st_mtime_ns for p in (repro / "train").rglob("model.safetensors")} == weights
    assert all(p.stat().st_mtime_ns == t for p, t in before.items() if p != missing)
    assert json.loads(missing.read_text()) == json.loads(kept)  # recomputed, bit-identical


def test_bad_data_folder_is_one_line_exit_2(tmp_path, capsys):
    code = cli.main(["reproduce", "--data", str(tmp_path), "--size", "tiny", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "data not found" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def with_baseline(repro, shared_data, tmp_path_factory):
    """The tiny study plus DenseFormer: a copy of ``repro``'s runs and measurements, so only the
    baseline's runs are trained and measured."""
    out = tmp_path_factory.mktemp("repro-baseline")
    for part in ("train", "measure"):
        shutil.copytree(repro / part, out / part)
    argv = ["reproduce", "--data", str(shared_data), "--size", "tiny", "--out", str(out)]
    assert cli.main([*argv, "--threads", "1", "--baselines", "denseformer"]) == 0
    return out


def test_baseline_rows_are_the_paired_difference_vs_llama_from_the_per_run_files(with_baseline):
    rows = read_csv(with_baseline / "results" / "differences.csv")
    mine = [r for r in rows if r["model"] == "DenseFormer"]
    measure = with_baseline / "measure"

    def per_seed(kind, label, get):
        # BLiMP's measurement names its pair count (the tiny size's)
        tail = f"-{SIZES['tiny'].blimp_pairs}-pairs" if kind == "blimp" else ""
        return np.array(
            [get(json.loads((measure / kind / f"{label}-s{s}{tail}.json").read_text())) for s in (0, 1)]
        )

    def check(measure_name, where, kind, get):
        a, b = per_seed(kind, "denseformer", get), per_seed(kind, "llama", get)
        row = next(r for r in mine if r["measure"] == measure_name and where in (r["layer"], r["site"]))
        assert float(row["DenseFormer"]) == pytest.approx(a.mean())
        assert float(row["LLaMA"]) == pytest.approx(b.mean())
        assert float(row["diff_mean"]) == pytest.approx((a - b).mean())
        if np.ptp(a - b) > 0:  # a constant difference has a zero-width interval scipy reports as nan
            ci = sps.ttest_rel(a, b).confidence_interval(0.95)
            assert (float(row["ci_low"]), float(row["ci_high"])) == pytest.approx((ci.low, ci.high))
        exploratory = isinstance(where, str) and where.isdigit()
        assert row["endpoint"] == ("exploratory" if exploratory else "primary")
        assert row["verdict"] in (("exploratory",) if exploratory else ("not resolved", "higher", "lower"))

    check("perplexity", "", "perplexity", lambda r: r["perplexity"])
    check("value entropy", "1", "entropy", lambda r: np.mean(r["values"][1]))
    check("value entropy", "mean", "entropy", lambda r: np.mean(r["values"]))
    check("separability", "upper half", "separability", lambda r: np.mean(r["accuracy"][1:]))
    check(
        "BLiMP probe (Table 2)",
        "values",
        "blimp",
        lambda r: np.mean([np.mean(t["values"]["accuracy"]) for t in r["tasks"].values()]),
    )
    assert len(mine) == len([r for r in rows if r["model"] == "LIMe"])  # the same measures as LIMe's
    assert (with_baseline / "train" / "denseformer-s1" / "model.safetensors").is_file()
    assert json.loads((with_baseline / "train" / "denseformer-s0" / "config.json").read_text())[
        "model_type"
    ] == ("denseformer")
    assert "DenseFormer" in (with_baseline / "results" / "findings.md").read_text()
    settings = json.loads((with_baseline / "results" / "summary.json").read_text())["meta"]["settings"]
    assert settings["models"] == ["LIMe", "LLaMA", "DenseFormer"]


def test_lime_and_llama_rows_do_not_change_with_baselines(repro, with_baseline):
    lime = [r for r in read_csv(with_baseline / "results" / "differences.csv") if r["model"] == "LIMe"]
    alone = read_csv(repro / "results" / "differences.csv")
    keys = list(alone[0])
    assert [{k: r[k] for k in keys} for r in lime] == alone
    per_run = read_csv(with_baseline / "results" / "perplexity.csv")
    assert [r for r in per_run if r["model"] != "DenseFormer"] == read_csv(
        repro / "results" / "perplexity.csv"
    )


def test_unknown_baseline_is_one_line_exit_2(shared_data, tmp_path, capsys):
    argv = ["reproduce", "--data", str(shared_data), "--size", "tiny", "--out", str(tmp_path / "o")]
    code = cli.main([*argv, "--baselines", "denseformer,mamba"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown baseline 'mamba'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "name, model, kv_proj_init",
    [("lime-llama-kv-init", "LIMe", "normal"), ("llama-torch-kv-init", "LLaMA", "torch")],
)
def test_kv_init_ablations_change_only_the_kv_init(name, model, kv_proj_init):
    """``--baselines lime-llama-kv-init`` / ``llama-torch-kv-init``: the study's LIMe (LLaMA) recipe
    with the other model's k/v init."""
    from helpers import tiny_tokenizer

    from lime_model.recipes import load_recipe
    from lime_model.train import model_config
    from lime_probe.studies.lm import BASELINES, MODELS

    label, overrides = BASELINES[name]
    tok = tiny_tokenizer()
    plain, ablation = (
        model_config(load_recipe("wikitext-cpu", {"data": "x.txt", **o}), tok)
        for o in (MODELS[model], overrides)
    )
    assert ablation.to_dict() == {**plain.to_dict(), "kv_proj_init": kv_proj_init}
    assert ablation.kv_proj_torch_init == (not plain.kv_proj_torch_init) == (kv_proj_init == "torch")
    assert label not in MODELS


def test_the_separability_probe_orders_its_classes_as_the_words_are_declared(monkeypatch):
    """The official probe lays rows out class by class in its words' order (is, are, was, were), not sorted."""
    from lime_probe.probes import separability
    from lime_probe.studies import lm as reproduce

    seen = {}
    real = separability.token_separability

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(separability, "token_separability", spy)
    rng = np.random.default_rng(0)
    words = np.array([" is", " are", " was", " were"] * 10, dtype=object)
    out = reproduce.measure_separability({0: rng.normal(size=(40, 3))}, words, seed=42)
    assert seen["classes"] == (" is", " are", " was", " were") and out["layers"] == [0]


def test_tsne_has_one_row_per_model_and_seed_each_from_its_own_features():
    from lime_probe.probes.tsne import tsne_layers
    from lime_probe.studies.lm import SIZES, tsne_embeddings

    gen = np.random.default_rng(0)
    words = np.array(["is", "are", "was", "were"] * 6)
    features = {
        (label, seed): ({la: gen.normal(size=(len(words), 8)) for la in range(4)}, words)
        for seed in (0, 1)
        for label in ("LIMe", "LLaMA")
    }
    out = tsne_embeddings(features, SIZES["tiny"])
    assert list(out) == ["LIMe, seed 0", "LLaMA, seed 0", "LIMe, seed 1", "LLaMA, seed 1"]
    for (label, seed), (feats, w) in features.items():
        emb, kept = out[f"{label}, seed {seed}"]
        assert list(kept) == list(w)  # 6 of each word: all kept, in order
        alone = tsne_layers({la: feats[la] for la in emb}, perplexity=len(w) / 4, progress=False)
        for la in emb:
            np.testing.assert_allclose(emb[la], alone[la])
