"""Every notebook in analyses/ runs top to bottom on tiny checkpoints and shows its figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from helpers import CORPUS, save_tiny_checkpoint, write_blimp_dir

from lime_probe.analyses import ANALYSES

nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "analyses").glob("*.ipynb"))


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("nb")
    lime, llama = save_tiny_checkpoint(root / "lime", "lime"), save_tiny_checkpoint(root / "llama", "llama")
    dynamic = save_tiny_checkpoint(root / "dynamic", "lime", routing="dynamic")  # routers need the data
    text = root / "texts.txt"
    text.write_text("\n\n".join(CORPUS * 4) + "\n")
    blimp = write_blimp_dir(root / "blimp")
    for run, offset in ((lime, 0.0), (llama, 0.1)):  # training logs in the trainer's format
        records = [
            {
                "step": s,
                "tokens": 512 * s,
                "flops": 1e9 * s,
                "loss": 3.0 / s + offset,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_s": 1e4,
            }
            for s in range(1, 11)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run / "arithmetic_eval.json").write_text(json.dumps({"accuracy": {"3": 0.5 - offset, "4": 0.25}}))
    return {
        "LIME_CKPTS": f"{lime},{llama}",
        "LIME_LABELS": "LIMe,LLaMA",
        "LIME_DATA": str(text),
        "LIME_MAX_SEQUENCES": "24",
        "LIME_MAX_LENGTH": "32",
        "LIME_WINDOW": "16",
        "LIME_NUM_WINDOWS": "4",
        "LIME_PER_WORD": "8",
        "LIME_PERPLEXITY": "3",
        "LIME_BLIMP": str(blimp),
        "LIME_PARADIGMS": "agreement_a,agreement_b",
        "LIME_MAX_PAIRS": "12",
        "LIME_RUNS": f"{lime},{llama}",
        "LIME_ROUTER_CKPTS": f"{lime},{dynamic}",
    }


def test_every_notebook_belongs_to_an_analysis_of_the_registry():
    assert sorted(p.stem for p in NOTEBOOKS) == sorted({s.notebook for s in ANALYSES.values() if s.notebook})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_default_paths_resolve_from_the_root_and_from_analyses(path, monkeypatch):
    """Jupyter runs a notebook in its own folder; the shipped defaults must name the same files from there
    as from the repository root."""
    for key in [k for k in os.environ if k.startswith("LIME_")]:
        monkeypatch.delenv(key)
    cell = nbformat.read(path, as_version=4).cells[1].source.replace("%matplotlib inline", "")
    seen = []
    for folder in (ROOT, ROOT / "analyses"):
        monkeypatch.chdir(folder)
        names: dict = {}
        exec(cell, names)
        seen.append({k: v for k, v in names.items() if k.isupper()})
    assert seen[0] == seen[1]
    paths = [v for k, v in seen[0].items() if k in ("CKPTS", "RUNS", "DATA", "BLIMP")]
    for p in (x for v in paths for x in (v if isinstance(v, list) else [v])):
        assert Path(p).is_absolute(), p  # so the kernel's working folder does not matter


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_shows_figures(path, env, monkeypatch, tmp_path):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if path.stem == "routers":  # LIMe checkpoints only, static and input-dependent routing
        monkeypatch.setenv("LIME_CKPTS", env["LIME_ROUTER_CKPTS"])
        monkeypatch.setenv("LIME_LABELS", "LIMe,dynamic")
    book = nbformat.read(path, as_version=4)
    assert "os.environ" in book.cells[1].source  # parameters first, overridable from outside
    nbclient.NotebookClient(
        book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    images = [
        o
        for c in book.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    errors = [
        o
        for c in book.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]
    assert not errors
    assert images, f"{path.name} showed no figure"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_and_uses_the_registry(path):
    """The notebooks run the registry's analyses rather than re-implementing their steps."""
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    code = "\n".join(c.source for c in book.cells if c.cell_type == "code")
    for step in ("word_rows(", "balance_classes(", "np.flatnonzero(", "acts.sequences(", "extract("):
        assert step not in code, f"{path.name} re-implements {step!r}: run lime_probe.analyses"
    for spec in ANALYSES.values():
        if spec.notebook == path.stem:
            assert f'ANALYSES["{spec.name}"]' in code, f"{path.name} does not run the {spec.name} analysis"
    params = book.cells[1].source
    names = [line.split("=")[0].strip() for line in params.splitlines() if line[:1].isupper() and "=" in line]
    unused = [n for n in names if code.count(n) < 2]  # defined once, never read
    assert not unused, f"{path.name}: unused parameters {unused}"
