"""The upcycling README's prose numbers, each recomputed from the committed per-run tables (perplexity.csv,
loss_vs_flops.csv, router_sN.csv, differences.csv) by a plain reading of them; its intervals and table
rows are checked by test_committed_numbers.

Mutations tried, each failing a test here: the relative effect (0.9 % -> 1.9 %), LLaMA-continued's mean
(127 -> 172), the MDE (0.2596 -> 0.2569), the FLOPs cost (3.6 % -> 6.3 %), the own-layer share (0.252 ->
0.225), its per-seed low (0.231 -> 0.213), layer 0's share (0.340 -> 0.304), its per-seed high (0.367 ->
0.376), the late training loss (4.699 -> 4.669), the late gap (-0.0086 -> -0.0068), "every one of the ten
seeds" with one seed's LIMe perplexity raised by 5 in perplexity.csv, the per-layer split ("layers 2-15" ->
"layers 3-15"), the results page's "0.9 %" -> "0.8 %"; and the primary's verdict "lower" -> "higher" in
the README's table (test_committed_numbers)."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[1] / "figures" / "upcycling"
README = " ".join((FOLDER / "README.md").read_text().split())
CONTINUED, UPCYCLED = "LLaMA-continued", "LIMe-upcycled"


def read(name: str) -> list[dict[str, str]]:
    with open(FOLDER / name) as f:
        return list(csv.DictReader(f))


def perplexity(model: str) -> dict[str, float]:
    return {r["seed"]: float(r["perplexity"]) for r in read("perplexity.csv") if r["model"] == model}


def router_shares(own: bool) -> list[float]:
    """Per seed: the mean over layers 1-15 of the own layer's share (``own``) or layer 0's share."""
    out = []
    for seed in range(10):
        rows = [r for r in read(f"router_s{seed}.csv") if r["layer"] != "0"]
        out.append(
            statistics.mean(
                float(r["weight_share"]) for r in rows if r["source_layer"] == (r["layer"] if own else "0")
            )
        )
    return out


def training_loss(model: str, first: int, last: int) -> float:
    return statistics.mean(
        float(r["loss"])
        for r in read("loss_vs_flops.csv")
        if r["model"] == model and first <= float(r["step"]) <= last
    )


def flops_at_the_end(model: str) -> float:
    return max(
        float(r["flops"]) for r in read("loss_vs_flops.csv") if r["model"] == model and r["seed"] == "0"
    )


def primary() -> dict[str, str]:
    return next(r for r in read("differences.csv") if r["role"] == "primary")


PROSE: list[tuple[str, Callable[[], float]]] = [
    (
        "(0.9 % of",
        lambda: 100 * -float(primary()["diff_mean"]) / statistics.mean(perplexity(CONTINUED).values()),
    ),
    ("LLaMA-continued's 127)", lambda: statistics.mean(perplexity(CONTINUED).values())),
    ("detectable effect (0.2596)", lambda: float(primary()["mde"])),
    ("costs 3.6 % more", lambda: 100 * (flops_at_the_end(UPCYCLED) / flops_at_the_end(CONTINUED) - 1)),
    ("fell to 0.252 on", lambda: statistics.mean(router_shares(own=True))),
    ("(per seed 0.231 to", lambda: min(router_shares(own=True))),
    ("to 0.265)", lambda: max(router_shares(own=True))),
    ("took 0.340 of", lambda: statistics.mean(router_shares(own=False))),
    ("(per seed 0.320 to", lambda: min(router_shares(own=False))),
    ("to 0.367)", lambda: max(router_shares(own=False))),
    ("210-250 is 4.769", lambda: training_loss(CONTINUED, 210, 250)),
    ("260-300 4.699)", lambda: training_loss(CONTINUED, 260, 300)),
    ("+0.0002 nats over", lambda: training_loss(UPCYCLED, 10, 50) - training_loss(CONTINUED, 10, 50)),
    ("and -0.0086 over", lambda: training_loss(UPCYCLED, 260, 300) - training_loss(CONTINUED, 260, 300)),
]


@pytest.mark.parametrize(("words", "value"), PROSE, ids=[w for w, _ in PROSE])
def test_each_prose_number_recomputes(words, value):
    assert words in README, words
    number = [t for t in words.replace("(", " ").replace(")", " ").split() if t[-1].isdigit()][-1]
    decimals = len(number.split(".")[1]) if "." in number else 0
    assert f"{value():.{decimals}f}" == number.lstrip("+"), (words, value())


def test_every_seed_is_lower_and_the_per_layer_split_is_the_tables():
    lime, llama = perplexity(UPCYCLED), perplexity(CONTINUED)
    assert len(lime) == 10 and all(lime[s] < llama[s] for s in llama)
    assert "in every one of the ten seeds" in README
    layers = [
        r for r in read("differences.csv") if r["layer"] and r["model"] == UPCYCLED and r["site"] == "values"
    ]
    higher = sorted(
        int(r["layer"]) for r in layers if float(r["p_holm"]) < 0.05 and float(r["diff_mean"]) > 0
    )
    lower = sorted(int(r["layer"]) for r in layers if float(r["p_holm"]) < 0.05 and float(r["diff_mean"]) < 0)
    assert (higher, lower) == (list(range(2, 16)), [0, 1])
    assert "higher in layers 2-15 and lower in layers 0 and 1" in README


def test_the_results_page_row_quotes_the_same_numbers():
    """docs/results.md's upcycling row (its interval is checked by test_committed_numbers)."""
    page = (FOLDER.parents[1] / "docs" / "results.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| [upcycling]"))
    relative, flops = PROSE[0][1](), PROSE[3][1]()
    assert f"better in every seed, by {relative:.1f} %" in row and f"({flops:.1f} % more FLOPs)" in row, row
