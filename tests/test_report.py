"""The HTML report is self-contained and faithful; result files record settings and identity."""

import base64
import csv
import json
import math
import os
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from lime_probe.output import charts as C
from lime_probe.output import plots as F
from lime_probe.output.report import Section, Table, render_report, write_report
from lime_probe.output.results import (
    checkpoint_identity,
    read_metrics,
    run_metadata,
    to_jsonable,
    write_results,
)


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs, self.links, self.cells, self.scripts = [], [], [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.srcs.append(a["src"])
        if tag in ("link", "script") or (tag == "a" and not a.get("href", "").startswith("#")):
            self.links.append((tag, a))
        self._in_td = tag == "td"

    def handle_data(self, data):
        if getattr(self, "_in_td", False):
            self.cells.append(data)
            self._in_td = False


def _figure():
    return C.plot_entropy({"m": {"mean": [1.0, 2.0, 1.5]}}, site="values")


def test_report_embeds_figures_and_escapes_tables(tmp_path):
    png = F.save_figure(_figure(), tmp_path / "f")[0]
    rows = [
        {"model": "<LIMe>", "layer": 1, "entropy": 1.23456},
        {"model": "LLaMA", "layer": 1, "entropy": None},
    ]
    sections = [
        Section(
            "Entropy", text="First.\n\nSecond.", figures=[_figure(), png], tables=[Table("per layer", rows)]
        )
    ]
    meta = run_metadata("report", settings={"site": "values"}, checkpoints={})
    path = write_report(tmp_path / "r.html", "A & B", sections, meta=meta)
    text = path.read_text()
    p = _Collect()
    p.feed(text)
    assert p.links == []  # nothing external: no scripts, stylesheets or outside links
    assert len(p.srcs) == 2 and all(s.startswith("data:image/png;base64,") for s in p.srcs)
    # the file-based figure is embedded byte for byte
    assert base64.b64decode(p.srcs[1].split(",", 1)[1]) == png.read_bytes()
    assert base64.b64decode(p.srcs[0].split(",", 1)[1]).startswith(b"\x89PNG")
    assert p.cells == ["<LIMe>", "1", "1.235", "LLaMA", "1"]
    assert "&lt;LIMe&gt;" in text and "<title>A &amp; B</title>" in text
    assert text.count("<p>") >= 2 and '"site": "values"' in text
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []


def test_report_rejects_a_non_png_figure_file(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_text("not an image")
    with pytest.raises(ValueError, match="not a PNG"):
        render_report("t", [Section("s", figures=[bad])])


def test_write_results_json_and_csv_round_trip(tmp_path):
    rows = [
        {"model": "a", "layer": 0, "value": np.float32(0.5)},
        {"model": "b", "layer": 1, "value": float("nan"), "extra": "x"},
    ]
    meta = run_metadata(
        "entropy", settings={"alpha": 0.5, "layers": (0, 1)}, checkpoints={"a": str(tmp_path)}
    )
    jp, cp = write_results(tmp_path / "out" / "entropy", rows, meta=meta, extra={"matrix": torch.eye(2)})
    doc = json.loads(jp.read_text())
    assert doc["rows"][0]["value"] == 0.5 and doc["rows"][1]["value"] is None
    assert doc["matrix"] == [[1.0, 0.0], [0.0, 1.0]]
    assert doc["meta"]["settings"] == {"alpha": 0.5, "layers": [0, 1]}
    assert doc["meta"]["versions"]["torch"] == torch.__version__
    assert doc["meta"]["checkpoints"]["a"]["path"] == str(tmp_path.resolve())
    with cp.open() as fh:
        table = list(csv.DictReader(fh))
    assert table == [
        {"model": "a", "layer": "0", "value": "0.5", "extra": ""},
        {"model": "b", "layer": "1", "value": "", "extra": "x"},
    ]


def test_checkpoint_identity_changes_with_weights(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "lime", "routing": "full"}))
    save_file({"w": torch.zeros(3)}, tmp_path / "model.safetensors")
    a = checkpoint_identity(tmp_path)
    assert (
        a["model_type"] == "lime"
        and a["routing"] == "full"
        and re.fullmatch("[0-9a-f]{16}", a["fingerprint"])
    )
    assert checkpoint_identity(tmp_path) == a
    st = (tmp_path / "model.safetensors").stat()
    assert a["weights"] == [["model.safetensors", st.st_size, st.st_mtime_ns]]
    os.utime(
        tmp_path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9)
    )  # rewritten, same bytes
    touched = checkpoint_identity(tmp_path)
    assert (
        touched["fingerprint"] == a["fingerprint"] and touched != a
    )  # the cache key changes, the content id not
    save_file({"w": torch.ones(3)}, tmp_path / "model.safetensors")
    assert checkpoint_identity(tmp_path)["fingerprint"] != a["fingerprint"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "lime", "routing": "average"}))
    assert checkpoint_identity(tmp_path)["routing"] == "average"
    assert checkpoint_identity("org/model") == {"id": "org/model", "source": "hub"}
    assert checkpoint_identity("org/model", revision="abc") == {
        "id": "org/model",
        "source": "hub",
        "revision": "abc",
    }


def test_to_jsonable_handles_numpy_torch_and_nonfinite():
    out = to_jsonable({1: np.arange(2), "t": torch.tensor([1.5, math.inf]), "s": np.int64(3)})
    assert out == {"1": [0, 1], "t": [1.5, None], "s": 3}


def test_read_metrics_columns(tmp_path):
    lines = [{"step": s, "tokens": 10 * s, "flops": 1e6 * s, "loss": 3.0 / s, "lr": 1e-3} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    cols = read_metrics(tmp_path)
    np.testing.assert_allclose(cols["loss"], [3.0, 1.5, 1.0])
    np.testing.assert_allclose(cols["tokens"], [10, 20, 30])


def test_read_metrics_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no training metrics"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="no training records"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=":1: not a JSON line"):
        read_metrics(tmp_path)
