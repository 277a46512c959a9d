"""Committed figures redrawn from the committed tables by today's code, byte for byte (figures/reanalysis.py
on copies of the study folders), and every loss_vs_flops figure either redrawn so or said in its README
not to be redrawable."""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"


def load_script():
    spec = importlib.util.spec_from_file_location("reanalysis", FIGURES / "reanalysis.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_tables(name: str, tables: tuple[str, ...], tmp_path: Path) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for table in tables:
        shutil.copy(FIGURES / name / table, folder / table)
    return folder


def assert_same_bytes(folder: Path, stems: tuple[str, ...]) -> None:
    for stem in stems:
        for suffix in (".png", ".pdf"):
            made, committed = folder / f"{stem}{suffix}", FIGURES / folder.name / f"{stem}{suffix}"
            assert made.read_bytes() == committed.read_bytes(), committed


@pytest.mark.parametrize(
    "name", ["lm-cpu-lr-sweep", "lm-cpu-lr-sweep-ext", "upcycling", "lm-cpu-fair-interior"]
)
def test_the_training_curves_redraw_from_their_per_run_table(name, tmp_path):
    folder = copy_tables(name, (load_script().CURVE_TABLES[name],), tmp_path)
    assert load_script().main([str(folder)]) == 0
    assert_same_bytes(folder, ("loss_vs_flops",))


def test_the_arithmetic_kv_init_figures_redraw_from_its_per_run_tables(tmp_path):
    folder = copy_tables("arithmetic-kv-init", ("accuracy.csv", "entropy.csv", "differences.csv"), tmp_path)
    assert load_script().main([str(folder)]) == 0
    assert_same_bytes(folder, ("accuracy", "endpoints", "value_entropy_values_per_layer"))
    readme = " ".join((FIGURES / "arithmetic-kv-init" / "README.md").read_text().split())
    assert "![differences](endpoints.png)" in readme and "`value_entropy_values_per_layer.png`" in readme


@pytest.mark.parametrize("figure", sorted(FIGURES.glob("*/loss_vs_flops.png")), ids=lambda p: p.parent.name)
def test_every_loss_vs_flops_figure_redraws_or_its_readme_says_why_not(figure):
    tables = load_script().CURVE_TABLES
    readme = " ".join((figure.parent / "README.md").read_text().split())
    if figure.parent.name in tables:
        assert (figure.parent / tables[figure.parent.name]).is_file()
    else:
        assert "`loss_vs_flops.png` cannot be redrawn" in readme
        assert "`metrics.jsonl`, which are not in the repository" in readme


def test_the_runner_commits_the_rows_its_curves_figure_is_drawn_from(tmp_path):
    """A study's loss_vs_flops is drawn from per-run rows it also writes (loss_vs_flops.csv): the figure
    from the runs' metrics and the figure from the written table are the same bytes."""
    import csv
    import json

    from lime_probe.output.charts import plot_training_curves
    from lime_probe.output.plots import save_figure
    from lime_probe.output.results import read_metrics, write_results
    from lime_probe.studies.findings import curve_rows, curves_figure, mean_curve

    runs = {}
    for label, offset in (("LIMe", 0.0), ("LLaMA", 0.3)):
        for seed in (0, 1, 2):
            run = runs[label, seed] = tmp_path / f"{label}-s{seed}"
            run.mkdir()
            lines = []
            for step in range(1, 6):
                loss = 8.0 / step + offset + 0.01 * seed
                lines.append(
                    {"step": step, "tokens": 64 * step, "flops": 1e9 * step, "loss": loss, "lr": 1e-3}
                )
                if step % 2 == 0:  # an evaluation record: no training loss, not drawn
                    lines.append({"step": step, "val_loss": loss + 0.1})
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    labels, seeds = ["LIMe", "LLaMA"], [0, 1, 2]
    rows = curve_rows(runs, labels, seeds)
    assert len(rows) == 2 * 3 * 5 and set(rows[0]) == {"model", "seed", "step", "tokens", "flops", "loss"}
    assert rows[7] == {
        "model": "LIMe",
        "seed": 1,
        "step": 3.0,
        "tokens": 192.0,
        "flops": 3e9,
        "loss": 8 / 3 + 0.01,
    }
    band = "mean over 3 seeds, band: min-max over 3 seeds"
    direct = {label: mean_curve([read_metrics(runs[label, s]) for s in seeds]) for label in labels}
    (from_metrics,) = save_figure(plot_training_curves(direct, band=band), tmp_path / "a", ("png",))
    write_results(tmp_path / "loss_vs_flops", rows, meta={})
    with open(tmp_path / "loss_vs_flops.csv") as f:
        table = list(csv.DictReader(f))
    (from_table,) = save_figure(curves_figure(table, labels, seeds), tmp_path / "b", ("png",))
    assert from_metrics.read_bytes() == from_table.read_bytes()
