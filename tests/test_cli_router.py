"""`lime-probe router` end to end: its results equal the library's; a model without routers exits 2."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import read_json, run_cli, run_cli_ok


@pytest.mark.slow  # ~7 s under load
def test_router_matches_the_library_and_rejects_llama(capsys, tmp_path, ckpts):
    from lime_probe.extraction.loading import load
    from lime_probe.probes.router_weights import router_weights

    run_cli_ok(capsys, "router", "--ckpt", ckpts["lime"], "--label", "LIMe", "--out", tmp_path / "o")
    doc = read_json(tmp_path / "o" / "router.json")
    want = router_weights(load(ckpts["lime"])[0])
    got = np.array(doc["routers"]["LIMe"]["per_layer"], dtype=float)  # None (NaN) above the diagonal
    np.testing.assert_allclose(got, want.per_layer)
    assert {(r["layer"], r["source_layer"]) for r in doc["rows"]} == {
        (i, j) for i, s in enumerate(want.sources) for j in s
    }
    code, _, err = run_cli(capsys, "router", "--ckpt", ckpts["llama"], "--out", tmp_path / "o2")
    assert code == 2 and "has no LIMe routers" in err
