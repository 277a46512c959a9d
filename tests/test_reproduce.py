"""`lime-probe reproduce --size tiny` end to end on the shared data: outputs, differences recomputed
independently from the per-run tables, resumption, and the Table-2 task list."""

import csv
import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from lime_probe import cli
from lime_probe.protocol import TABLE2_TASKS


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
