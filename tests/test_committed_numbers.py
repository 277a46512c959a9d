"""Every number the committed studies quote, recomputed from their per-run tables by code written here
from the formulas (plain loops, scipy), not by the runner: each row of differences.csv / reanalysis.csv,
then every table row of findings.md / reanalysis.md and every interval and table row of the studies'
READMEs and docs/results.md, read back at the precision it is printed. A mutated number, p, MDE or verdict
fails here.

Endpoints are read from their labels as the tables print them ("value entropy (values; mean over
layers)", "separability (values; upper half)", ...); a label this file does not know fails loudly."""

import csv
import functools
import math
import re
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"
# the interactions' sides: Effect name -> (model, reference)
EFFECTS = {
    "routing at torch init": ("LIMe", "LLaMA-torch-kv-init"),
    "routing at LLaMA init": ("LIMe-LLaMA-kv-init", "LLaMA"),
    "routing at PyTorch's init": ("LIMe", "LLaMA-torch-kv-init"),  # lm-cpu-fair's names
    "routing at LLaMA's init": ("LIMe-LLaMA-kv-init", "LLaMA"),
    "routing at 1,000 steps": ("LIMe-LLaMA-kv-init-1k", "LLaMA-1k"),  # arithmetic-dose-response's
    "routing at 4,000 steps": ("LIMe-LLaMA-kv-init-4k", "LLaMA-4k"),
}
# (folder, tables holding the recomputed rows, the markdown files whose tables quote them)
STUDIES = {
    "lm-cpu-10-seeds": (("differences.csv", "reanalysis.csv"), ("findings.md", "reanalysis.md", "README.md")),
    "arithmetic-kv-init": (("reanalysis.csv",), ("reanalysis.md", "README.md")),
    "lm-cpu-fair": (("differences.csv",), ("findings.md", "README.md")),
    "arithmetic-dose-response": (("differences.csv",), ("findings.md", "README.md")),
    "arithmetic-dose-response/interim-4-seeds": (("differences.csv",), ("findings.md",)),
    "upcycling": (("differences.csv",), ("findings.md", "README.md")),
    "lm-cpu-fair-interior": (("differences.csv",), ("findings.md", "README.md")),
}


@functools.cache
def table(folder: str, name: str) -> tuple[dict, ...]:
    with open(FIGURES / folder / name) as f:
        return tuple(csv.DictReader(f))


@functools.cache
def runs(folder: str, name: str) -> dict[tuple[str, int, str], list[dict]]:
    """The per-run table's rows by (model, seed, site); a table without sites is all "values"."""
    out: dict = {}
    for r in table(folder, name):
        out.setdefault((r["model"], int(r["seed"]), r.get("site", "values")), []).append(r)
    return out


# --------------------------------------------------------------------------- endpoints per run


@functools.cache
def seeds_of(folder: str) -> list[int]:
    """The seeds the study's results hold (all of them, or an interim's complete ones)."""
    name = "perplexity.csv" if (FIGURES / folder / "perplexity.csv").is_file() else "accuracy.csv"
    return sorted({int(r["seed"]) for r in table(folder, name)})


def per_run(folder: str, label: str, model: str, layer: str) -> np.ndarray:
    """One value per seed (in seed order) of the endpoint printed as ``label`` for ``model`` (at ``layer`` when
    given), from the folder's per-run tables."""
    if model in EFFECTS:
        a, b = EFFECTS[model]
        return per_run(folder, label, a, layer) - per_run(folder, label, b, layer)
    m = re.fullmatch(
        r"(value entropy|separability, converged probe|separability|value norm|BLiMP probe \(Table 2\)"
        r"|accuracy|perplexity)(?: \((.*)\))?",
        label,
    )
    assert m, f"unknown endpoint label {label!r}"
    name, args = m.group(1), (m.group(2) or "").split("; ")
    sites = ("values", "routed_values", "hidden", "router_mixed_values")
    site = args[0] if args[0] in sites else None
    seeds = seeds_of(folder)
    if name == "perplexity":
        rows = {
            int(r["seed"]): float(r["perplexity"])
            for r in table(folder, "perplexity.csv")
            if r["model"] == model
        }
        return np.array([rows[s] for s in seeds])
    if name == "accuracy":  # a fraction; "largest n_operators" is the hardest tier in the table
        rows = [r for r in table(folder, "accuracy.csv") if r["model"] == model]
        tiers = [int(r.get("operators") or r["n_operators"]) for r in rows]  # the column's older name first
        tier = max(tiers) if args[0] == "largest n_operators" else int(args[0])
        by_seed = {
            int(r["seed"]): float(r["accuracy"]) for r, t in zip(rows, tiers, strict=True) if t == tier
        }
        return np.array([by_seed[s] for s in seeds])
    csv_name, column = {
        "value entropy": ("entropy.csv", "entropy_mean"),
        "separability": ("separability.csv", "accuracy_mean"),
        "separability, converged probe": ("separability-converged.csv", "accuracy_mean"),
        "value norm": ("separability-converged.csv", "feature_norm"),
        "BLiMP probe (Table 2)": ("blimp.csv", "probe_accuracy_mean"),
    }[name]
    if site == "router_mixed_values":  # the mixing null is its own measure
        csv_name = "entropy-mixed.csv"
    out = []
    for s in seeds:
        rows = runs(folder, csv_name)[model, s, site]
        by_layer: dict[int, list[float]] = {}
        for r in rows:
            if name == "BLiMP probe (Table 2)":  # each paradigm's mean over layers, then over paradigms
                by_layer.setdefault(r["paradigm"], []).append(float(r[column]))
            else:
                by_layer.setdefault(int(r["layer"]), []).append(float(r[column]))
        if layer:
            out.append(by_layer[int(layer)][0])
            continue
        keys = sorted(by_layer)
        if "upper half" in args:
            keys = keys[len(keys) // 2 :]
        out.append(np.mean([np.mean(by_layer[k]) for k in keys]))
    return np.array(out)


# --------------------------------------------------------------------------- statistics, from the formulas


def mde(n: int, sd: float) -> float:
    """The difference a two-sided 5 % paired t-test at n detects with 80 % power (bisection)."""
    df, crit = n - 1, sps.t.ppf(0.975, n - 1)
    low, high = 0.0, 50.0
    for _ in range(60):  # 50 / 2^60: far below the printed digits
        mid = (low + high) / 2
        nc = mid * math.sqrt(n)
        power = sps.nct.sf(crit, df, nc) + np.nan_to_num(sps.nct.cdf(-crit, df, nc))
        low, high = (mid, high) if power < 0.8 else (low, mid)
    return (low + high) / 2 * sd


def sign_flip(d: np.ndarray) -> float:
    signs = np.array(list(product((1, -1), repeat=len(d))))  # every pattern, (2^n, n)
    return float(np.mean(np.abs(signs @ d / len(d)) >= abs(d.mean()) - 1e-12))


def holm(ps: list[float]) -> list[float]:
    order, out, running = sorted(range(len(ps)), key=lambda i: ps[i]), [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def bh(ps: list[float]) -> list[float]:
    order, out, running = sorted(range(len(ps)), key=lambda i: -ps[i]), [0.0] * len(ps), 1.0
    for rank, i in enumerate(order):
        running = min(running, ps[i] * len(ps) / (len(ps) - rank))
        out[i] = running
    return out


def verdict(role: str, sign: str, low: float, high: float) -> str:
    if role == "exploratory":  # no verdict per layer
        return "exploratory"
    if low > 0 or high < 0:
        up = low > 0
        if sign in ("", "None"):
            return "higher" if up else "lower"
        return "holds" if up == (float(sign) > 0) else "reversed"
    return "not resolved"


def recompute(folder: str, name: str) -> list[dict]:
    """Each committed row of ``name`` recomputed: means, interval, p's, MDE, verdict, Holm / BH."""
    out = []
    for r in table(folder, name):
        model_label, ref_label = (r["endpoint"].split(" vs ") + [r["endpoint"]])[:2]
        a = per_run(folder, model_label, r["model"], r.get("layer", ""))
        b = per_run(folder, ref_label, r["reference"], r.get("layer", ""))
        d = a - b
        n, sd = len(d), d.std(ddof=1)
        half = sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
        out.append(
            {
                "row": r,
                "model_mean": a.mean(),
                "reference_mean": b.mean(),
                "diff_mean": d.mean(),
                "ci_low": d.mean() - half,
                "ci_high": d.mean() + half,
                # all differences zero (both at a ceiling): no evidence, p = 1 (the formula's 0 / 0)
                "p_t": 1.0 if sd == 0 and d.mean() == 0 else sps.ttest_1samp(d, 0.0).pvalue,
                "p_sign_flip": sign_flip(d),
                "mde": mde(n, sd),
                "verdict": verdict(r["role"], r["sign"], d.mean() - half, d.mean() + half),
            }
        )
    families: dict[tuple, list[dict]] = {}  # Holm over each role; over the layers of each exploratory family
    for x in out:
        r = x["row"]
        key = (
            (r["role"],)
            if r["role"] != "exploratory"
            else (r["role"], r["endpoint"], r["model"], r["reference"])
        )
        families.setdefault(key, []).append(x)
    for key, xs in families.items():
        for x, ph in zip(xs, holm([x["p_t"] for x in xs]), strict=True):
            x["p_holm"] = ph
        if key[0] == "exploratory":
            for x, q in zip(xs, bh([x["p_t"] for x in xs]), strict=True):
                x["q_bh"] = q
    return out


@pytest.fixture(
    scope="module", params=[(f, t) for f, (tables, _) in STUDIES.items() for t in tables], ids=str
)
def rows(request):
    folder, name = request.param
    return folder, name, recompute(folder, name)


def test_every_committed_row_is_recomputed_from_the_per_run_tables(rows):
    folder, name, recomputed = rows
    assert recomputed, f"{folder}/{name} is empty"
    for x in recomputed:
        r = x["row"]
        where = (folder, name, r["endpoint"], r["model"], r["reference"], r.get("layer"))
        for key in ("model_mean", "reference_mean", "diff_mean", "ci_low", "ci_high", "p_t", "p_sign_flip"):
            assert float(r[key]) == pytest.approx(x[key], rel=1e-9, abs=1e-12), (*where, key)
        assert float(r["mde"]) == pytest.approx(x["mde"], rel=1e-6), (*where, "mde")
        assert r["verdict"] == x["verdict"], where
        # an older table adjusted the primaries only: its empty Holm cells are older, not wrong
        if r["p_holm"] or name == "reanalysis.csv":
            assert float(r["p_holm"]) == pytest.approx(x["p_holm"], rel=1e-9), (*where, "p_holm")
        if r.get("q_bh"):
            assert float(r["q_bh"]) == pytest.approx(x["q_bh"], rel=1e-9), (*where, "q_bh")


# --------------------------------------------------------------------------- what the text quotes

NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?"
INTERVAL = re.compile(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]")


def printed(token: str, value: float, scale: float = 1.0) -> bool:
    """Whether ``token`` is ``value`` (x ``scale``) printed at the precision the token shows; "<0.001"
    stands for any value below 0.001."""
    token = token.strip().strip("*")
    if token.startswith("<"):
        return value * scale < float(token[1:])
    digits = token.split("e")[0]
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    exponent = int(token.split("e")[1]) if "e" in token else 0
    return abs(float(token) - value * scale) <= 0.5 * 10 ** (exponent - decimals) * (1 + 1e-9) + 1e-12


@functools.cache
def quoted_rows(folder: str) -> list[dict]:
    """Every recomputed row of the study, once (the re-analysis where it exists, with every Holm)."""
    tables, _ = STUDIES[folder]
    return recompute(folder, tables[-1])


def scale(x: dict) -> float:
    """How the text prints the row's values: accuracy in points (x 100), the rest as they are."""
    return float(x["row"].get("scale") or 1.0)


def find_row(folders: list[str], mean: str, low: str, high: str) -> dict:
    """The recomputed row (of any of ``folders``) whose difference and interval print as these, in the
    units the study prints (accuracy in points)."""
    hits = [
        x
        for folder in folders
        for x in quoted_rows(folder)
        if all(
            printed(t, x[k], scale(x)) for t, k in ((mean, "diff_mean"), (low, "ci_low"), (high, "ci_high"))
        )
    ]
    assert hits, f"{folders}: no recomputed row prints as {mean} [{low}, {high}]"
    return hits[0]


def blocks(text: str) -> list[str]:
    """Each table row alone; prose joined per paragraph or bullet, so an interval wrapped over two lines
    reads whole."""
    out, current = [], []
    for line in text.splitlines():
        starts = line.startswith("|") or not line.strip() or line.lstrip().startswith(("- ", "#"))
        if starts and current:
            out.append(" ".join(current))
            current = []
        if line.startswith("|"):
            out.append(line)
        elif line.strip():
            current.append(line.strip())
    return out + ([" ".join(current)] if current else [])


def markdown_files():
    for folder, (_, files) in STUDIES.items():
        for name in files:
            yield folder, FIGURES / folder / name
    yield (
        None,
        ROOT / "docs" / "results.md",
    )  # its blocks that link a study, read against the studies they link


@pytest.mark.parametrize(("folder", "path"), list(markdown_files()), ids=lambda x: str(x).rsplit("/", 2)[-1])
def test_every_quoted_interval_and_its_row_match_a_recomputed_row(folder, path):
    """Each interval in the text is a recomputed row's; in a table row, every other number in it is one
    of that row's (the two means, p's, Holm, MDE) and the verdict is the row's; in prose, a "(p X,
    Holm-adjusted Y" after an interval is the row's t-test p and Holm p."""
    checked = 0
    for block in blocks(path.read_text()):
        # a study's own file may quote another study it links (../NAME/); docs/results.md quotes those it links
        linked = [f for f in STUDIES if f"figures/{f}/" in block or (folder and f"(../{f}/)" in block)]
        folders = [folder, *linked] if folder else linked
        if not folders:
            continue
        for m in INTERVAL.finditer(block):
            x = find_row(folders, *m.groups())
            checked += 1
            after = re.match(
                rf"(?: nats| points)? \(p (<?{NUMBER}), Holm-adjusted (<?{NUMBER})", block[m.end() :]
            )
            if after:
                assert printed(after.group(1), x["p_t"]) and printed(after.group(2), x["p_holm"]), block
            if not block.startswith("|") or block.count(m.group(0)) != 1:
                continue
            cells = [c.strip() for c in block.strip("|").split("|")]
            scaled = [x[k] * scale(x) for k in ("model_mean", "reference_mean", "mde")]
            values = [*scaled, *(x[k] for k in ("p_t", "p_holm", "p_sign_flip"))]
            for cell in cells:
                if m.group(0) in cell or not re.fullmatch(rf"\*?\*?(<?{NUMBER})\*?\*?", cell):
                    continue
                assert any(printed(cell, v) for v in values), (path.name, block, cell)
            verdicts = [c for c in cells if c in ("holds", "reversed", "higher", "lower", "not resolved")]
            assert verdicts in ([], [x["verdict"]]), (path.name, block)
    assert checked, f"{path} quotes no interval"
