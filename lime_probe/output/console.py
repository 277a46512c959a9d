"""What a command prints: its results as a compact table, and the data's warnings as one line each."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import contextmanager


@contextmanager
def one_line_warnings(where: str):
    """Inside the block a ``lime_probe.extraction.windows.DataWarning`` (the data weakens the result) prints as one
    line, ``WHERE: warning: MESSAGE``, on stderr, each message once; other warnings as Python shows them."""
    import warnings

    from lime_probe.extraction.windows import DataWarning

    shown: set[str] = set()
    with warnings.catch_warnings():
        default = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, DataWarning):
                if str(message) not in shown:
                    shown.add(str(message))
                    print(f"{where}: warning: {message}", file=sys.stderr)
            else:
                default(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def format_table(rows: Sequence[dict], columns: Sequence[str] = ()) -> str:
    """A compact fixed-width text table of ``rows`` (floats to 4 significant digits)."""
    import numpy as np

    if not rows:
        return "(no rows)"
    cols = list(columns) or list(dict.fromkeys(k for r in rows for k in r))

    def cell(v):
        if isinstance(v, float | np.floating):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    # numbers right-aligned, text left-aligned
    numeric = [
        all(isinstance(r.get(c), int | float | np.number) or r.get(c) is None for r in rows) for c in cols
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric, strict=True))
        for row in cells
    ]
    return "\n".join(lines)
