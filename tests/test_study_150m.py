"""The 150M study is declared and one command away: its declaration, protocol and run script agree, and
nothing here trains or measures."""

import re
import subprocess
from pathlib import Path

import pytest

from lime_model.recipes import load_recipe
from lime_probe.studies import STUDIES
from lime_probe.studies.runner import Data, run_name, run_study

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "figures" / "lime-150m"
STUDY = STUDIES["lime-150m"]


def test_the_declaration_lists_its_runs_on_the_150m_recipe():
    assert STUDY.recipe == "lime-150m" and STUDY.data == "fineweb-edu"
    assert STUDY.seeds == (0, 1, 2, 3, 4)
    assert {label: dict(o) for label, o in STUDY.models.items()} == {
        "LIMe": {"routing": "full"},
        "LLaMA": {"routing": "none"},
    }
    runs = [run_name(label, seed) for seed in STUDY.seeds for label in STUDY.models]
    assert len(runs) == len(set(runs)) == 10
    for overrides in STUDY.models.values():  # each run's recipe is valid as the runner trains it
        recipe = load_recipe(STUDY.recipe, {"data": "train/", **STUDY.overrides, **overrides})
        assert (recipe.model["hidden_size"], recipe.model["num_hidden_layers"]) == (768, 12)
    assert STUDY.reproducible is False  # trained on GPUs outside the CPU-pinning mode


def test_the_protocol_names_the_primary_and_the_secondaries_it_declares():
    assert STUDY.protocol == "figures/lime-150m/PROTOCOL.md"
    text = (ROOT / STUDY.protocol).read_text()
    assert "committed before any run" in text
    (primary,) = [c for c in STUDY.claims if c.role == "primary"]
    assert (primary.model, primary.reference, primary.endpoint.name, primary.sign) == (
        "LIMe",
        "LLaMA",
        "perplexity",
        None,
    )
    flat = " ".join(text.split())
    assert "Primary: perplexity on `test.jsonl`, LIMe minus LLaMA, paired by seed, two-sided" in flat
    secondaries = [c for c in STUDY.claims if c.role == "secondary"]
    listed = re.findall(r"^(\d+)\. ", text.split("## Secondary endpoints")[1].split("Exploratory")[0], re.M)
    assert len(secondaries) == len(listed) == 9
    assert "Holm over these nine" in text


def test_the_run_script_trains_exactly_the_declared_runs_into_the_runners_folders():
    script = (FOLDER / "run.sh").read_text()
    subprocess.run(["bash", "-n", str(FOLDER / "run.sh")], check=True)
    seeds = tuple(int(s) for s in re.search(r"for seed in ([\d ]+); do", script)[1].split())
    models = dict(
        m.split() for m in re.findall(r'"(\w+ \w+)"', script.split("for model in")[1].split(";")[0])
    )
    assert seeds == STUDY.seeds
    assert models == {label.lower(): o["routing"] for label, o in STUDY.models.items()}
    assert 'run="$OUT/train/$1-s$seed"' in script and "OUT=runs/lime-150m" in script  # run_name's folders
    assert run_name("LIMe", 3) == "lime-s3"
    assert "--recipe lime-150m" in script
    assert "lime-probe reproduce --study lime-150m" in script
    for step in ("lime-model prepare", "accelerate launch", "lime-probe reproduce"):
        assert step in (FOLDER / "README.md").read_text()


def test_its_data_folder_layout(tmp_path):
    with pytest.raises(ValueError, match="fineweb-edu/train, fineweb-edu/test.jsonl and blimp/"):
        run_study("lime-150m", out=tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="fineweb-edu/train"):
        Data.under(tmp_path, "fineweb-edu")
    (tmp_path / "fineweb-edu" / "train").mkdir(parents=True)
    (tmp_path / "fineweb-edu" / "test.jsonl").write_text('{"text": "a held-out document"}\n')
    (tmp_path / "blimp").mkdir()
    data = Data.under(tmp_path, "fineweb-edu")
    assert (data.train, data.test) == (
        tmp_path / "fineweb-edu" / "train",
        tmp_path / "fineweb-edu" / "test.jsonl",
    )
    assert data.test_texts == ["a held-out document"]
