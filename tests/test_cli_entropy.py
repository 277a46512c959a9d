"""`lime-probe entropy` end to end: its results equal the library's (streamed from cache shards), and
text the tokenizer does not fit can be allowed with a one-line warning."""

from __future__ import annotations

import numpy as np
from helpers import DOCS, digits_checkpoint, read_json, run_cli


def test_entropy_matches_the_library(capsys, tmp_path, ckpts, text_file, monkeypatch):
    import importlib

    from lime_probe.extraction.activations import Activations
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.entropy import layer_entropy

    extract_mod = importlib.import_module("lime_probe.extraction.tracing")
    monkeypatch.setattr(extract_mod, "SHARD_BYTES", 1)  # a cache shard per batch: the command streams them

    def whole_layer(*a, **k):
        raise AssertionError("the entropy command must stream, not load every sequence of a layer")

    monkeypatch.setattr(Activations, "sequences", whole_layer)
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--ckpt",
        ckpts["bert"],
        "--label",
        "LLaMA",
        "--label",
        "BERT",
        "--data",
        text_file,
        "--site",
        "values",
        "--max-length",
        16,
        "--batch-size",
        4,
        "--out",
        out,
        "--cache",
        tmp_path / "cache",
        "--seed",
        3,
        "--unit",
        "documents",
    )
    assert code == 0, err
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) > 2  # several shards were streamed
    monkeypatch.undo()
    doc = read_json(out / "entropy_values.json")
    assert doc["meta"]["settings"]["site"] == "values"
    assert doc["meta"]["checkpoints"]["BERT"]["model_type"] == "bert"
    for label, arch in (("LLaMA", "llama"), ("BERT", "bert")):
        model, tok = load(ckpts[arch])
        acts = extract(
            model, tok, DOCS, sites=["values"], max_length=16, progress=False
        )  # in memory, unbatched
        rows = [r for r in doc["rows"] if r["model"] == label]
        assert [r["layer"] for r in rows] == acts.layers("values")
        for r in rows:
            seqs = acts.sequences("values", r["layer"])
            got = [r["entropy_mean"], r["entropy_std"], r["ci_low"], r["ci_high"]]
            # the library on all sequences at once, in memory; equal up to float64 round-off in the feature
            # moments (merged per shard here), which p**0.5 of the smallest Gram eigenvalues magnifies to ~1e-9
            want = layer_entropy(seqs, "lime", seed=3)
            np.testing.assert_allclose(got, [want.mean, want.std, want.ci_low, want.ci_high], rtol=1e-7)
            assert r["n_sequences"] == len(DOCS)
    assert sorted(p.name for p in out.iterdir()) == [
        f"entropy_values.{x}" for x in ("csv", "json", "pdf", "png")
    ]
    assert "LLaMA" in stdout and "entropy_mean" in stdout


def test_unknown_tokens_can_be_allowed_with_a_one_line_warning(capsys, tmp_path, text_file):
    ckpt = digits_checkpoint(tmp_path / "digits")
    argv = ["entropy", "--ckpt", ckpt, "--data", text_file, "--unit", "documents", "--no-cache"]
    code, _, err = run_cli(capsys, *argv, "--allow-unknown-tokens", "--out", tmp_path / "o")
    warned = [ln for ln in err.splitlines() if "unknown token" in ln]
    assert code == 0 and len(warned) == 1, err
    assert warned[0].startswith("lime-probe entropy: warning: ") and "of the" in warned[0]
