"""The protocol table states the defaults the functions really use, quotes the paper verbatim, generates the
probe rows of docs/fidelity.md, and stays cheap to import."""

import inspect
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from sklearn.linear_model import LogisticRegression

from lime_probe.extraction import windows
from lime_probe.probes import blimp, entropy, separability, tsne
from lime_probe.protocol import PROTOCOL, SOURCES, defaults, markdown_table, protocol_rows
from lime_probe.specs import ANALYSES

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- generated from lime_probe.protocol: begin -->"
END = "<!-- generated from lime_probe.protocol: end -->"


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
    bl = defaults("blimp")
    for name in ("n_splits", "method", "C", "max_iter", "seed"):
        assert bl[name] == default_of(blimp.blimp_probe, name), name
    assert bl["solver"] == LogisticRegression().solver  # fit_logreg leaves sklearn's solver
    assert (
        bl["spread"]
        == default_of(blimp.blimp_table, "spread")
        == default_of(blimp.blimp_layer_table, "spread")
    )
    assert defaults("tsne")["per_word"] == default_of(ANALYSES["tsne"].params, "per_word")
    ent = defaults("entropy")
    assert ent["preset"] in entropy.PRESETS
    assert ent["max_normalize"] is entropy.EntropyConfig().max_normalize
    assert ent["window"] == default_of(windows.default_window, "preferred")
    assert {s["site"] for a, s in ((a, defaults(a)) for a in ("entropy", "separability", "tsne"))} == {
        "values"
    }
    # the analyses' own defaults: the value site None means values (+ routed values where a model routes)
    for name in ("entropy", "separability", "tsne", "blimp"):
        params = {f.name: f.default for f in fields(ANALYSES[name].params)}
        assert params.get("site", params.get("sites")) is None
        for setting in ("method", "max_pairs", "tasks", "subtoken", "perplexity", "l2_normalize", "spread"):
            if setting in params and setting in defaults(name):
                assert params[setting] == defaults(name)[setting], (name, setting)
    assert defaults("blimp")["max_pairs"] is None  # App. D: every pair


def test_rows_and_sources():
    rows = protocol_rows()
    assert len(rows) == sum(len(v) for v in PROTOCOL.values())
    assert {r["source"] for r in rows} <= set(SOURCES)
    by = {(r["analysis"], r["setting"]): r for r in rows}
    assert by["separability", "method"]["source"] == "official code"  # Sec. 5.3 names no classifier
    assert by["separability", "method"]["default"] == "adam-linear"
    # Sec. 5.3: "train a binary logistic-regression probe", "splitting by minimal pair"
    assert (by["blimp", "method"]["source"], by["blimp", "method"]["default"]) == ("paper", "logreg")
    assert by["blimp", "groups"]["source"] == "paper"
    with pytest.raises(ValueError, match="unknown analysis 'nope'"):
        defaults("nope")


def test_paper_and_reading_settings_say_where_and_quote():
    for r in protocol_rows():
        if r["source"] in ("paper", "reading"):
            assert r["where"] and r["quote"], (r["analysis"], r["setting"])
            if r["source"] == "reading":
                assert len(r["quote"]) >= 2 and r["note"], (r["analysis"], r["setting"])
        else:
            assert not r["quote"], (r["analysis"], r["setting"])


@pytest.fixture(scope="module")
def paper_text() -> str:
    path = os.environ.get("LIME_PROBE_PAPER")
    if not path or not Path(path).is_file():
        pytest.skip("the paper's text is not available: set LIME_PROBE_PAPER to lime-paper.txt")
    return " ".join(Path(path).read_text(encoding="utf-8").split())


def test_every_quote_is_in_the_paper(paper_text):
    for r in protocol_rows():
        for q in r["quote"]:
            assert " ".join(q.split()) in paper_text, (r["analysis"], r["setting"], q)


def test_docs_fidelity_probe_rows_are_generated_from_the_protocol():
    """To regenerate: python -c "from lime_probe.protocol import markdown_table; print(markdown_table())" and
    paste the output between the two marker lines of docs/fidelity.md."""
    doc = (ROOT / "docs" / "fidelity.md").read_text(encoding="utf-8")
    block = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), doc, re.S)
    assert block, f"docs/fidelity.md lacks the lines {BEGIN!r} ... {END!r}"
    assert block.group(1) == markdown_table(), (
        "docs/fidelity.md's probe rows differ from lime_probe.protocol; regenerate them with "
        '`python -c "from lime_probe.protocol import markdown_table; print(markdown_table())"`'
    )
    assert not any("could not be" in str(r) or "offline" in str(r) for r in protocol_rows())


def test_import_is_light():
    code = (
        "import sys, lime_probe.protocol; print(any(m in sys.modules for m in ('torch', 'numpy', 'sklearn')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


STALE = re.compile(
    r"could not be (re-?)?(read|checked)|(read|checked) offline|paper('s text)? (is|was) not available"
)


def test_nothing_says_the_paper_could_not_be_read():
    """The paper's text is read and quoted now: no document or help text says it could not be read or checked
    (pre-registered protocol text keeps its words where the same line marks them as annotated later)."""
    paths = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").rglob("*.md")]
    paths += [*(ROOT / "figures").rglob("*.md"), *(ROOT / "lime_model").rglob("*.py")]
    paths += [*(ROOT / "lime_model").rglob("*.json"), *(ROOT / "lime_probe").rglob("*.py")]
    stale = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in paths
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if STALE.search(line) and "[added later" not in line
    ]
    assert stale == []
