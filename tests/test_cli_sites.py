"""`--site` through a command (`lime-probe entropy`): an unknown or malformed site and a site the model
lacks exit 2 in one line; a ``module:`` site measures that module's rows."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DOCS, read_json, run_cli

from lime_probe import cli


def test_unknown_site_is_a_usage_error(capsys, ckpts, text_file, tmp_path):
    code, _, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--site",
        "attn",
        "--out",
        tmp_path / "o",
    )
    assert code == 2 and err.count("\n") == 1 and "unknown site 'attn'; sites are hidden" in err
    assert "attn_pattern" in err and "module:PATH" in err


@pytest.mark.parametrize(
    ("site", "message", "loads"),
    [
        ("module:layers.{i}.mlp:inputs", "malformed site 'module:layers.{i}.mlp:inputs': write module:PATH", False),
        ("module:layers.{i}.mlp.dwn_proj", "names no module of LlamaForCausalLM; nearest: layers.{i}.mlp.down_proj", True),
    ],
)  # fmt: skip
def test_a_bad_module_site_is_exit_2_in_one_line(
    capsys, ckpts, text_file, tmp_path, monkeypatch, site, message, loads
):
    """Its syntax is checked before torch loads (as any --site), the module it names once the model is loaded."""
    if not loads:
        monkeypatch.setattr(cli, "configure_threads", lambda *a: pytest.fail("torch was reached"))
    code, _, err = run_cli(capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--site", site,
                           "--out", tmp_path / "o", "--no-cache", "--num-windows", 2)  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_module_site_runs_through_a_command(capsys, ckpts, text_file, tmp_path):
    """``--site module:...`` measures that module's rows: per document, the entropy of the MLP's inner
    activations equals the library's on an extraction of the same documents; the result's files take the
    site's name in a file-name-safe form."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.entropy import layer_entropy

    site = "module:layers.{i}.mlp.down_proj:input"
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--site", site,
                           "--max-length", 16, "--out", out, "--no-cache", "--seed", 3, "--unit", "documents")  # fmt: skip
    assert code == 0, err
    rows = read_json(out / "entropy_module_layers__i__mlp_down_proj_input.json")["rows"]
    assert [r["layer"] for r in rows] == [0, 1] and {r["site"] for r in rows} == {site}
    model, tok = load(ckpts["llama"])
    acts = extract(model, tok, DOCS, sites=site, max_length=16, progress=False)
    for r in rows:
        seqs = acts.sequences(site, r["layer"])
        assert seqs[0].shape[1] == 64  # the MLP's inner width
        want = layer_entropy(seqs, "lime", seed=3)
        np.testing.assert_allclose([r["entropy_mean"], r["ci_low"]], [want.mean, want.ci_low], rtol=1e-7)


def test_a_site_the_model_lacks_is_exit_2(capsys, ckpts, text_file, tmp_path):
    code, _, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--site",
        "routed_values",
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--num-windows",
        2,
    )
    assert code == 2 and "routed_values" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
