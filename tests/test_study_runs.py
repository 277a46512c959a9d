"""Tiny studies end to end through ``lime-probe reproduce --size tiny``: what the results folder holds,
its differences recomputed from the per-run tables by the formulas (`plain_stats`), the accuracies
against the trainer's own evaluation, and reruns that reuse every run and measurement (or recompute
exactly what is missing)."""

import csv
import json

import numpy as np
import pytest
from plain_stats import paired_t

from lime_probe import cli
from lime_probe.studies import STUDIES

pytestmark = pytest.mark.slow  # each module fixture trains a tiny study end to end


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def reproduce(capsys, *argv) -> str:
    """``lime-probe reproduce --size tiny ARGV``; returns its stderr (the progress lines)."""
    capsys.readouterr()
    assert cli.main(["reproduce", "--size", "tiny", "--threads", "1", *argv]) == 0
    return capsys.readouterr().err


def check_paired(row, a, b):
    """``row`` of differences.csv is ``a - b`` paired by seed: the t-interval and t-test written from their
    formulas (`plain_stats`); a constant difference has no t-test, and a zero-width interval."""
    d = np.asarray(a, float) - np.asarray(b, float)
    assert float(row["diff_mean"]) == pytest.approx(d.mean(), abs=1e-12)
    assert json.loads(row["per_seed_diff"]) == pytest.approx(list(d), abs=1e-12)
    lo = hi = d.mean()
    if np.ptp(d) > 0:
        _, lo, hi, p = paired_t(a, b)
        assert float(row["p_t"]) == pytest.approx(p, rel=1e-9, abs=1e-15)
    assert (float(row["ci_low"]), float(row["ci_high"])) == pytest.approx((lo, hi), abs=1e-12)


def mtimes(folder, pattern):
    return {p: p.stat().st_mtime_ns for p in folder.rglob(pattern)}


def step_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[")]


# --------------------------------------------------------------------------- arithmetic-seeds


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIME_MODEL_CACHE", str(out / "cache"))
        assert cli.main(["reproduce", "--study", "arithmetic-seeds", "--size", "tiny", "--threads", "1",
                         "--out", str(out)]) == 0  # fmt: skip
    return out


ARITH_SEEDS = STUDIES["arithmetic-seeds"].sized("tiny").seeds


def test_arithmetic_writes_findings_tables_and_figures(arith):
    res = arith / "results"
    for name in ("findings.md", "differences.csv", "endpoint_values.csv", "accuracy.csv", "entropy.csv"):
        assert (res / name).is_file(), name
    for fig in ("loss_vs_flops", "value_entropy_values_per_layer", "endpoints"):
        assert (res / f"{fig}.png").stat().st_size > 1000, fig
    text = (res / "findings.md").read_text()
    assert "## Primary endpoints" in text and "accuracy (largest n_operators)" in text


def test_accuracy_is_each_runs_own_evaluation(arith):
    rows = read_csv(arith / "results" / "accuracy.csv")
    assert {(r["model"], int(r["seed"])) for r in rows} == {
        (m, s) for m in ("LIMe", "LLaMA") for s in ARITH_SEEDS
    }
    for r in rows:
        run = arith / "train" / f"{r['model'].lower()}-s{r['seed']}"
        trainer = json.loads((run / "arithmetic_eval.json").read_text())["accuracy"]
        assert float(r["accuracy"]) == trainer[r["n_operators"]]


def test_accuracy_differences_are_the_paired_t_test_on_the_per_run_tables(arith):
    res = arith / "results"
    acc = {
        (r["model"], int(r["seed"]), int(r["n_operators"])): float(r["accuracy"])
        for r in read_csv(res / "accuracy.csv")
    }
    largest = max(k for _, _, k in acc)
    values = read_csv(res / "endpoint_values.csv")
    rows = [r for r in read_csv(res / "differences.csv") if r["measure"] == "accuracy"]
    assert sorted(int(r["n_operators"]) for r in rows) == [2, largest]  # the 2-operator tier and the hardest
    for row in rows:
        tier = int(row["n_operators"])
        a = [acc["LIMe", s, tier] for s in ARITH_SEEDS]
        b = [acc["LLaMA", s, tier] for s in ARITH_SEEDS]
        check_paired(row, a, b)
        # endpoint_values.csv holds the very numbers paired
        per_run = {
            (v["model"], int(v["seed"])): float(v["value"])
            for v in values
            if v["endpoint"] == row["endpoint"]
        }
        assert [per_run["LIMe", s] for s in ARITH_SEEDS] == a and [
            per_run["LLaMA", s] for s in ARITH_SEEDS
        ] == b
    (primary,) = [r for r in rows if r["role"] == "primary"]
    assert int(primary["n_operators"]) == largest


def test_value_entropy_differences_are_recomputed_from_the_entropy_table(arith):
    res = arith / "results"
    ent = {}
    for r in read_csv(res / "entropy.csv"):
        if r["site"] == "values":
            ent.setdefault((r["model"], int(r["seed"])), {})[int(r["layer"])] = float(r["entropy_mean"])
    diff = [r for r in read_csv(res / "differences.csv") if r["measure"] == "value entropy"]
    mean_row = next(r for r in diff if r["role"] == "secondary")
    check_paired(
        mean_row,
        [np.mean(list(ent["LIMe", s].values())) for s in ARITH_SEEDS],
        [np.mean(list(ent["LLaMA", s].values())) for s in ARITH_SEEDS],
    )
    layers = [r for r in diff if r["role"] == "exploratory"]
    assert [int(r["layer"]) for r in layers] == sorted(ent["LIMe", 0])
    for row in layers:
        la = int(row["layer"])
        check_paired(
            row, [ent["LIMe", s][la] for s in ARITH_SEEDS], [ent["LLaMA", s][la] for s in ARITH_SEEDS]
        )


def test_a_rerun_reuses_every_run_and_measurement_bit_identically(arith, capsys):
    before = mtimes(arith / "measure", "*.json") | mtimes(arith / "train", "model.safetensors")
    diff = (arith / "results" / "differences.csv").read_bytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIME_MODEL_CACHE", str(arith / "cache"))
        err = reproduce(capsys, "--study", "arithmetic-seeds", "--out", str(arith))
    work = [line for line in step_lines(err) if "comparing" not in line]
    assert work and all("(reused)" in line for line in work), err
    assert mtimes(arith / "measure", "*.json") | mtimes(arith / "train", "model.safetensors") == before
    assert (arith / "results" / "differences.csv").read_bytes() == diff


def test_a_deleted_measurement_alone_is_recomputed_bit_identically(arith, capsys):
    (missing,) = (arith / "measure" / "entropy").glob("llama-s1-*.json")
    kept = missing.read_bytes()
    missing.unlink()
    before = mtimes(arith / "measure", "*.json") | mtimes(arith / "train", "model.safetensors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIME_MODEL_CACHE", str(arith / "cache"))
        err = reproduce(capsys, "--study", "arithmetic-seeds", "--out", str(arith))
    redone = [line for line in step_lines(err) if "(reused)" not in line and "comparing" not in line]
    assert len(redone) == 1 and "measuring LLaMA seed 1" in redone[0], err
    assert missing.read_bytes() == kept
    after = mtimes(arith / "measure", "*.json") | mtimes(arith / "train", "model.safetensors")
    assert {p: t for p, t in after.items() if p != missing} == before


# --------------------------------------------------------------------------- lm-cpu-10-seeds

ROUTING = {"LIMe", "LIMe-LLaMA-kv-init"}


@pytest.fixture(scope="module")
def lm10(shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm10")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIME_MODEL_CACHE", str(out / "cache"))
        argv = ["reproduce", "--study", "lm-cpu-10-seeds", "--size", "tiny", "--threads", "1"]
        assert cli.main([*argv, "--data", str(shared_data), "--out", str(out)]) == 0
    return out / "results"


def test_routed_values_are_measured_and_compared_for_the_two_routing_models_only(lm10):
    for name in ("entropy", "separability", "blimp"):
        models = {r["model"] for r in read_csv(lm10 / f"{name}.csv") if r["site"] == "routed_values"}
        assert models == ROUTING, name
        assert {r["model"] for r in read_csv(lm10 / f"{name}.csv")} == set(STUDIES["lm-cpu-10-seeds"].models)
    routed = [r for r in read_csv(lm10 / "differences.csv") if r["site"] == "routed_values"]
    assert routed and {(r["model"], r["reference"]) for r in routed} == {("LIMe", "LIMe-LLaMA-kv-init")}
    assert (lm10 / "value_entropy_routed_values_per_layer.png").stat().st_size > 1000
    assert (lm10 / "value_entropy_values_per_layer.png").stat().st_size > 1000


def test_tsne_and_router_figures_for_every_seed_with_the_router_table_they_are_drawn_from(lm10):
    for seed in STUDIES["lm-cpu-10-seeds"].sized("tiny").seeds:
        assert list(lm10.glob(f"tsne*_s{seed}.png")), seed
        assert list(lm10.glob(f"router*_s{seed}.png")), seed
        shares: dict[tuple[str, str], float] = {}
        for r in read_csv(lm10 / f"router_s{seed}.csv"):
            assert int(r["source_layer"]) <= int(r["layer"])  # a layer reads itself and earlier layers only
            key = (r["model"], r["layer"])
            shares[key] = shares.get(key, 0.0) + float(r["weight_share"])
        assert {m for m, _ in shares} == set(STUDIES["lm-cpu-10-seeds"].measures["router"].models), seed
        assert all(abs(total - 1) < 1e-6 for total in shares.values()), seed  # each layer's read sums to 1


def test_findings_list_the_four_primary_claims_and_perplexity_is_recomputed(lm10):
    text = (lm10 / "findings.md").read_text()
    primary = text.split("## Primary endpoints")[1].split("## Secondary endpoints")[0]
    table = [
        line for line in primary.splitlines() if line.startswith("| ") and not line.startswith("| claim")
    ]
    declared = [c for c in STUDIES["lm-cpu-10-seeds"].claims if c.role == "primary"]
    assert len(table) == len(declared) == 4
    assert all(c.text in line for c, line in zip(declared, table, strict=True))
    ppl = {(r["model"], int(r["seed"])): float(r["perplexity"]) for r in read_csv(lm10 / "perplexity.csv")}
    seeds = STUDIES["lm-cpu-10-seeds"].sized("tiny").seeds
    row = next(
        r
        for r in read_csv(lm10 / "differences.csv")
        if r["role"] == "primary" and r["measure"] == "perplexity"
    )
    check_paired(row, [ppl["LIMe", s] for s in seeds], [ppl["LLaMA", s] for s in seeds])


# --------------------------------------------------------------------------- route-ablation


@pytest.fixture(scope="module")
def routes(shared_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("routes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIME_MODEL_CACHE", str(out / "cache"))
        argv = [
            "reproduce",
            "--study",
            "route-ablation",
            "--size",
            "tiny",
            "--threads",
            "1",
            "--no-reproducible",
        ]
        assert cli.main([*argv, "--data", str(shared_data), "--out", str(out)]) == 0
    return out / "results"


def test_route_ablation_cuts_lime_only_and_its_primary_is_the_cut_minus_the_own_loss(routes):
    """The cuts run on LIMe alone (LLaMA has no routes), every routed layer's, plain and renormalised; the
    primary is each seed's loss with every cross-layer read cut minus its own, recomputed by the formulas."""
    cuts = read_csv(routes / "ablate-routes.csv")
    assert {r["model"] for r in cuts} == {"LIMe"}
    seeds = STUDIES["route-ablation"].sized("tiny").seeds
    whole = {
        int(r["seed"]): r
        for r in cuts
        if (r["layer"], r["source"], r["renormalized"]) == ("all", "all", "False")
    }
    assert sorted(whole) == list(seeds)
    row = next(r for r in read_csv(routes / "differences.csv") if r["role"] == "primary")
    check_paired(row, [float(whole[s]["loss"]) for s in seeds], [float(whole[s]["base_loss"]) for s in seeds])
    assert {r["renormalized"] for r in cuts} == {"False", "True"}
    assert "## Per layer (exploratory)" in (routes / "findings.md").read_text()
