"""`lime-probe separability` end to end: its results equal the library's; words too rare in the
data are named with their counts."""

from __future__ import annotations

import numpy as np
from helpers import read_json, run_cli, run_cli_ok, word_features

from lime_probe.extraction.sites import DEFAULT_WORDS


def test_separability_matches_the_library(capsys, tmp_path, ckpts, text_file):
    from lime_probe.probes.separability import token_separability

    run_cli_ok(
        capsys,
        "separability",
        "--ckpt",
        ckpts["lime"],
        "--ckpt",
        ckpts["bert"],
        "--data",
        text_file,
        "--site",
        "values",
        "--max-length",
        32,
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--seed",
        1,
        "--allow-small-samples",
    )
    doc = read_json(tmp_path / "o" / "separability_values.json")
    for label in ("lime", "bert"):
        want = token_separability(
            *word_features(ckpts[label], "values"), seed=1, classes=DEFAULT_WORDS, progress=False
        )
        rows = [r for r in doc["rows"] if r["model"] == label]
        assert [r["layer"] for r in rows] == want.layers
        np.testing.assert_allclose([r["accuracy_mean"] for r in rows], want.accuracy_mean)
        np.testing.assert_allclose([r["accuracy_std"] for r in rows], want.accuracy_std)
        assert rows[0]["majority_baseline"] == want.majority_baseline


def test_missing_words_are_named(capsys, tmp_path, ckpts, text_file):
    # the first two documents hold " is" once and " the" four times: both are named with their counts
    code, _, err = run_cli(
        capsys,
        "separability",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--words",
        " is",
        " the",
        "--max-sequences",
        2,
        "--out",
        tmp_path / "o",
        "--no-cache",
    )
    assert code == 2 and "too rare in the data" in err and "' is': 1, ' the': 4" in err
    code, _, err = run_cli(
        capsys,
        "separability",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--words",
        " is",
        " garden",
        "--out",
        tmp_path / "o",
        "--no-cache",
    )
    # ' garden' is 5 tokens: found as a whole word, it occurs 3 times
    assert code == 2 and "' garden': 3" in err and not (tmp_path / "o").exists()
