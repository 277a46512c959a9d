"""The protocol table states the defaults the functions really use, and stays cheap to import."""

import inspect
import subprocess
import sys

import pytest

from lime_probe import blimp, entropy, separability, tsne, windows
from lime_probe.protocol import PROTOCOL, defaults, protocol_rows


def default_of(func, name):
    return inspect.signature(func).parameters[name].default


def test_defaults_match_the_functions():
    assert defaults("tsne")["l2_normalize"] is default_of(tsne.tsne_embed, "l2_normalize")
    assert defaults("tsne")["perplexity"] == default_of(tsne.tsne_embed, "perplexity")
    sep = defaults("separability")
    assert sep["method"] == default_of(separability.token_separability, "method")
    assert sep["n_splits"] == default_of(separability.token_separability, "n_splits")
    assert sep["balance"] is default_of(separability.token_separability, "balance")
    assert sep["subtoken"] == default_of(separability.pool_spans, "subtoken")
    assert defaults("blimp")["n_splits"] == default_of(blimp.blimp_probe, "n_splits")
    assert defaults("blimp")["method"] == default_of(blimp.blimp_probe, "method")
    ent = defaults("entropy")
    assert ent["preset"] in entropy.PRESETS
    assert ent["max_normalize"] is entropy.EntropyConfig().max_normalize
    assert ent["window"] == default_of(windows.default_window, "preferred")
    assert {s["site"] for a, s in ((a, defaults(a)) for a in ("entropy", "separability", "tsne"))} == {
        "values"
    }


def test_rows_and_sources():
    rows = protocol_rows()
    assert len(rows) == sum(len(v) for v in PROTOCOL.values())
    assert {r["source"] for r in rows} <= {"paper", "official code", "ours"}
    assert all(
        r["source"] != "paper" for r in rows if r["setting"] == "method"
    )  # the paper names no classifier
    with pytest.raises(ValueError, match="unknown analysis 'nope'"):
        defaults("nope")


def test_import_is_light():
    code = (
        "import sys, lime_probe.protocol; print(any(m in sys.modules for m in ('torch', 'numpy', 'sklearn')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
