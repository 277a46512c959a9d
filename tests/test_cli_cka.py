"""`lime-probe cka` end to end: its results equal the library's."""

from __future__ import annotations

import numpy as np
from helpers import DOCS, read_json, run_cli_ok


def test_cka_matches_the_library(capsys, tmp_path, ckpts, text_file):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.similarity import cka_matrix, effective_ranks

    run_cli_ok(
        capsys,
        "cka",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--max-length",
        32,
        "--out",
        tmp_path / "o",
        "--no-cache",
    )
    doc = read_json(tmp_path / "o" / "cka_hidden.json")
    model, tok = load(ckpts["llama"])
    acts = extract(model, tok, DOCS, sites=["hidden"], max_length=32, progress=False)
    feats = {la: acts["hidden"][la] for la in acts["hidden"]}
    np.testing.assert_allclose(doc["cka"]["llama"]["cka"], cka_matrix(feats, progress=False))
    np.testing.assert_allclose(
        [r["effective_rank"] for r in doc["rows"]], effective_ranks(feats, center=True, progress=False)
    )
