"""A self-contained HTML report: figures embedded as base64 PNG, tables, settings, versions.

The file needs nothing else to open (no scripts, no external CSS or images), so it can be
mailed or attached to a paper review as is.

    sections = [Section("Entropy", text="...", figures=[fig], tables=[Table("per layer", rows)])]
    write_report("out/report.html", "LIMe vs LLaMA", sections, meta=run_metadata(...))

An analysis's numbers meet its figures one layer up, in `lime_probe.specs.write_analysis`, which
returns the `Section` this module renders.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from lime_probe.output.plots import STYLE, style
from lime_probe.output.results import atomic_write_text, to_jsonable


@dataclass
class Table:
    """A captioned table; ``rows`` are dicts with the same keys (the columns, in first-seen order)."""

    caption: str
    rows: Sequence[Mapping]
    float_format: str = ".3f"


@dataclass
class Section:
    """One heading of the report: a paragraph, figures (Figure objects or PNG paths), tables."""

    title: str
    text: str = ""
    figures: list[Figure | str | os.PathLike] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
.sub{color:#666;margin-top:0}figure{margin:1em 0}img{max-width:100%;height:auto}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.9em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}caption{caption-side:top;text-align:left;font-weight:600;
padding:.3em 0}pre{background:#f7f7f7;padding:.8em;overflow-x:auto;font-size:.85em}
nav ul{columns:2}details{margin:.6em 0}
"""


def figure_png_base64(fig: Figure | str | os.PathLike) -> str:
    """Base64 of a PNG: a Figure rendered at the style's dpi, or the bytes of a PNG file."""
    if isinstance(fig, Figure):
        buf = io.BytesIO()
        with style():
            fig.savefig(buf, format="png", dpi=STYLE["savefig.dpi"], bbox_inches="tight")
        data = buf.getvalue()
    else:
        path = Path(fig)
        data = path.read_bytes()
        if not data.startswith(b"\x89PNG"):
            raise ValueError(f"{path} is not a PNG image")
    return base64.b64encode(data).decode("ascii")


def _cell(value, float_format: str) -> str:
    if isinstance(value, float):
        return format(value, float_format)
    return html.escape("" if value is None else str(value))


def table_html(table: Table) -> str:
    """An HTML <table> of ``table.rows`` with escaped cells and formatted floats."""
    rows = [to_jsonable(dict(r)) for r in table.rows]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(r.get(c), table.float_format)}</td>" for c in columns) + "</tr>"
        for r in rows
    )
    return (
        f"<table><caption>{html.escape(table.caption)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )


def _anchor(i: int) -> str:
    return f"s{i}"


def render_report(title: str, sections: Sequence[Section], *, meta: Mapping | None = None) -> str:
    """The report as one HTML string. ``meta`` (from ``results.run_metadata``) is shown as the
    settings, checkpoints and versions at the end."""
    parts = [
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
    ]
    if meta and meta.get("created"):
        parts.append(
            f"<p class='sub'>Generated {html.escape(str(meta['created']))} by lime-probe "
            f"{html.escape(str(meta.get('versions', {}).get('lime-probe', '')))}</p>"
        )
    parts.append(
        "<nav><ul>"
        + "".join(
            f"<li><a href='#{_anchor(i)}'>{html.escape(s.title)}</a></li>" for i, s in enumerate(sections)
        )
        + "</ul></nav>"
    )
    for i, s in enumerate(sections):
        parts.append(f"<h2 id='{_anchor(i)}'>{html.escape(s.title)}</h2>")
        if s.text:
            parts.extend(f"<p>{html.escape(p)}</p>" for p in s.text.split("\n\n"))
        for fig in s.figures:
            parts.append(
                f"<figure><img alt='{html.escape(s.title)}' "
                f"src='data:image/png;base64,{figure_png_base64(fig)}'></figure>"
            )
        parts.extend(table_html(t) for t in s.tables)
    if meta:
        parts.append("<h2>Settings, checkpoints and versions</h2>")
        for key in ("settings", "checkpoints", "versions"):
            if key in meta:
                body = html.escape(json.dumps(to_jsonable(meta[key]), indent=2), quote=False)
                parts.append(f"<details open><summary>{key}</summary><pre>{body}</pre></details>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_report(
    path: str | os.PathLike, title: str, sections: Sequence[Section], *, meta: Mapping | None = None
) -> Path:
    """Render the report and write it atomically to ``path``; return the path."""
    return atomic_write_text(path, render_report(title, sections, meta=meta))
