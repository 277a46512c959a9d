"""The report as a function: `run_report` called from a script writes the tables `lime-probe report` writes,
and `load_data` reads each kind of data as the readers below it do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CORPUS, PAIRS, save_tiny_checkpoint, write_blimp_dir

from lime_probe import cli
from lime_probe.specs import Extraction, load_checkpoints
from lime_probe.specs.blimp import BlimpParams
from lime_probe.specs.data import load_data
from lime_probe.specs.entropy import EntropyParams
from lime_probe.specs.reporting import run_report


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report-api")
    text = root / "texts.txt"
    text.write_text("\n\n".join(CORPUS * 3) + "\n")
    return {
        "lime": save_tiny_checkpoint(root / "lime", "lime"),
        "llama": save_tiny_checkpoint(root / "llama", "llama"),
        "text": text,
        "blimp": write_blimp_dir(root / "blimp"),
    }


def _tables(folder: Path) -> dict[str, object]:
    """Every result file of ``folder`` by name: a JSON's rows and extras (its header holds the time and
    the settings as given), a CSV's text."""
    tables: dict[str, object] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json":
            written = json.loads(path.read_text())
            tables[path.name] = {k: v for k, v in written.items() if k != "meta"}
        elif path.suffix == ".csv":
            tables[path.name] = path.read_text()
    return tables


@pytest.mark.slow  # ~15 s under load: three analyses, twice
def test_run_report_writes_the_tables_of_the_command(capsys, tmp_path, inputs):
    """The API and the command, given the same choices, write the same files with the same numbers."""
    out_cli, out_api = tmp_path / "cli", tmp_path / "api"
    argv = [
        "report", "--ckpt", inputs["lime"], "--ckpt", inputs["llama"], "--label", "LIMe", "--label", "LLaMA",
        "--data", inputs["text"], "--max-length", 32, "--no-cache", "--num-windows", 2,
        "--analyses", "entropy", "router", "--blimp", inputs["blimp"], "--tasks", "all", "--max-pairs", 6,
        "--threads", 1, "--out", out_cli,
    ]  # fmt: skip
    assert cli.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out

    cks = load_checkpoints([str(inputs["lime"]), str(inputs["llama"])], ["LIMe", "LLaMA"], "cpu")
    report = run_report(
        cks,
        ["entropy", "router"],
        out_api,
        data=str(inputs["text"]),
        joined={"blimp": str(inputs["blimp"])},
        params={"entropy": EntropyParams(num_windows=2), "blimp": BlimpParams(tasks="all", max_pairs=6)},
        extraction=Extraction(max_length=32),
    )

    written = _tables(out_cli)
    assert {"entropy_values.json", "router.json", "blimp.json", "blimp_table2.csv"} <= set(written)
    assert _tables(out_api) == written
    assert sorted(p.name for p in out_api.iterdir()) == sorted(p.name for p in out_cli.iterdir())
    assert list(report.results) == ["entropy", "router", "blimp"] and not report.skipped
    assert {r["model"] for r in report.results["router"].rows} == {"LIMe"}  # it applies to LIMe only
    for result in report.results.values():  # the command printed each section's title as it ran
        assert result.title in printed
    assert [s.title for s in report.sections] == [r.title for r in report.results.values()]


def test_run_report_names_what_it_cannot_run(tmp_path, inputs):
    cks = load_checkpoints([str(inputs["llama"])], None, "cpu")
    with pytest.raises(ValueError, match="not an analysis a report runs: blimp, nope"):
        run_report(cks, ["blimp", "nope"], tmp_path)
    skipped: list[tuple[str, str]] = []
    with pytest.raises(ValueError, match="every section failed: router: it applies to"):
        run_report(cks, ["router"], tmp_path, on_skip=lambda name, reason: skipped.append((name, reason)))
    assert [name for name, _ in skipped] == ["router"] and not (tmp_path / "report.html").exists()


def test_load_data_reads_each_kind_as_its_reader(tmp_path, inputs):
    """Texts as lime_model.data reads them (first N documents), BLiMP as load_blimp, pairs as load_pairs."""
    from lime_model.data import load_texts
    from lime_probe.extraction.tracing import Corpus
    from lime_probe.interventions.pairs import load_pairs
    from lime_probe.probes.blimp import load_blimp

    text = str(inputs["text"])
    assert load_data("texts", text, 4) == load_texts(text)[:4] == (CORPUS * 3)[:4]
    corpus = load_data("optional-texts", text, 5, lazy=True)
    assert isinstance(corpus, Corpus) and list(corpus) == load_texts(text)[:5]
    assert load_data("texts", None) is None and load_data("none", "anything") is None
    blimp = load_data("blimp", str(inputs["blimp"]), params=BlimpParams(paradigms=("agreement_b",)))
    assert list(blimp["sentence_good"]) == list(load_blimp(inputs["blimp"], ["agreement_b"])["sentence_good"])
    assert set(blimp["UID"]) == {"agreement_b"} and len(blimp["UID"]) == 2 * len(PAIRS)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"clean": "a b", "corrupt": "a c", "answer": " d", "wrong": " e"}) + "\n")
    assert load_data("pairs", str(pairs)) == load_pairs(pairs)
    with pytest.raises(FileNotFoundError, match="BLiMP source not found"):
        load_data("blimp", str(tmp_path / "missing"), params=BlimpParams())
