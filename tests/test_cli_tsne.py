"""`lime-probe tsne` end to end: its results equal the library's; fewer points than asked are said once."""

from __future__ import annotations

import numpy as np
from helpers import read_json, run_cli, run_cli_ok, word_features


def test_tsne_says_when_it_has_fewer_points_than_asked(capsys, tmp_path, ckpts, text_file):
    # LIMe's two value sites (values, routed_values) meet the same shortfall: said once
    argv = ["tsne", "--ckpt", ckpts["lime"], "--data", text_file, "--max-length", 32, "--no-cache"]
    code, _, err = run_cli(capsys, *argv, "--per-word", 150, "--perplexity", 2, "--out", tmp_path / "o")
    warned = [ln for ln in err.splitlines() if "points per word" in ln]
    assert code == 0 and len(warned) == 1, err
    assert warned[0].startswith("lime-probe tsne: warning: lime: ") and "not 150" in warned[0]


def test_tsne_matches_the_library(capsys, tmp_path, ckpts, text_file):
    from lime_probe.probes.separability import balance_classes
    from lime_probe.probes.tsne import tsne_layers

    run_cli_ok(
        capsys,
        "tsne",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--site",
        "hidden",
        "--layers",
        "0,2",
        "--per-word",
        6,
        "--perplexity",
        3,
        "--max-length",
        32,
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--seed",
        2,
    )
    doc = read_json(tmp_path / "o" / "tsne_hidden.json")
    feats, y = word_features(ckpts["llama"], "hidden")
    keep = balance_classes(y, seed=2, n_per_class=6)
    want = tsne_layers({la: feats[la][keep] for la in (0, 2)}, perplexity=3, seed=2, progress=False)
    for layer in (0, 2):
        rows = [r for r in doc["rows"] if r["layer"] == layer]
        np.testing.assert_allclose([[r["x"], r["y"]] for r in rows], want[layer])
        assert [r["token"] for r in rows] == [str(t) for t in y[keep]]
    assert (tmp_path / "o" / "tsne_hidden.png").exists()
