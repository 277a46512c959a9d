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
    added = re.findall(r"^ +(\d+)\. ", text.split("## Amendment")[1], re.M)  # A5's, numbered on
    assert listed + added == [str(i) for i in range(1, 12)] and len(secondaries) == 11
    assert "Holm over these nine" in text and "Holm over these eleven" in flat


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


def amendment_items() -> dict[int, str]:
    """The amendment's numbered secondaries (A5), each as one line of text."""
    text = (FOLDER / "PROTOCOL.md").read_text().split("## Amendment")[1]
    items = re.findall(r"^ +(\d+)\. (.+(?:\n {6}\S.*)*)", text, re.M)
    return {int(n): " ".join(item.split()) for n, item in items}


def site(endpoint) -> str:
    return endpoint.where["site"]


def test_the_declared_secondaries_are_the_protocols_nine_and_the_amendments_two_as_worded():
    secondaries = [c for c in STUDY.claims if c.role == "secondary"]
    items = amendment_items()
    assert sorted(items) == [10, 11] and len(secondaries) == 9 + len(items)
    for number, claim in zip((10, 11), secondaries[9:], strict=True):
        words = items[number]
        # "Converged probe, upper half": both sides on the converged probe's upper half
        assert "converged probe, upper half" in words.lower()
        for e in claim.endpoints:
            assert (e.name, e.part, e.value) == (
                "separability, converged probe",
                "upper half",
                "accuracy_mean",
            )
            assert STUDY.measures[e.measure].params["method"] == "logreg"
        owners = re.findall(r"(LIMe|LLaMA)'s", words)
        assert (claim.model, claim.reference) == (owners[0], owners[-1])
        assert words.endswith("two-sided.") and claim.sign is None
    mixed_null, beyond = secondaries[9:]
    # 10: LLaMA's values mixed by the same seed's LIMe routers (`router_mixed_values`) - LLaMA's `values`
    assert re.findall(r"`(\w+)`", items[10]) == [site(e) for e in mixed_null.endpoints]
    assert "the same seed's LIMe routers" in items[10] and "mixing null" in mixed_null.text
    mixing = STUDY.measures[mixed_null.endpoint.measure]
    assert mixing.params["mix_router"] == "{run:LIMe}" and mixing.models == ("LLaMA",)
    assert mixing.data == STUDY.measures["separability-converged"].data
    # 11: LIMe's `routed_values` - LLaMA's mixed values
    assert re.findall(r"`(\w+)`", items[11]) == [site(beyond.endpoint)]
    assert site(beyond.endpoints[1]) == site(mixed_null.endpoint) == "router_mixed_values"
    assert items[11].startswith("Beyond mixing") and beyond.text.startswith("beyond mixing")


def test_the_trajectory_endpoint_is_the_gaps_change_over_the_last_quarter_outside_holm(tmp_path):
    """Read from logged curves made here (training records every 10 steps, held-out loss every 1,000): the
    endpoint is, per seed, (LIMe - LLaMA at step 20,000) - (LIMe - LLaMA at step 15,000), with no Holm p
    and no verdict, printed in findings.md beside the perplexity."""
    import math
    from dataclasses import replace

    import numpy as np

    from lime_probe.studies.findings import compare, findings

    (trajectory,) = [c for c in STUDY.claims if c.role == "exploratory" and c.per is None]
    recipe = load_recipe("lime-150m")
    amendment = " ".join((FOLDER / "PROTOCOL.md").read_text().split("## Amendment")[1].split())
    assert f"gap at step {recipe.steps:,} minus gap at step {recipe.steps * 3 // 4:,}" in amendment
    assert "(exploratory, no Holm;" in amendment
    rng = np.random.default_rng(3)
    loss, measured = {}, {}
    for seed in STUDY.seeds:
        for label in STUDY.models:
            rows = []
            for step in range(10, recipe.steps + 1, 10):
                evaluated = step % recipe.eval_every == 0
                if evaluated:
                    loss[label, seed, step] = 3 + 1000 / step + rng.normal(scale=0.01)
                value = loss[label, seed, step] if evaluated else math.nan
                rows.append({"model": label, "step": float(step), "loss": 3.0, "val_loss": value})
            measured[label, seed] = {"rows": rows}
    study = replace(STUDY, claims=(STUDY.claims[0], trajectory))
    ppl = {k: {"rows": [{"model": k[0], "perplexity": 20.0 + k[1] + (k[0] == "LIMe")}]} for k in measured}
    diff = compare(study, {"curves": measured, "perplexity": ppl}, STUDY.seeds)
    row = diff[1]

    def gap(seed, step):
        return loss["LIMe", seed, step] - loss["LLaMA", seed, step]

    want = [gap(s, 20_000) - gap(s, 15_000) for s in STUDY.seeds]
    np.testing.assert_allclose(row["per_seed_diff"], want, rtol=1e-12)
    assert row["diff_mean"] == pytest.approx(np.mean(want), rel=1e-12) and row["step"] == 20_000
    assert row["verdict"] == "exploratory" and "p_holm" not in row and "q_bh" not in row
    assert diff[0]["p_holm"] == diff[0]["p_t"]  # the primary's Holm family is itself alone
    text = findings(study, diff, STUDY.seeds)
    section = text.split("## Exploratory endpoints")[1]
    assert "held-out loss (largest step) vs held-out loss (step 0.75 x the largest)" in section
    assert f"{row['diff_mean']:+.4g}" in section and "## Primary endpoints" in text.split(section)[0]
