"""Every notebook in analyses/ runs top to bottom on tiny checkpoints and shows its figures."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import nbformat
import pytest
from helpers import CORPUS, save_tiny_checkpoint, write_blimp_dir

from lime_probe import cli
from lime_probe.specs import ANALYSES

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
    # Paths relative to the folder the notebooks are "launched" from ($PWD), as a user types them in a shell;
    # the kernel runs in another folder.
    return {
        "PWD": str(root),
        "LIME_CKPTS": "lime,llama",
        "LIME_LABELS": "LIMe,LLaMA",
        "LIME_DATA": "texts.txt",
        "LIME_MAX_SEQUENCES": "24",
        "LIME_MAX_LENGTH": "32",
        "LIME_WINDOW": "16",
        "LIME_NUM_WINDOWS": "4",
        "LIME_PER_WORD": "8",
        "LIME_ALLOW_SMALL_SAMPLES": "1",  # the tiny text has a few occurrences of each word
        "LIME_PERPLEXITY": "3",
        "LIME_BLIMP": blimp.name,
        "LIME_PARADIGMS": "agreement_a,agreement_b",
        "LIME_MAX_PAIRS": "12",
        "LIME_RUNS": "lime,llama",
        "LIME_ROUTER_CKPTS": f"lime,{dynamic.name}",
    }


def _parameters(path: Path) -> dict:
    """The upper-case names the notebook's parameter cell defines."""
    cell = nbformat.read(path, as_version=4).cells[1].source.replace("%matplotlib inline", "")
    names: dict = {}
    exec(cell, names)
    return {k: v for k, v in names.items() if k.isupper()}


def test_every_notebook_belongs_to_an_analysis_of_the_registry():
    assert sorted(p.stem for p in NOTEBOOKS) == sorted({s.notebook for s in ANALYSES.values() if s.notebook})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_default_paths_resolve_from_the_root_and_from_analyses(path, monkeypatch):
    """Jupyter runs a notebook in its own folder; the shipped defaults must name the same files from there
    as from the repository root."""
    for key in [k for k in os.environ if k.startswith("LIME_")]:
        monkeypatch.delenv(key)
    seen = []
    for folder in (ROOT, ROOT / "analyses"):
        monkeypatch.chdir(folder)
        seen.append(_parameters(path))
    assert seen[0] == seen[1]
    paths = [v for k, v in seen[0].items() if k in ("CKPTS", "RUNS", "DATA", "BLIMP")]
    for p in (x for v in paths for x in (v if isinstance(v, list) else [v])):
        # a local default is absolute, so the kernel's working folder does not matter; data defaults are
        # hub sources (the package must not name this checkout's ../shared)
        assert Path(p).is_absolute() or p.startswith("hf:") or p == "nyu-mll/blimp", p
        assert "shared" not in p, p


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_defaults_are_the_commands(path, monkeypatch):
    """With no LIME_* variable a notebook measures what its command measures by default: every parameter
    named after a field of the analysis's parameters has that field's default, MAX_SEQUENCES the Spec's
    --max-sequences and MAX_LENGTH the command's --max-length."""
    for key in [k for k in os.environ if k.startswith("LIME_")]:
        monkeypatch.delenv(key)
    spec = next(s for s in ANALYSES.values() if s.notebook == path.stem)
    fields = {f.name: f.default for f in dataclasses.fields(spec.params)}
    names = _parameters(path)
    checked = 0
    for name, value in names.items():
        if name.lower() in fields:
            default = fields[name.lower()]
            assert (list(value) if isinstance(value, tuple) else value) == (
                list(default) if isinstance(default, tuple) else default
            ), name
            checked += 1
    if "MAX_SEQUENCES" in names:
        assert names["MAX_SEQUENCES"] == spec.max_sequences
        checked += 1
    if "MAX_LENGTH" in names:
        parser = cli.build_parser()
        need = ["--ckpt", "x"] + (["--data", "y"] if spec.data_kind == "texts" else [])
        assert names["MAX_LENGTH"] == parser.parse_args([spec.name, *need]).max_length
        checked += 1
    assert checked >= (1 if spec.data_kind == "none" else 2)


def test_relative_settings_are_read_from_the_launch_folder(tmp_path, monkeypatch):
    """A kernel runs in analyses/ but inherits the launching shell's $PWD: a relative path in a LIME_*
    variable names the file the user meant; hub ids and hf: specs pass through."""
    from lime_probe.notebook import env_path, env_paths

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.txt").write_text("x\n")
    elsewhere = tmp_path / "repo" / "analyses"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PWD", str(tmp_path))
    monkeypatch.setenv("LIME_DATA", "data/t.txt")
    monkeypatch.setenv("LIME_CKPTS", "data,gpt2,EleutherAI/pythia-70m")
    assert env_path("LIME_DATA", "unused") == str(tmp_path / "data" / "t.txt")
    assert env_paths("LIME_CKPTS", []) == [str(tmp_path / "data"), "gpt2", "EleutherAI/pythia-70m"]
    monkeypatch.setenv("LIME_DATA", "hf:wikitext:wikitext-2-raw-v1:validation")
    assert env_path("LIME_DATA", "unused") == "hf:wikitext:wikitext-2-raw-v1:validation"
    monkeypatch.delenv("LIME_DATA")
    assert env_path("LIME_DATA", "/the/default") == "/the/default"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
@pytest.mark.slow
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
        assert step not in code, f"{path.name} re-implements {step!r}: run lime_probe.specs"
    for spec in ANALYSES.values():
        if spec.notebook == path.stem:
            assert f'ANALYSES["{spec.name}"]' in code, f"{path.name} does not run the {spec.name} analysis"
    params = book.cells[1].source
    names = [line.split("=")[0].strip() for line in params.splitlines() if line[:1].isupper() and "=" in line]
    unused = [n for n in names if code.count(n) < 2]  # defined once, never read
    assert not unused, f"{path.name}: unused parameters {unused}"
