"""`lime-probe reproduce --study arithmetic --size tiny` end to end: the paired differences recomputed
independently from the per-run outputs, the accuracies against the trainer's own evaluation, resumption
and bad input. No shared data needed: the task is built in."""

import csv
import json

import numpy as np
import pytest
from scipy import stats as sps

from lime_probe import cli

pytestmark = pytest.mark.slow  # each study test shares a module fixture that trains the tiny study end to end


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    argv = ["reproduce", "--study", "arithmetic", "--size", "tiny", "--out", str(out), "--threads", "1"]
    assert cli.main(argv) == 0
    return out


def hand_t_interval(d):
    d = np.asarray(d, dtype=float)
    half = sps.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return d.mean() - half, d.mean() + half


def test_accuracy_bars_are_the_mean_over_seeds_with_a_hand_t_interval():
    from lime_probe.studies.arithmetic import accuracy_intervals

    seeds = [0, 1, 2, 3]
    per = {("A", s): [0.9, 0.5, 0.7, 0.8][s] for s in seeds} | {
        ("B", s): [0.2, 0.2, 0.4, 0.1][s] for s in seeds
    }
    m = {"accuracy": {k: {"accuracy": {"3": v, "1": 1.0}} for k, v in per.items()}}
    means, intervals = accuracy_intervals(m, seeds, ["A", "B"])
    for label in "AB":
        values = [per[label, s] for s in seeds]
        assert means[label][3] == pytest.approx(np.mean(values))
        np.testing.assert_allclose(intervals[label][3], hand_t_interval(values))
        assert intervals[label][1] == (1.0, 1.0)  # no spread over seeds: a zero-width interval


def test_training_curve_band_is_the_min_and_max_over_seeds_at_each_record():
    from lime_probe.studies.lm import _mean_curve

    runs = [
        {"flops": [1, 2, 3], "tokens": [4, 5, 6], "loss": loss}
        for loss in ([3, 2, 1], [4, 1, 2], [2, 3, 0.5])
    ]
    curve = _mean_curve(runs)
    for i in range(3):
        at = [r["loss"][i] for r in runs]
        assert (curve["loss"][i], curve["low"][i], curve["high"][i]) == pytest.approx(
            (sum(at) / 3, min(at), max(at))
        )


def test_writes_tables_figures_and_findings(study):
    res = study / "results"
    for stem in ("differences", "accuracy", "entropy"):
        assert (res / f"{stem}.csv").is_file() and (res / f"{stem}.json").is_file()
    for fig in ("accuracy", "accuracy_difference", "entropy_values", "entropy_difference", "loss_vs_flops"):
        assert (res / f"{fig}.png").stat().st_size > 1000
    text = (res / "findings.md").read_text()
    assert "accuracy, 1 operators" in text and "accuracy, 2 operators" in text and "value entropy" in text
    meta = json.loads((res / "differences.json").read_text())["meta"]
    assert meta["settings"]["seeds"] == [0, 1, 2] and meta["threads"]["torch_threads"] >= 1


def test_accuracy_is_the_trainers_own_evaluation(study):
    # The trainer evaluates each finished run (arithmetic_eval.json) through lime_model's own path.
    for r in read_csv(study / "results" / "accuracy.csv"):
        run = study / "train" / f"{r['model'].lower()}-s{r['seed']}"
        trainer = json.loads((run / "arithmetic_eval.json").read_text())["accuracy"]
        assert float(r["accuracy"]) == trainer[r["operators"]]
        assert int(r["n"]) == 30


def test_accuracy_differences_match_ttest_rel_on_the_per_run_files(study):
    acc = {}
    for path in (study / "measure" / "accuracy").glob("*.json"):
        model, seed = path.stem.split("-s")
        for tier, a in json.loads(path.read_text())["accuracy"].items():
            acc[model, int(seed), int(tier)] = a
    seeds = sorted({s for _, s, _ in acc})
    assert seeds == [0, 1, 2]
    rows = [r for r in read_csv(study / "results" / "differences.csv") if r["measure"] == "accuracy"]
    assert sorted(int(r["operators"]) for r in rows) == [1, 2]
    for row in rows:
        tier = int(row["operators"])
        a = np.array([acc["lime", s, tier] for s in seeds])
        b = np.array([acc["llama", s, tier] for s in seeds])
        ci = sps.ttest_rel(a, b).confidence_interval(0.95)
        assert float(row["diff_mean"]) == pytest.approx((a - b).mean(), abs=1e-12)
        got = (float(row["ci_low"]), float(row["ci_high"]))
        assert got == pytest.approx((ci.low, ci.high), nan_ok=True)
        assert got == pytest.approx(hand_t_interval(a - b), nan_ok=True)
        assert json.loads(row["per_seed_diff"]) == pytest.approx(list(a - b))


def test_entropy_differences_match_a_hand_t_interval(study):
    ent = {}
    for path in (study / "measure" / "entropy").glob("*.json"):
        model, seed = path.stem.split("-s")
        r = json.loads(path.read_text())
        assert np.array(r["values"]).shape == (2, 16)  # (layers, test expressions)
        ent[model, int(seed)] = np.array(r["values"])
    seeds = [0, 1, 2]
    rows = {
        r["layer"]: r
        for r in read_csv(study / "results" / "differences.csv")
        if r["measure"] == "value entropy"
    }
    for layer, get in (
        ("0", lambda v: v[0].mean()),
        ("1", lambda v: v[1].mean()),
        ("mean", lambda v: v.mean()),
    ):
        d = [get(ent["lime", s]) - get(ent["llama", s]) for s in seeds]
        assert float(rows[layer]["diff_mean"]) == pytest.approx(np.mean(d))
        assert (float(rows[layer]["ci_low"]), float(rows[layer]["ci_high"])) == pytest.approx(
            hand_t_interval(d)
        )


def test_the_hardest_tier_is_the_primary_endpoint_with_p_values_and_layers_are_exploratory(study):
    acc, ent = {}, {}
    for path in (study / "measure" / "accuracy").glob("*.json"):
        model, seed = path.stem.split("-s")
        acc[model, int(seed)] = json.loads(path.read_text())["accuracy"]["2"]
    for path in (study / "measure" / "entropy").glob("*.json"):
        model, seed = path.stem.split("-s")
        ent[model, int(seed)] = np.array(json.loads(path.read_text())["values"])
    rows = read_csv(study / "results" / "differences.csv")
    primary = [r for r in rows if r["endpoint"] == "primary"]
    assert [(r["measure"], r["operators"]) for r in primary] == [("accuracy", "2")]
    d = np.array([acc["lime", s] - acc["llama", s] for s in (0, 1, 2)])
    if np.ptp(d) > 0:
        assert float(primary[0]["p_t"]) == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue)
    # the sign-flip p by enumerating the 8 sign patterns by hand
    flips = [abs(s0 * d[0] + s1 * d[1] + s2 * d[2]) for s0 in (1, -1) for s1 in (1, -1) for s2 in (1, -1)]
    assert float(primary[0]["p_sign_flip"]) == pytest.approx(
        np.mean([f >= abs(d.sum()) - 1e-12 for f in flips])
    )
    secondary = {(r["measure"], r["operators"] or r["layer"]) for r in rows if r["endpoint"] == "secondary"}
    assert secondary == {("accuracy", "1"), ("value entropy", "mean")}
    layers = [r for r in rows if r["endpoint"] == "exploratory"]
    assert [r["layer"] for r in layers] == ["0", "1"] and {r["verdict"] for r in layers} == {"exploratory"}
    p = np.array(
        [
            sps.ttest_rel(*([ent[m, s][la].mean() for s in (0, 1, 2)] for m in ("lime", "llama"))).pvalue
            for la in (0, 1)
        ]
    )
    assert [float(r["p_holm"]) for r in layers] == pytest.approx(list(_holm2(p)))
    assert [float(r["q_bh"]) for r in layers] == pytest.approx(list(sps.false_discovery_control(p)))
    text = (study / "results" / "findings.md").read_text()
    assert "| primary | accuracy, 2 operators" in text and "(exploratory)" in text


def _holm2(p):
    """Holm for two p-values, written out: the smaller times 2, the larger times 1, kept monotone."""
    lo, hi = (0, 1) if p[0] <= p[1] else (1, 0)
    out = np.empty(2)
    out[lo] = min(1.0, 2 * p[lo])
    out[hi] = max(out[lo], min(1.0, p[hi]))
    return out


def test_a_rerun_recomputes_only_the_missing_measurement_bit_identically(study):
    measure = study / "measure"
    before = {p: p.stat().st_mtime_ns for p in measure.rglob("*.json")}
    weights = {p: p.stat().st_mtime_ns for p in (study / "train").rglob("model.safetensors")}
    missing = measure / "accuracy" / "llama-s1.json"
    kept = missing.read_bytes()
    missing.unlink()
    argv = ["reproduce", "--study", "arithmetic", "--size", "tiny", "--out", str(study), "--threads", "1"]
    assert cli.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in (study / "train").rglob("model.safetensors")} == weights
    assert all(p.stat().st_mtime_ns == t for p, t in before.items() if p != missing)
    assert missing.read_bytes() == kept  # recomputed from the same weights: the same bytes


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--study", "arithmetic", "--seeds", "3"], "seeds must be at least two distinct integers"),
        (["--study", "arithmetic", "--seeds", "1,1"], "seeds must be at least two distinct integers"),
        (["--study", "arithmetic", "--data", "x"], "--study arithmetic generates its data"),
        (["--study", "lm"], "--study lm needs --data"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, extra, message):
    out = tmp_path / "o"
    code = cli.main(["reproduce", "--size", "tiny", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_seeds_that_are_not_integers_are_a_usage_error(tmp_path, capsys):
    code = cli.main(["reproduce", "--study", "arithmetic", "--seeds", "0,x", "--out", str(tmp_path / "o")])
    assert code == 2 and "expected comma-separated integers" in capsys.readouterr().err


# --------------------------------------------------------------------------- the k/v-init 2 x 2

KV = ["--baselines", "lime-llama-kv-init,llama-torch-kv-init"]
RUN = {"LIMe": "lime", "LLaMA": "llama", "LIMe-LLaMA-kv-init": "lime-llama-kv-init"}
RUN["LLaMA-torch-kv-init"] = "llama-torch-kv-init"


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv")
    argv = ["reproduce", "--study", "arithmetic", "--size", "tiny", "--seeds", "0,1", *KV]
    assert cli.main([*argv, "--out", str(out), "--threads", "1"]) == 0
    return out


def test_2x2_trains_the_four_cells_seed_major_and_measures_each_seed_before_the_next(two_by_two):
    train, measure = two_by_two / "train", two_by_two / "measure"
    # "auto" is the official code's choice: PyTorch's default with routing, HF's normal(0, 0.02) without
    cells = {
        "lime": ("full", "auto"),
        "llama": ("none", "auto"),
        "lime-llama-kv-init": ("full", "normal"),
        "llama-torch-kv-init": ("none", "torch"),
    }
    for name, cell in cells.items():
        cfg = json.loads((train / f"{name}-s0" / "config.json").read_text())
        assert (cfg["routing"], cfg["kv_proj_init"]) == cell
    started_s1 = min((train / f"{n}-s1" / "recipe.json").stat().st_mtime_ns for n in RUN.values())
    for name in RUN.values():  # seed 0: trained and measured before any seed-1 training began
        assert (train / f"{name}-s0" / "metrics.jsonl").stat().st_mtime_ns < started_s1
        for kind in ("accuracy", "entropy"):
            assert (measure / kind / f"{name}-s0.json").stat().st_mtime_ns < started_s1


def test_2x2_contrasts_each_against_the_cell_that_differs_in_one_factor(two_by_two):
    acc = {}
    for path in (two_by_two / "measure" / "accuracy").glob("*.json"):
        name, seed = path.stem.rsplit("-s", 1)
        acc[name, int(seed)] = json.loads(path.read_text())["accuracy"]["2"]

    def hard(label):
        return np.array([acc[RUN[label], s] for s in (0, 1)])

    rows = [r for r in read_csv(two_by_two / "results" / "differences.csv") if r["measure"] == "accuracy"]
    hardest = {(r["model"], r["reference"]): r for r in rows if r["operators"] == "2"}
    expected = {
        ("LIMe-LLaMA-kv-init", "LLaMA"): "primary",
        ("LLaMA-torch-kv-init", "LLaMA"): "primary",
        ("LIMe", "LLaMA-torch-kv-init"): "secondary",
        ("LIMe", "LIMe-LLaMA-kv-init"): "secondary",
        ("LIMe", "LLaMA"): "secondary",
        ("routing at torch init", "routing at LLaMA init"): "secondary",
    }
    assert {pair: r["endpoint"] for pair, r in hardest.items()} == expected
    for (model, ref), r in hardest.items():
        if model.startswith("routing"):  # (LIMe - LLaMA-torch) - (LIMe-LLaMA-kv-init - LLaMA), per seed
            d = hard("LIMe") - hard("LLaMA-torch-kv-init") - hard("LIMe-LLaMA-kv-init") + hard("LLaMA")
        else:
            d = hard(model) - hard(ref)
        assert json.loads(r["per_seed_diff"]) == pytest.approx(list(d), abs=1e-12)
        assert (float(r["ci_low"]), float(r["ci_high"])) == pytest.approx(hand_t_interval(d), nan_ok=True)
    text = (two_by_two / "results" / "findings.md").read_text()
    assert "| primary | accuracy, 2 operators (points) | LIMe-LLaMA-kv-init - LLaMA |" in text
    assert "| primary | accuracy, 2 operators (points) | LLaMA-torch-kv-init - LLaMA |" in text
    assert "k/v init x routing" in text


def test_2x2_exploratory_layers_are_adjusted_within_each_contrast(two_by_two):
    rows = [r for r in read_csv(two_by_two / "results" / "differences.csv") if r["endpoint"] == "exploratory"]
    families = {}
    for r in rows:
        families.setdefault((r["model"], r["reference"]), []).append(r)
    assert len(families) == 5 and all(len(f) == 2 for f in families.values())  # 2 layers per contrast
    for family in families.values():
        p = np.array([float(r["p_t"]) for r in family])
        if np.isfinite(p).all():
            assert [float(r["p_holm"]) for r in family] == pytest.approx(list(_holm2(p)))


@pytest.mark.parametrize("baselines", ["lime-llama-kv-init", "denseformer", "lime-llama-kv-init,denseformer"])
def test_arithmetic_baselines_other_than_the_2x2_are_one_line_exit_2(tmp_path, capsys, baselines):
    out = tmp_path / "o"
    argv = ["reproduce", "--study", "arithmetic", "--size", "tiny", "--baselines", baselines]
    code = cli.main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--baselines lime-llama-kv-init,llama-torch-kv-init" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not out.exists()
