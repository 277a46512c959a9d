"""figures/reanalysis.py on copies of the committed study folders: the primary endpoints and the
per-layer Holm/BH table recomputed independently from the per-run CSVs (the formulas, `plain_stats`)."""

import csv
import importlib.util
import shutil
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from plain_stats import bh_loop, holm_loop, paired_t

pytestmark = pytest.mark.slow  # runs the reanalysis script on copies of the study folders

ROOT = Path(__file__).resolve().parents[1]
TABLES = ("perplexity", "entropy", "separability", "blimp", "accuracy", "differences")


def load_script():
    spec = importlib.util.spec_from_file_location("reanalysis", ROOT / "figures" / "reanalysis.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def copy_study(name, tmp_path):
    folder = tmp_path / name
    folder.mkdir()
    for path in (ROOT / "figures" / name).iterdir():
        if path.stem in TABLES and path.suffix == ".csv" or path.name == "summary.json":
            shutil.copy(path, folder / path.name)
    return folder


def per_seed(rows, model, key, value, **where):
    picked = [r for r in rows if r["model"] == model and all(r[k] == v for k, v in where.items())]
    return np.array([float(r[value]) for r in sorted(picked, key=lambda r: int(r[key]))])


def test_lm_study_reanalysis_against_the_formulas_from_the_per_run_tables(tmp_path):
    folder = copy_study("lm-cpu", tmp_path)
    assert load_script().main([str(folder)]) == 0
    rows = read_csv(folder / "reanalysis.csv")
    ent = read_csv(folder / "entropy.csv")
    layers = sorted({int(r["layer"]) for r in ent})
    lime = np.array(
        [per_seed(ent, "LIMe", "seed", "entropy_mean", layer=str(la)) for la in layers]
    )  # (L, seeds)
    llama = np.array([per_seed(ent, "LLaMA", "seed", "entropy_mean", layer=str(la)) for la in layers])
    # the primary endpoint: mean over layers, paired by seed
    primary = next(r for r in rows if r["measure"] == "value entropy" and r["layer"] == "")
    a, b = lime.mean(0), llama.mean(0)
    _, lo, hi, p_t = paired_t(a, b)
    assert primary["role"] == "primary" and primary["verdict"] == "not resolved"
    assert float(primary["p_t"]) == pytest.approx(p_t)
    assert (float(primary["ci_low"]), float(primary["ci_high"])) == pytest.approx((lo, hi))
    flips = [abs(np.dot(s, a - b)) >= abs((a - b).sum()) - 1e-12 for s in product((1, -1), repeat=3)]
    assert float(primary["p_sign_flip"]) == pytest.approx(np.mean(flips))
    # per layer: p, Holm and BH from their formulas; none survives Holm
    exploratory = [
        r
        for r in rows
        if r["measure"] == "value entropy" and r["role"] == "exploratory" and r["reference"] == "LLaMA"
    ]
    p = [paired_t(lime[i], llama[i])[3] for i in range(len(layers))]
    assert [float(r["p_t"]) for r in exploratory] == pytest.approx(p)
    assert [float(r["p_holm"]) for r in exploratory] == pytest.approx(holm_loop(p))
    assert [float(r["q_bh"]) for r in exploratory] == pytest.approx(bh_loop(p))
    assert min(float(r["p_holm"]) for r in exploratory) > 0.05
    assert {r["verdict"] for r in exploratory} == {"exploratory"}
    text = (folder / "reanalysis.md").read_text()
    assert "(re-analysis)" in text and "37 rows checked" in text and "Holm p < 0.05" in text


def test_arithmetic_reanalysis_makes_the_hardest_tier_primary(tmp_path):
    folder = copy_study("arithmetic-seeds", tmp_path)
    assert load_script().main([str(folder)]) == 0
    rows = read_csv(folder / "reanalysis.csv")
    acc = read_csv(folder / "accuracy.csv")
    primary = [r for r in rows if r["role"] == "primary"]
    assert [(r["measure"], r["n_operators"]) for r in primary] == [("accuracy", "3")]
    d = per_seed(acc, "LIMe", "seed", "accuracy", operators="3") - per_seed(
        acc, "LLaMA", "seed", "accuracy", operators="3"
    )
    assert float(primary[0]["p_t"]) == pytest.approx(paired_t(d, np.zeros_like(d))[3])
    assert float(primary[0]["p_sign_flip"]) == 2 / 32  # LIMe ahead in all five seeds
    assert "secondary" in {r["role"] for r in rows}
    assert "a choice made after its results were seen" in (folder / "reanalysis.md").read_text()


def test_a_folder_that_is_no_study_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    assert load_script().main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert "not one of the studies" in err and len(err.strip().splitlines()) == 1
    missing = copy_study("lm-cpu", tmp_path)
    (missing / "blimp.csv").unlink()
    assert load_script().main([str(missing)]) == 2
    assert "per-run table not found" in capsys.readouterr().err
    assert not (missing / "reanalysis.md").exists() and not (missing / "reanalysis.csv").exists()
