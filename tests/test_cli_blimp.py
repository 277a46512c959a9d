"""`lime-probe blimp` end to end: its results equal the library's; data with the wrong fields exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import read_json, run_cli, run_cli_ok, write_blimp_dir


@pytest.fixture(scope="module")
def blimp_dir(tmp_path_factory) -> Path:
    return write_blimp_dir(tmp_path_factory.mktemp("blimp"))


@pytest.mark.slow  # ~8 s under load
def test_blimp_matches_the_library(capsys, tmp_path, ckpts, blimp_dir):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.blimp import blimp_probe, load_blimp, score_minimal_pairs, scoring_sequences

    run_cli_ok(
        capsys,
        "blimp",
        "--ckpt",
        ckpts["llama"],
        "--ckpt",
        ckpts["bert"],
        "--data",
        blimp_dir,
        "--max-pairs",
        10,
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--tasks",
        "all",
        "--sites",
        "hidden",
        "--layers",
        "all",
    )
    doc = read_json(tmp_path / "o" / "blimp.json")
    data = load_blimp(blimp_dir)
    model, tok = load(ckpts["llama"])
    part = data.select(range(10))  # the first paradigm's first 10 pairs, as scored: prefix, then the sentence
    good, bad = (
        extract(model, tok, scoring_sequences(tok, part[c]), sites=["hidden"], pool="mean", pretokenized=True)
        for c in ("sentence_good", "sentence_bad")
    )
    want = blimp_probe(
        {la: good["hidden"][la] for la in good["hidden"]},
        {la: bad["hidden"][la] for la in bad["hidden"]},
        np.asarray(part["pairID"]),
        progress=False,
    )
    rows = [r for r in doc["rows"] if r["model"] == "llama" and r["paradigm"] == "agreement_a"]
    np.testing.assert_allclose([r["probe_accuracy_mean"] for r in rows], want.accuracy_mean)
    picked = data.select(list(range(10)) + list(range(12, 22)))
    scores = score_minimal_pairs(model, tok, picked, progress=False)
    assert doc["blimp"]["llama"]["minimal_pairs"]["per_paradigm"] == pytest.approx(scores.per_paradigm)
    assert "minimal_pairs" not in doc["blimp"]["bert"]  # an encoder is probed but not scored as a causal LM
    assert doc["blimp"]["bert"]["skipped_pairs"] == {"agreement_a": 0, "agreement_b": 0}
    assert {r["model"] for r in doc["rows"]} == {"llama", "bert"}


def test_blimp_with_wrong_fields_is_exit_2(capsys, tmp_path, ckpts):
    bad = tmp_path / "b"
    bad.mkdir()
    (bad / "x.jsonl").write_text(json.dumps({"good": "a", "bad": "b"}) + "\n")
    code, _, err = run_cli(
        capsys, "blimp", "--ckpt", ckpts["llama"], "--data", bad, "--tasks", "all", "--out", tmp_path / "o"
    )
    assert code == 2 and "missing field" in err and not (tmp_path / "o").exists()
