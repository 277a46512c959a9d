"""docs/fidelity.md's labels: every "official" label names the official code's file (and the snapshot where
the file is not in the current tree), and the per-study k/v-init table says what the study declarations
train."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lime_model.config import LimeConfig
from lime_model.recipes import load_recipe
from lime_probe.protocol import protocol_rows
from lime_probe.studies.catalog import STUDIES

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "fidelity.md").read_text(encoding="utf-8")
SNAPSHOT = "601cd30"
# github.com/corl-team/lime: the files of the current tree, and those only the older snapshot holds
CURRENT = {
    "README.md", "__init__.py", "config.py", "configs/config_base.yaml", "meters.py", "requirements.txt",
    "setup.py", "src/analysis/classification.py", "src/analysis/entropy.py", "src/analysis/representations.py",
    "src/analysis/value_wrapper.py", "src/datasets/prepare_fineweb.py", "src/datasets/preprocessing_fineweb.py",
    "src/lm/hc.py", "src/lm/lime.py", "src/utils/flops_counter.py", "train.py", "train_utils.py",
}  # fmt: skip
SNAPSHOT_ONLY = {
    "configs/config_deep.yaml",
    "src/analysis/dynamic_router_interpret.py",
    "src/analysis/utils.py",
    "src/analysis/values_gathering_wrapper.py",
}
# a path as the official code's: under src/ or configs/, or one of its top-level files
OFFICIAL_PATH = re.compile(
    r"(?<![\w/.])((?:src|configs)/[\w/]+\.\w+|config\.py|train\.py|train_utils\.py|meters\.py|README\.md)"
)


def table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row of `text` (header and separator rows left out)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if cells[:2] not in (["area", "setting"], ["study", "models and their k/v init"]):
                rows.append(cells)
    return rows


def official_clauses(text: str) -> list[str]:
    """The clauses of `text` (split at "; ") that call something official."""
    return [c for c in text.split("; ") if "official" in c.lower()]


def check_names_files(clause: str, where: str) -> None:
    files = OFFICIAL_PATH.findall(clause)
    assert files, f"{where}: an official label names no file: {clause!r}"
    for f in files:
        assert f in CURRENT | SNAPSHOT_ONLY, f"{where}: {f!r} is not a file of the official code"
        if f in SNAPSHOT_ONLY:
            assert SNAPSHOT in clause, f"{where}: {f!r} is only in snapshot {SNAPSHOT}: say so"


def test_every_official_label_in_the_doc_names_its_file():
    rows = [r for r in table_rows(DOC) if len(r) == 4]
    assert len(rows) > 40  # the hand-written rows and the generated probe rows
    checked = 0
    for area, setting, _, source in rows:
        for clause in official_clauses(source):
            check_names_files(clause, f"docs/fidelity.md {area} {setting}")
            checked += 1
    assert checked > 20


def test_every_official_protocol_setting_names_its_file():
    for r in protocol_rows():
        where = f"protocol {r['analysis']} {r['setting']}"
        if r["source"] == "official code":
            check_names_files(r["where"], where)
        for clause in official_clauses(r["note"]):
            check_names_files(f"{clause} {r['where']}", where)


@pytest.mark.parametrize(
    "clause",
    [
        "official code",
        "official code (`configs/config_deep.yaml`)",
        "official code (`src/lm/limes.py`)",
    ],
)
def test_the_check_refuses_a_label_without_its_file_or_snapshot(clause):
    with pytest.raises(AssertionError):
        check_names_files(clause, "example")


def test_the_check_accepts_a_named_file():
    check_names_files("official code (`configs/config_deep.yaml` at snapshot `601cd30`)", "example")
    check_names_files("official code (`train_utils.py`, `configure_optimizers`)", "example")


def kv_inits(study) -> dict[str, tuple[str, bool]]:
    """{model: (k/v init its run trains with, "torch" or "normal"; whether the declaration states it)}."""
    out = {}
    for label, overrides in study.models.items():
        recipe = load_recipe(study.recipe, {"data": "unused.txt", **study.overrides, **overrides})
        init = recipe.model.get("kv_proj_init", "auto")
        torch_init = LimeConfig(routing=recipe.routing, kv_proj_init=init).kv_proj_torch_init
        stated = "model.kv_proj_init" in overrides or "model.kv_proj_init" in study.overrides
        out[label] = ("torch" if torch_init else "normal", stated)
    return out


def test_the_kv_init_table_says_what_each_study_trains():
    section = DOC.split("## Which k/v init each study's models use", 1)[1].split("\n## ", 1)[0]
    rows = {r[0].strip("`"): r[1:] for r in table_rows(section)}
    assert set(rows) == set(STUDIES), "one row per study"
    for name, (cell, stated_cell) in rows.items():
        actual = kv_inits(STUDIES[name])
        said: dict[str, str] = {}
        for item in cell.split(", "):
            models, init = item.rsplit(" ", 1)
            if models.startswith("every ") and models.endswith("*"):
                prefix = models.removeprefix("every ").removesuffix("*")
                matched = [m for m in actual if m.startswith(prefix)]
                assert matched, (name, item)
                said |= {m: init for m in matched if m not in said}
            else:
                said[models] = init
        assert said == {m: init for m, (init, _) in actual.items()}, name
        stated = {m for m, (_, s) in actual.items() if s}
        want = {"no": set(), "all": set(actual)}.get(stated_cell, set(stated_cell.split(", ")))
        assert stated == want, (name, stated_cell)
