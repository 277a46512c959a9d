"""``lime-probe demo``: the paper's story on a laptop, offline, in minutes.

Trains a tiny LIMe and its LLaMA twin (same recipe, ``routing="none"``) on the built-in
arithmetic expression task, then runs every analysis that applies to them and writes the
figures, the results and one HTML report:

- accuracy by operator count (paper Figure 4b) and training loss vs FLOPs and tokens (Figures 1, 10);
- matrix entropy of the values and of the hidden states per layer (Figures 4a, 7a);
- separability and t-SNE of close numbers, 1-4 and 100-103, in the values (the W_V output): the paper's
  Figure 8 is a "t-SNE of close numbers' values representations" (Sec. 5.4.2 cites it for "better
  separability of close numbers");
- the LIMe router weights, layer x buffered layer and per head (Figures 5, 9).

It ends with a headline table of what it measured, LIMe beside LLaMA (`headline`). The two trained runs
are kept (``runs``, by default ``runs/`` inside the output folder) and a rerun reuses finished ones.

One seed: the LIMe-vs-LLaMA gap it shows is an illustration. ``lime-probe reproduce --study
arithmetic-seeds`` (the study runner, `lime_probe.studies`) measures it over seeds with intervals.

The probed representation of a number. The task's tokenizer has one token per character, so
"103" is three tokens. A causal model has read the whole number only at its last digit, so a
number's representation is the one at the position of its last digit, and only whole numbers
count (the "1" and "0" inside "103" are not occurrences of 1 or 0). With a tokenizer that keeps
numbers whole the same rule picks the number's own token.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import sys
import warnings
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lime_model.recipes import load_recipe
from lime_model.reproducible import active, check_same_mode
from lime_model.reproducible import settings as settings_of_mode
from lime_model.tasks.arithmetic import make_sample, recipe_splits
from lime_model.train import SecondEpochWarning, train
from lime_probe.extraction.loading import load
from lime_probe.output.report import write_report
from lime_probe.output.results import run_metadata
from lime_probe.specs import ANALYSES, Checkpoint, Extraction, Result, write_analysis
from lime_probe.specs import separability as separability_spec
from lime_probe.specs import tsne as tsne_spec
from lime_probe.specs.base import check_class_counts, extract_site

NUMBER_SETS = {"1-4": (1, 2, 3, 4), "100-103": (100, 101, 102, 103)}
NUMBER_NOTE = (
    "A number's representation is the one at its last digit, the first position where a causal "
    "model has read all of it; only whole numbers count (the 1 and 0 inside 103 are not occurrences "
    "of 1 or 0). The texts are held-out test expressions plus 4-operand expressions built to reach "
    "100-103, which random expressions rarely do."
)
_WHOLE_NUMBER = re.compile(r"(?<!\d)\d+(?!\d)")


def number_positions(pieces: Sequence[str], numbers: Collection[int]) -> list[tuple[int, int]]:
    """Where whole numbers of ``numbers`` occur in one sequence given as token strings.

    Args:
        pieces: the sequence's tokens as strings (e.g. ``tokenizer.convert_ids_to_tokens``),
            length t; their concatenation is the text.
        numbers: the numbers to find.

    Returns:
        ``(token index of the number's last character, number)`` per occurrence, in text order.
    """
    ends = np.cumsum([len(p) for p in pieces])  # ends[i]: text offset just after token i
    text = "".join(pieces)
    wanted = set(numbers)
    out = []
    for m in _WHOLE_NUMBER.finditer(text):
        if int(m.group()) in wanted:
            out.append((int(np.searchsorted(ends, m.end() - 1, side="right")), int(m.group())))
    return out


def number_rows(
    offsets: torch.Tensor, token_ids: torch.Tensor, tokenizer, numbers: Collection[int]
) -> tuple[torch.Tensor, np.ndarray]:
    """Rows of an extraction (``pool="none"``) that hold whole-number occurrences of ``numbers``.

    Args:
        offsets: (n_sequences+1,) row offsets per sequence (``Activations.offsets``).
        token_ids: (n_rows,) token id per row (``Activations.token_ids``).
        tokenizer: the tokenizer that produced the ids.
        numbers: the numbers to find.

    Returns:
        ``(rows, labels)``: LongTensor (n,) of row indices and the number at each, (n,) int.
    """
    pieces = tokenizer.convert_ids_to_tokens(token_ids.tolist())
    rows, labels = [], []
    bounds = offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        for pos, number in number_positions(pieces[start:end], numbers):
            rows.append(start + pos)
            labels.append(number)
    return torch.tensor(rows, dtype=torch.long), np.array(labels, dtype=np.int64)


# --------------------------------------------------------------------------- probe data


def probe_samples(numbers: Collection[int], per_number: int, seed: int = 0) -> list:
    """Arithmetic samples (4 operands, the task's format) whose text holds each of ``numbers``.

    The task's random expressions rarely reach 101 or 103, so these are drawn from a few
    4-operand shapes over the digits 1..9 with values up to 738 (``a×b×c±d``, ``(a+b)×c±d``,
    ``a×b+c×d``), shuffled with ``seed``, until every number occurs at least ``per_number``
    times as a whole number or the shapes are exhausted. Solutions come from the task itself.
    """
    shapes = ("{}×{}×{}+{}", "{}×{}×{}-{}", "({}+{})×{}+{}", "({}+{})×{}-{}", "{}×{}+{}×{}")
    candidates = [s.format(*d) for s in shapes for d in itertools.product(range(1, 10), repeat=4)]
    random.Random(seed).shuffle(candidates)
    counts = dict.fromkeys(numbers, 0)
    out = []
    for expression in candidates:
        if min(counts.values()) >= per_number:
            break
        sample = make_sample(expression)
        if sample.answer < 0:  # only the last subtraction can go negative; the task has naturals only
            continue
        found = [n for _, n in number_positions(list(sample.prompt + sample.solution), numbers)]
        if any(counts[n] < per_number for n in found):
            out.append(sample)
            for n in found:
                counts[n] += 1
    return out


def sample_text(sample, tokenizer) -> str:
    """A sample as the model saw it in training: bos, prompt, solution, eos."""
    return tokenizer.bos_token + sample.prompt + sample.solution + tokenizer.eos_token


def number_features(
    acts, tokenizer, site: str, numbers: Collection[int], label: str
) -> tuple[dict, np.ndarray]:
    """Representations at whole-number occurrences of ``numbers`` (see the module docstring) in an
    extraction ``acts`` (``pool="none"``) of ``site``: ({layer: (n, d)}, labels (n,) as strings).
    ValueError naming ``label`` if a number occurs fewer than 5 times."""
    rows, labels = number_rows(acts.offsets, acts.token_ids, tokenizer, numbers)
    labels = np.array([str(n) for n in labels], dtype=object)
    check_class_counts(labels, [str(n) for n in numbers], 5, f"{label}: numbers")
    return {layer: acts[site][layer][rows] for layer in acts[site]}, labels


# --------------------------------------------------------------------------- the pipeline


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of a demo run; the ``None`` fields keep the ``arithmetic-cpu`` recipe's values."""

    steps: int | None  # training steps per model
    train_per_tier: int | None
    test_per_tier: int | None
    entropy_texts: int  # test samples whose entropy is measured
    per_number: int  # occurrences of each probed number (separability, t-SNE)
    perplexity: float


# The recipe as it is (1,000 steps per model); the README states the measured run time.
FULL = DemoSettings(
    steps=None,
    train_per_tier=None,
    test_per_tier=None,
    entropy_texts=128,
    per_number=60,
    perplexity=20.0,
)
QUICK = DemoSettings(
    steps=4, train_per_tier=100, test_per_tier=6, entropy_texts=12, per_number=8, perplexity=3.0
)
RECIPE = "arithmetic-cpu"
MODELS = {"LIMe": "full", "LLaMA": "none"}  # label -> routing; the twin differs only in routing


def _stage(k: int, n: int, what: str) -> None:
    print(f"[{k}/{n}] {what}", file=sys.stderr, flush=True)


def train_models(runs: Path, settings: DemoSettings, seed: int) -> dict[str, Path]:
    """Train (or reuse finished) LIMe and LLaMA runs of the arithmetic recipe under ``runs``."""
    out = {}
    for label, routing in MODELS.items():
        run = runs / label.lower()
        check_same_mode(run, active())  # a run of the other mode is neither reused nor continued
        if not (run / "arithmetic_eval.json").is_file():
            resume = run.exists() and any(run.iterdir())
            sizes = {
                "train_per_tier": settings.train_per_tier,
                "test_per_tier": settings.test_per_tier,
            }
            overrides: dict[str, Any] = {"arithmetic": {k: v for k, v in sizes.items() if v is not None}}
            if settings.steps is not None:
                overrides["steps"] = settings.steps
            with warnings.catch_warnings():  # the recipe repeats its 10,000 expressions by design
                warnings.simplefilter("ignore", SecondEpochWarning)
                train(RECIPE, run, resume=resume, routing=routing, seed=seed, **overrides)
        out[label] = run
    return out


# The site of the close-number probes: the paper's Figure 8 maps "close numbers' values representations".
NUMBER_SITE = "values"


def run_demo(
    out: str | os.PathLike,
    *,
    quick: bool = False,
    seed: int = 0,
    device: str = "cpu",
    runs: str | os.PathLike | None = None,
) -> tuple[Path, list[dict]]:
    """Train, analyse and report (see the module docstring).

    ``runs`` is where the two training runs are kept and reused when finished (default: ``out/runs``).
    Returns the report's path in ``out`` and the `headline` rows.
    """
    settings = QUICK if quick else FULL
    out = Path(out)
    n = 7
    run_root = Path(runs) if runs is not None else out / "runs"
    _stage(1, n, f"training LIMe and its LLaMA twin on arithmetic (recipe {RECIPE})")
    run_dirs = train_models(run_root, settings, seed)
    _stage(2, n, "loading the trained checkpoints")
    cks = [Checkpoint(label, str(path), *load(path, device=device)) for label, path in run_dirs.items()]
    meta = run_metadata(
        "demo",
        settings={"quick": quick, "seed": seed, "recipe": RECIPE, **asdict(settings)},
        checkpoints={c.label: c.source for c in cks},
    )
    meta["reproducible"] = settings_of_mode()
    tok = cks[0].tokenizer
    recipe = load_recipe(str(run_dirs["LIMe"] / "recipe.json"))
    _, test = recipe_splits(recipe, with_train=False)
    steps = recipe.steps
    extraction = Extraction(max_length=recipe.seq_len, batch_size=32)

    _stage(3, n, "accuracy by operator count and training curves")
    results = accuracy_and_curves(cks, steps, seed)

    _stage(4, n, "matrix entropy of values and hidden states")
    texts = [sample_text(s, tok) for s in test[: settings.entropy_texts]]
    for site in ("values", "hidden"):  # one sequence per arithmetic sample (samples share a format)
        results.append(
            ANALYSES["entropy"].run(cks, texts, extraction, site=site, seed=seed, unit="documents")
        )

    _stage(5, n, f"separability and t-SNE of close numbers ({NUMBER_SITE})")
    probe_texts = [
        sample_text(s, tok) for s in test + probe_samples(NUMBER_SETS["100-103"], settings.per_number, seed)
    ]
    results += number_probes(cks, probe_texts, extraction, settings, seed)

    _stage(6, n, "router weights of LIMe")
    results.append(ANALYSES["router"].run([c for c in cks if c.label == "LIMe"]))

    _stage(7, n, "writing results, figures and the report")
    sections = [write_analysis(r, out, meta) for r in results]
    report = write_report(
        out / "report.html",
        "LIMe vs LLaMA on arithmetic expressions (lime-probe demo)",
        sections,
        meta=meta,
    )
    return report, headline(results)


def accuracy_and_curves(cks: Sequence[Checkpoint], steps: int | None, seed: int) -> list[Result]:
    """Accuracy by operator count (its text saying how the two models were trained, and that one seed
    illustrates rather than measures) and the training curves."""
    results = [ANALYSES["arithmetic-accuracy"].run(cks), ANALYSES["training-curves"].run(cks)]
    results[0].text = (
        f"Both models were trained with the same recipe ({RECIPE}, {steps} steps, seed {seed}); "
        "they differ only in routing (LIMe: full, LLaMA: none). " + results[0].text + " One seed only: "
        "the gap moves by several points with the seed and across machines, so it illustrates the task "
        "rather than measures the difference; `lime-probe reproduce --study arithmetic` measures it over "
        "five seeds with 95 % intervals (README, figures/arithmetic-seeds/)."
    )
    return results


def number_probes(
    cks: Sequence[Checkpoint], texts: Sequence[str], extraction: Extraction, settings: DemoSettings, seed: int
) -> list[Result]:
    """Separability and t-SNE of each set of close numbers (`NUMBER_SETS`) at `NUMBER_SITE`, read from one
    extraction of ``texts`` per checkpoint."""
    acts = {c.label: extract_site(c, texts, NUMBER_SITE, extraction) for c in cks}
    results = []
    for key, numbers in NUMBER_SETS.items():
        feats = {
            c.label: number_features(acts[c.label], c.tokenizer, NUMBER_SITE, numbers, c.label) for c in cks
        }
        slug = key.replace("-", "_")
        for r in (
            separability_spec.from_features(
                feats,
                site=NUMBER_SITE,
                classes=[str(k) for k in numbers],  # the labels of `number_features`
                seed=seed,
                name=f"separability_numbers_{slug}",
                what=f"numbers {key}",
            ),
            tsne_spec.from_features(
                feats,
                site=NUMBER_SITE,
                name=f"tsne_numbers_{slug}",
                what=f"numbers {key}",
                per_class=settings.per_number,
                perplexity=settings.perplexity,
                seed=seed,
            ),
        ):
            r.text += " " + NUMBER_NOTE
            results.append(r)
    return results


def headline(results: Sequence[Result]) -> list[dict]:
    """What the demo measured, from its ``results``: one row per measure, a column per model (``MODELS``):
    accuracy per operator count, the values' matrix entropy averaged over the blocks, and the close-number
    separability at the last block."""
    by_name = {r.name: r for r in results}
    table: dict[str, dict] = {}

    def put(measure: str, model: str, value: float) -> None:
        table.setdefault(measure, {"measure": measure})[model] = value

    for r in by_name["arithmetic_accuracy"].rows:
        put(f"accuracy, {r['n_operators']} operators", r["model"], r["accuracy"])
    entropy = [r for r in by_name["entropy_values"].rows if r["site"] == "values"]
    n_blocks = len({r["layer"] for r in entropy})
    for model in MODELS:
        mean = float(np.mean([r["entropy_mean"] for r in entropy if r["model"] == model]))
        put(f"value entropy, mean over {n_blocks} blocks [nats]", model, mean)
    for key in NUMBER_SETS:
        rows = by_name[f"separability_numbers_{key.replace('-', '_')}"].rows
        last = max(r["layer"] for r in rows)
        for r in rows:
            if r["layer"] == last:
                put(f"separability of {key}, {NUMBER_SITE} of block {last}", r["model"], r["accuracy_mean"])
    return list(table.values())
