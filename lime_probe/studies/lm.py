"""``lime-probe reproduce``: the paper's language-model findings at CPU scale, LIMe vs LLaMA over seeds.

Trains (or reuses) a LIMe (``routing="full"``) and a LLaMA (``"none"``) language model per seed on
WikiText-2 ``valid.txt`` with one recipe, then measures every run on held-out text only (WikiText-2
``test.txt`` and BLiMP) and compares the two architectures as paired differences over seeds. With
``baselines`` it also trains the paper's cross-layer baselines (DenseFormer, ResFormer, HyperConnections;
same recipe, ``routing="none"``) or the k/v-init ablations (:data:`BASELINES`) and compares each with
LLaMA in the same way, as extra rows:

=====================  =====================================================================  ==========
measurement            what                                                                   paper
=====================  =====================================================================  ==========
perplexity             exp(mean token NLL) over all non-overlapping windows of ``test.txt``     Sec. 5.1
value entropy          per layer, ``values`` site, fixed-length windows (same for all models)   Fig. 2a
separability           is/are/was/were per layer on ``values`` (every window of ``test.txt``)   Fig. 2b
BLiMP (Table 2)        probe accuracy over the upper layers, mean-pooled values and hidden      Table 2
t-SNE                  is/are/was/were values, LIMe and LLaMA, one row per model and seed       Fig. 3
router                 each seed's LIMe routers beside their step 0 (rebuilt) and the change    Fig. 5
loss vs FLOPs          training loss, mean over seeds, band: min-max over seeds                 Fig. 1
=====================  =====================================================================  ==========

The protocols are fixed in ``figures/lm-cpu/PROTOCOL.md`` and, for the baselines and the k/v-init
ablations, ``figures/lm-cpu-baselines/PROTOCOL.md`` and ``figures/lm-cpu-kv-init/PROTOCOL.md`` (each
written before any result was seen, except the latter's marked addendum). Layout of
``out``::

    train/{lime,llama,...}-s{seed}/  lime-model runs: reused when finished, resumed when interrupted
    measure/{kind}/{run}.json     one measurement of one run, reused: a rerun continues where it stopped
    results/                      tables (CSV, JSON), figures (PNG, PDF) and findings.md

Everything but the training runs is cheap to recompute; delete ``measure/`` to redo the measurements.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# label -> recipe overrides. LIMe and LLaMA differ only in routing; each baseline (issue 13) is its
# own architecture without LIMe routing. Every comparison is a model minus LLaMA, paired by seed.
MODELS: dict[str, dict[str, Any]] = {"LIMe": {"routing": "full"}, "LLaMA": {"routing": "none"}}
# --baselines name -> (label, overrides): the paper's cross-layer baselines and the k/v-init ablations,
# each an extra model compared with LLaMA like LIMe is (no paper sign)
BASELINES: dict[str, tuple[str, dict[str, Any]]] = {
    **{
        arch: (label, {"routing": "none", "model.arch": arch})
        for arch, label in (
            ("denseformer", "DenseFormer"),
            ("resformer", "ResFormer"),
            ("hyperconnections", "HyperConnections"),
        )
    },
    # the k/v-init ablation's two other cells: LIMe with LLaMA's k/v init (normal(0, 0.02)) instead of
    # the official code's PyTorch default, and LLaMA with LIMe's
    "lime-llama-kv-init": ("LIMe-LLaMA-kv-init", {"routing": "full", "model.kv_proj_init": "normal"}),
    "llama-torch-kv-init": ("LLaMA-torch-kv-init", {"routing": "none", "model.kv_proj_init": "torch"}),
}
WORDS = (" is", " are", " was", " were")
ENTROPY_PRESET = "lime"  # the official code's: z-scored features, alpha 0.5


@dataclass(frozen=True)
class Size:
    """How big a reproduction is: the recipe (plus overrides), the seeds and the measurement sizes."""

    recipe: str = "wikitext-cpu"
    seeds: tuple[int, ...] = (0, 1, 2)
    overrides: Mapping[str, Any] = field(default_factory=dict)
    num_windows: int = 256  # entropy windows drawn from test.txt
    blimp_pairs: int = 1000  # per BLiMP task: all of them, as App. D (1-2 CPU-min per 16 x 64 model)
    tsne_per_word: int = 150
    probe_layers_every: int = 1  # separability/t-SNE on every k-th layer


SIZES = {
    "cpu": Size(),
    # A smoke run for the tests: a 2-layer model, a few steps, small measurements.
    "tiny": Size(
        seeds=(0, 1),
        overrides={
            "steps": 4,
            "warmup_steps": 1,
            "max_texts": 2000,
            "model.num_hidden_layers": 2,
            "model.hidden_size": 32,
            "model.intermediate_size": 64,
            "model.vocab_size": 2048,
            "seq_len": 64,
            "batch_size": 4,
            "micro_batch_size": 4,
        },
        num_windows=8,
        blimp_pairs=20,
        tsne_per_word=12,
    ),
}


@dataclass(frozen=True)
class Data:
    """The shared data the reproduction reads: WikiText-2 (train on valid, measure on test) and BLiMP."""

    train: Path
    test: Path
    blimp: Path

    @classmethod
    def under(cls, root: str | os.PathLike) -> Data:
        root = Path(root)
        data = cls(root / "wikitext-2" / "valid.txt", root / "wikitext-2" / "test.txt", root / "blimp")
        for path in (data.train, data.test, data.blimp):
            if not path.exists():
                raise FileNotFoundError(
                    f"data not found: {path} (--data names the folder holding wikitext-2/ and blimp/)"
                )
        return data


def run_name(label: str, seed: int) -> str:
    return f"{label.lower()}-s{seed}"


# --------------------------------------------------------------------------- progress


class Progress:
    """One line per step with the elapsed time and an estimate of what is left: the mean time of the
    steps that did work (a finished run that is reused takes no time and would skew the mean)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.reused, self.start = total, 0, 0, time.monotonic()

    def step(self, what: str, reused: bool = False) -> None:
        elapsed = time.monotonic() - self.start
        worked = self.done - self.reused
        eta = f"{elapsed / worked * (self.total - self.done) / 60:.0f} min" if worked else "?"
        print(
            f"[{self.done + 1}/{self.total}] {what}{' (reused)' if reused else ''} "
            f"(elapsed {elapsed / 60:.0f} min, left ~{eta})",
            file=sys.stderr,
            flush=True,
        )
        self.done += 1
        self.reused += reused


def cached(path: Path, compute: Callable[..., dict], *args: Any) -> dict:
    """The JSON at ``path``; ``compute(*args)`` written there (atomically) first if it is not there."""
    from lime_probe.output.results import atomic_write_text, to_jsonable

    if path.is_file():
        return json.loads(path.read_text())
    value = compute(*args)
    atomic_write_text(path, json.dumps(to_jsonable(value)))
    return value


# --------------------------------------------------------------------------- training


def finished(run: Path) -> bool:
    """Whether ``run`` is a complete lime-model run: its metrics reached the recipe's last step."""
    metrics = run / "metrics.jsonl"
    if not (run / "recipe.json").is_file() or not metrics.is_file() or not (run / "config.json").is_file():
        return False
    lines = metrics.read_text().strip().splitlines()
    steps = json.loads((run / "recipe.json").read_text())[
        "steps"
    ]  # read raw: runs of older recipe schemas count
    return bool(lines) and json.loads(lines[-1])["step"] == steps


def train_runs(
    out: Path,
    recipe: str,
    seeds: Sequence[int],
    overrides: Mapping[str, Any],
    progress: Progress,
    data: str | None = None,
    models: Mapping[str, Mapping[str, Any]] = MODELS,
) -> dict[tuple[str, int], Path]:
    """Train every (model, seed) run of ``recipe`` that is not finished; returns their folders.

    ``data`` is the training text (None: the recipe's own, e.g. the built-in arithmetic task);
    ``models`` maps each label to its recipe overrides (on top of ``overrides``)."""
    from lime_model.train import train

    runs = {}
    for seed in seeds:
        for label, model in models.items():
            run = out / "train" / run_name(label, seed)
            done = finished(run)
            progress.step(f"training {label} seed {seed}", reused=done)
            if not done:
                resume = (run / "recipe.json").is_file()
                extra = {"data": data} if data is not None else {}
                train(recipe, run, resume=resume, seed=seed, **extra, **{**overrides, **model})
            runs[label, seed] = run
    return runs


# --------------------------------------------------------------------------- measurements of one run


def measure_perplexity(run: Path, data: Data) -> dict:
    from lime_model.evaluate import perplexity

    return perplexity(run, str(data.test))


def _test_windows(
    tokenizer, data: Data, window: int, num_windows: int | None, seed: int = 0
) -> list[list[int]]:
    from lime_model.data import load_texts
    from lime_probe.extraction.windows import token_windows

    return token_windows(load_texts(str(data.test)), tokenizer, window, num_windows, seed=seed)


def measure_entropy(model, tokenizer, data: Data, window: int, num_windows: int) -> dict:
    """Entropy of each window's values per layer: {"layers": [...], "values": (layers, windows)}."""
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.entropy import layer_entropy

    windows = _test_windows(tokenizer, data, window, num_windows)
    acts = extract(
        model, tokenizer, windows, sites=["values"], pretokenized=True, max_length=window, progress=False
    )
    layers = acts.layers("values")
    values = [layer_entropy(acts.sequences("values", la), ENTROPY_PRESET).values.tolist() for la in layers]
    return {"layers": layers, "values": values, "window": window, "num_windows": len(windows)}


def word_features(model, tokenizer, data: Data, window: int) -> tuple[dict, np.ndarray]:
    """The values of every is/are/was/were in ``test.txt`` (every window): ({layer: (n, d)}, words (n,))."""
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.separability import word_rows, word_token_ids

    ids = word_token_ids(tokenizer, WORDS)
    windows = _test_windows(tokenizer, data, window, None)
    acts = extract(
        model,
        tokenizer,
        windows,
        sites=["values"],
        pretokenized=True,
        max_length=window,
        token_ids=list(ids.values()),
        progress=False,
    )
    rows, words = word_rows(acts.token_ids, ids)
    return {la: acts["values"][la][rows].numpy() for la in acts.layers("values")}, words


def measure_separability(features: dict, words: np.ndarray, seed: int) -> dict:
    from lime_probe.probes.separability import token_separability

    # classes in WORDS' order: the official probe lays rows out class by class in the words' given order
    res = token_separability(features, words, seed=seed, progress=False, classes=WORDS)
    return {
        "layers": list(res.layers),
        "accuracy": res.accuracy_mean.tolist(),
        "fold_std": res.accuracy_std.tolist(),
        "n_rows": res.n_rows,
        "majority_baseline": res.majority_baseline,
    }


def measure_blimp(model, tokenizer, data: Data, pairs: int, seed: int) -> dict:
    """Table-2 probes: per task and site, the probe accuracy per upper layer (mean-pooled representations)."""
    from lime_probe.extraction.tracing import extract
    from lime_probe.extraction.windows import max_positions
    from lime_probe.probes.blimp import blimp_probe, fit_pairs, load_blimp, paper_layers
    from lime_probe.protocol import TABLE2_TASKS

    blimp = load_blimp(str(data.blimp), list(TABLE2_TASKS))
    keep, skipped = fit_pairs(blimp, tokenizer, max_positions(model))
    blimp = blimp.select(keep)
    uids = np.asarray(blimp["UID"], dtype=object)
    n_layers = model.config.num_hidden_layers
    out: dict[str, Any] = {"skipped": skipped, "tasks": {}}
    for task in TABLE2_TASKS:
        part = blimp.select(np.flatnonzero(uids == task)[:pairs])
        layers = {site: paper_layers(n_layers, site) for site in ("values", "hidden")}
        # Both sites in one pass: the top blocks are the same negative indices of either site.
        top = list(range(-len(layers["values"]), 0))
        good, bad = (
            extract(
                model,
                tokenizer,
                list(part[col]),
                sites=list(layers),
                layers=top,
                pool="mean",
                batch_size=64,
                progress=False,
            )
            for col in ("sentence_good", "sentence_bad")
        )
        per_site = {}
        for site, site_layers in layers.items():
            res = blimp_probe(
                {la: good[site][la] for la in site_layers},
                {la: bad[site][la] for la in site_layers},
                np.asarray(part["pairID"]),
                seed=seed,
                progress=False,
            )
            per_site[site] = {
                "layers": site_layers,
                "accuracy": res.accuracy_mean.tolist(),
                "n_pairs": len(part),
            }
        out["tasks"][task] = per_site
    return out


# --------------------------------------------------------------------------- comparisons over seeds


ENDPOINTS = ("primary", "secondary", "exploratory")


def differences(
    per_seed: Mapping[str, Sequence[float]],
    what: str,
    paper_sign: int | None,
    endpoint: str = "primary",
    reference: str = "LLaMA",
    **row,
) -> dict:
    """A model minus ``reference`` (LLaMA) paired by seed; ``per_seed`` holds the reference and that
    one model.

    Every row carries the paired t-interval (``ci_low``, ``ci_high``), the t-test's ``p_t``, the exact
    sign-flip ``p_sign_flip`` and the minimum detectable effect ``mde`` at this many seeds (two-sided
    5 %, 80 % power, the observed paired std; see `stats.paired_difference`).

    ``endpoint``: "primary" (the one pre-registered endpoint of a claim) and "secondary" rows get a
    verdict from the t-interval: against the paper's sign (+1: the model higher) when the paper states
    one (its LIMe claims), else (``paper_sign`` None, the baselines) only which way a resolved
    difference goes. "exploratory" rows (one per layer) get none: their verdict is "exploratory", and
    `adjust_exploratory` adds Holm-adjusted p and BH q over their family. The row names the model in
    ``model`` and ``reference`` and gives their means in the columns of their labels (e.g. "LIMe",
    "LLaMA")."""
    from lime_probe.probes.stats import paired_difference

    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    label = next(k for k in per_seed if k != reference)
    d = paired_difference(per_seed[label], per_seed[reference])
    if endpoint == "exploratory":
        verdict = "exploratory"
    elif d.verdict == "not resolved":
        verdict = "not resolved"
    elif paper_sign is None:
        verdict = "higher" if d.mean > 0 else "lower"
    else:
        verdict = "holds" if (d.mean > 0) == (paper_sign > 0) else "reversed"
    return {
        "measure": what,
        **row,
        "model": label,
        "reference": reference,
        "endpoint": endpoint,
        label: float(np.mean(per_seed[label])),
        reference: float(np.mean(per_seed[reference])),
        "diff_mean": d.mean,
        "diff_std": d.std,
        "ci_low": d.ci_low,
        "ci_high": d.ci_high,
        "n_seeds": d.n,
        "per_seed_diff": list(d.pairs),
        "p_t": d.p,
        "p_sign_flip": d.p_sign_flip,
        "mde": d.mde,
        "verdict": verdict,
    }


def adjust_exploratory(rows: list[dict]) -> list[dict]:
    """Add ``p_holm`` and ``q_bh`` (of ``p_t``) to the exploratory rows, one family per model, reference
    and measure (e.g. LIMe's 16 per-layer value-entropy differences from LLaMA), in place; returns
    ``rows``."""
    from lime_probe.probes.stats import benjamini_hochberg, holm

    families: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["endpoint"] == "exploratory":
            families.setdefault((r["model"], r["reference"], r["measure"]), []).append(r)
    for family in families.values():
        p = [r["p_t"] for r in family]
        for r, ph, q in zip(family, holm(p), benjamini_hochberg(p), strict=True):
            r["p_holm"], r["q_bh"] = float(ph), float(q)
    return rows


def _by_model(
    measured: Mapping[tuple[str, int], Any],
    seeds: Sequence[int],
    get: Callable[[Any], float],
    labels: Sequence[str] = tuple(MODELS),
) -> dict:
    return {label: [get(measured[label, s]) for s in seeds] for label in labels}


def compare(
    m: dict, seeds: Sequence[int], labels: Sequence[str] = ("LIMe",), reference: str = "LLaMA"
) -> list[dict]:
    """Every comparison of the protocol for each of ``labels`` minus ``reference`` (LLaMA), one row
    each, model by model.

    Each claim of `CLAIMS` has one primary endpoint (perplexity; value entropy averaged over layers;
    separability averaged over the upper half; BLiMP on values; BLiMP on hidden states); the per-layer
    rows of entropy and separability are exploratory, with Holm and BH over the layers. Only LIMe's
    rows against LLaMA carry a verdict against the paper's sign (the paper's claims are about LIMe). The seeds x
    windows bootstrap of the per-layer entropy difference is added from `stats.MIN_BOOTSTRAP_SEEDS`
    seeds on (fewer resample too few distinct seed sets)."""
    from lime_probe.probes.stats import MIN_BOOTSTRAP_SEEDS, paired_bootstrap_ci

    rows = []
    for label in labels:

        def diff(kind, get, what, paper_sign, label=label, **row):
            per = _by_model(m[kind], seeds, get, (label, reference))
            claim = label == "LIMe" and reference == "LLaMA"
            return differences(per, what, paper_sign if claim else None, reference=reference, **row)

        rows.append(diff("perplexity", lambda r: r["perplexity"], "perplexity", -1))
        ent = m["entropy"]
        for i, layer in enumerate(ent[label, seeds[0]]["layers"]):
            row = diff(
                "entropy",
                lambda r, i=i: float(np.mean(r["values"][i])),
                "value entropy",
                +1,
                endpoint="exploratory",
                layer=layer,
            )
            if len(seeds) >= MIN_BOOTSTRAP_SEEDS:
                a = np.array([ent[label, s]["values"][i] for s in seeds])
                b = np.array([ent[reference, s]["values"][i] for s in seeds])
                row["ci_low_seeds_x_windows"], row["ci_high_seeds_x_windows"] = paired_bootstrap_ci(a, b)
            rows.append(row)
        rows.append(diff("entropy", lambda r: float(np.mean(r["values"])), "value entropy", +1, layer="mean"))
        layers = m["separability"][label, seeds[0]]["layers"]
        for i, layer in enumerate(layers):
            rows.append(
                diff(
                    "separability",
                    lambda r, i=i: r["accuracy"][i],
                    "separability",
                    +1,
                    endpoint="exploratory",
                    layer=layer,
                )
            )
        upper = len(layers) // 2
        rows.append(
            diff(
                "separability",
                lambda r, upper=upper: float(np.mean(r["accuracy"][upper:])),
                "separability",
                +1,
                layer="upper half",
            )
        )
        for site in ("values", "hidden"):
            rows.append(
                diff(
                    "blimp",
                    lambda r, site=site: float(
                        np.mean([np.mean(t[site]["accuracy"]) for t in r["tasks"].values()])
                    ),
                    "BLiMP probe (Table 2)",
                    +1,
                    site=site,
                )
            )
    return adjust_exploratory(rows)


# --------------------------------------------------------------------------- the command


def measure_run(
    run: Path, seed: int, data: Data, cfg: Size, where: Path, device: str = "cpu", with_features: bool = False
) -> tuple[dict[str, dict], tuple[dict, np.ndarray] | None]:
    """Perplexity, entropy, separability and BLiMP of one finished run (trained with ``seed``), each
    cached as ``where/{kind}/{run name}.json``: a rerun, or a second process measuring other runs,
    reuses them.

    ``with_features``: also return the is/are/was/were features (they feed the t-SNE); otherwise None."""
    from lime_probe.extraction.loading import load

    name = run.name
    model, tok = load(run, device=device)
    hf = getattr(model, "_module", model)
    window = hf.config.max_position_embeddings
    measured = {
        "perplexity": cached(where / "perplexity" / f"{name}.json", measure_perplexity, run, data),
        "entropy": cached(
            where / "entropy" / f"{name}.json", measure_entropy, model, tok, data, window, cfg.num_windows
        ),
    }
    sep_path, features = where / "separability" / f"{name}.json", None
    if with_features or not sep_path.is_file():
        features = word_features(model, tok, data, window)
        measured["separability"] = cached(sep_path, measure_separability, *features, seed)
    else:
        measured["separability"] = cached(sep_path, measure_separability)
    measured["blimp"] = cached(
        # the pair count is in the name, so a measurement at another size is never reused for this one
        where / "blimp" / f"{name}-{cfg.blimp_pairs}-pairs.json",
        measure_blimp,
        hf,
        tok,
        data,
        cfg.blimp_pairs,
        seed,
    )
    return measured, features if with_features else None


def run_reproduction(
    out: str | os.PathLike,
    data_root: str | os.PathLike,
    *,
    size: str = "cpu",
    results: str | os.PathLike | None = None,
    device: str = "cpu",
    baselines: Sequence[str] = (),
) -> Path:
    """Train or reuse the runs, measure them, compare, and write ``results`` (default ``out/results``).

    ``baselines``: names from ``BASELINES`` trained and compared with LLaMA besides LIMe (runs
    ``{name}-s{seed}``). Returns the results folder. See the module docstring for what is measured
    and where it goes.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline {unknown[0]!r}; valid: {', '.join(BASELINES)}")
    cfg = SIZES[size]
    data = Data.under(data_root)
    out = Path(out)
    results = Path(results) if results is not None else out / "results"
    seeds = cfg.seeds
    models = {**MODELS, **dict(BASELINES[b] for b in dict.fromkeys(baselines))}
    progress = Progress(2 * len(seeds) * len(models) + 1)
    runs = train_runs(out, cfg.recipe, seeds, cfg.overrides, progress, data=str(data.train), models=models)

    from lime_probe.extraction.loading import load
    from lime_probe.specs import Checkpoint

    m: dict[str, dict] = {k: {} for k in ("perplexity", "entropy", "separability", "blimp")}
    tsne_features = {}
    for (label, seed), run in runs.items():
        progress.step(f"measuring {label} seed {seed}: perplexity, entropy, separability, BLiMP")
        measured, features = measure_run(
            run, seed, data, cfg, out / "measure", device, with_features=label in MODELS
        )  # Fig. 3 maps LIMe and LLaMA
        for kind, value in measured.items():
            m[kind][label, seed] = value
        if features is not None:
            tsne_features[label, seed] = features
    progress.step("comparing and writing the results")
    lime_runs = [
        Checkpoint(f"LIMe s{s}", str(runs["LIMe", s]), *load(runs["LIMe", s], device=device)) for s in seeds
    ]
    write_results_folder(results, m, seeds, cfg, runs, tsne_features, lime_runs, size, list(models))
    return results


def write_results_folder(
    results: Path,
    m: dict,
    seeds,
    cfg: Size,
    runs,
    tsne_features,
    lime_runs,
    size: str,
    labels: Sequence[str] = tuple(MODELS),
) -> None:
    """Tables, figures and findings.md from the measurements of the ``labels`` models (see `compare`)."""
    from lime_probe.output.results import (
        atomic_write_text,
        read_metrics,
        rows_to_csv,
        run_metadata,
        write_results,
    )
    from lime_probe.specs import ANALYSES

    meta = run_metadata(
        "reproduce",
        settings={"size": size, **asdict(cfg), "words": WORDS, "models": list(labels)},
        checkpoints={run_name(label, s): str(p) for (label, s), p in runs.items()},
    )
    meta["threads"] = _threads()
    compared = [label for label in labels if label != "LLaMA"]
    diff = compare(m, seeds, compared)
    write_results(results / "differences", diff, meta=meta)
    per_run = per_run_rows(m)
    for kind, rows in per_run.items():
        write_results(results / kind, rows, meta=meta)
    router = ANALYSES["router"].run(lime_runs)
    write_results(results / "router", router.rows, meta=meta, extra=router.extra)
    curves = {label: _mean_curve([read_metrics(runs[label, s]) for s in seeds]) for label in labels}
    tsne = tsne_embeddings(tsne_features, cfg)
    draw(results, m, diff, seeds, curves, tsne, router, labels)
    protocol = "PROTOCOL.md in this folder" if (results / "PROTOCOL.md").is_file() else None
    atomic_write_text(results / "findings.md", findings(diff, seeds, compared, protocol))
    atomic_write_text(
        results / "summary.json", json.dumps({"meta": meta, "differences": diff}, indent=1, default=str)
    )
    print(
        rows_to_csv(
            [
                {"measure": r["measure"], "model": label, "mean": r[label]}
                | {k: r[k] for k in ("LLaMA", "diff_mean", "ci_low", "ci_high", "verdict")}
                | {"where": r.get("layer", r.get("site", ""))}
                for label in compared
                for r in diff
                if label in r
            ]
        ),
        file=sys.stderr,
    )


def _threads() -> dict:
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def entropy_rows(entropy: Mapping[tuple[str, int], dict], unit: str) -> list[dict]:
    """Per-run, per-layer value entropy: mean and std over the measured ``unit``s (windows, texts), plus
    the window length where the measurement records one."""
    rows = []
    for (label, seed), r in entropy.items():
        for layer, vals in zip(r["layers"], r["values"], strict=True):
            row = {
                "model": label,
                "seed": seed,
                "layer": layer,
                "entropy_mean": float(np.mean(vals)),
                "entropy_std": float(np.std(vals)),
                unit: len(vals),
            }
            rows.append(row | ({"window": r["window"]} if "window" in r else {}))
    return rows


def per_run_rows(m: dict) -> dict[str, list[dict]]:
    """Per-run tables: perplexity, entropy per layer (mean over windows), separability per layer, BLiMP per task."""
    out: dict[str, list[dict]] = {"perplexity": [], "entropy": [], "separability": [], "blimp": []}
    for (label, seed), r in m["perplexity"].items():
        out["perplexity"].append(
            {
                "model": label,
                "seed": seed,
                "perplexity": r["perplexity"],
                "loss": r["loss"],
                "tokens": r["tokens"],
            }
        )
    out["entropy"] = entropy_rows(m["entropy"], unit="windows")
    for (label, seed), r in m["separability"].items():
        for layer, acc in zip(r["layers"], r["accuracy"], strict=True):
            out["separability"].append(
                {"model": label, "seed": seed, "layer": layer, "accuracy": acc, "n_rows": r["n_rows"]}
            )
    for (label, seed), r in m["blimp"].items():
        for task, sites in r["tasks"].items():
            for site, s in sites.items():
                out["blimp"].append(
                    {
                        "model": label,
                        "seed": seed,
                        "task": task,
                        "site": site,
                        "accuracy": float(np.mean(s["accuracy"])),
                        "layers": s["layers"],
                        "n_pairs": s["n_pairs"],
                        "skipped_pairs": r["skipped"].get(task, 0),
                    }
                )
    return out


def _mean_curve(metrics: Sequence[dict]) -> dict:
    """Loss vs FLOPs and tokens averaged over seeds (the seeds share one step grid), with the loss's
    min and max over seeds at each record as ``"low"``/``"high"`` (n_records,): the band
    `curve_band` names."""
    n = min(len(x["loss"]) for x in metrics)
    out = {k: np.mean([x[k][:n] for x in metrics], axis=0) for k in ("flops", "tokens", "loss")}
    losses = np.array([x["loss"][:n] for x in metrics])  # (seeds, records)
    return out | {"low": losses.min(0), "high": losses.max(0)}


def curve_band(n_seeds: int) -> str:
    """What the training-curve figures draw, in words (`_mean_curve`'s mean and band)."""
    return f"mean over {n_seeds} seeds, band: min-max over {n_seeds} seeds"


def tsne_embeddings(features: Mapping[tuple[str, int], tuple[dict, np.ndarray]], cfg: Size) -> dict:
    """t-SNE of a balanced sample of is/are/was/were values at four layers, for every (model, seed) of
    ``features`` ({(label, seed): ({layer: (n_tokens, dim)}, words (n_tokens,))}): {"<label>, seed <s>":
    ({layer: (n_points, 2)}, words (n_points,))}, ordered by seed, then model (one figure row each)."""
    from lime_probe.probes.separability import balance_classes
    from lime_probe.probes.tsne import tsne_layers

    out = {}
    for (label, seed), (feats, words) in sorted(features.items(), key=lambda kv: kv[0][1]):  # stable
        keep = balance_classes(
            words, seed=0, n_per_class=min(cfg.tsne_per_word, min(np.unique(words, return_counts=True)[1]))
        )
        layers = sorted(feats)
        picked = sorted({layers[0], layers[len(layers) // 3], layers[2 * len(layers) // 3], layers[-1]})
        out[f"{label}, seed {seed}"] = (
            tsne_layers(
                {la: feats[la][keep] for la in picked}, perplexity=min(30.0, len(keep) / 4), progress=False
            ),
            words[keep],
        )
    return out


def seed_bands(m: dict, kind: str, get: Callable[[dict], Sequence[float]], seeds, labels) -> dict:
    """Per model: the per-layer ``get(measurement)`` (layers,) averaged over seeds, with its min-max over
    seeds as the band: {label: {"layers", "mean", "low", "high"}}."""
    out = {}
    for label in labels:
        per = np.array([get(m[kind][label, s]) for s in seeds])  # (seeds, layers)
        out[label] = {
            "layers": m[kind][label, seeds[0]]["layers"],
            "mean": per.mean(0),
            "low": per.min(0),
            "high": per.max(0),
        }
    return out


def difference_series(diff: Sequence[dict], what: str, key: str = "layer") -> dict:
    """Per compared pair: its per-``key`` paired differences with their t-intervals,
    {"<model> - <reference>": {"layers", "mean", "low", "high"}} (the rows of `differences`)."""
    series = {}
    for pair in dict.fromkeys((r["model"], r["reference"]) for r in diff):
        rs = [
            r
            for r in diff
            if (r["model"], r["reference"]) == pair and r["measure"] == what and isinstance(r.get(key), int)
        ]
        if rs:
            series[" - ".join(pair)] = {
                "layers": [r[key] for r in rs],
                "mean": [r["diff_mean"] for r in rs],
                "low": [r["ci_low"] for r in rs],
                "high": [r["ci_high"] for r in rs],
            }
    return series


def interval_label(n_seeds: int) -> str:
    """What every difference figure's band is, in words."""
    return f"band: 95 % paired t-interval over {n_seeds} seeds"


def entropy_figure(m: dict, diff: Sequence[dict], seeds, labels) -> Any:
    """Value entropy per layer: each model's mean over seeds with its min-max band (left), and each
    model minus LLaMA per layer, paired by seed, with its 95 % paired t-interval (right)."""
    from matplotlib.figure import Figure

    from lime_probe.output import plots as F
    from lime_probe.probes.entropy import entropy_config

    with F.style():
        fig = Figure(figsize=(9.0, 3.6), layout="constrained")
        left, right = fig.subplots(1, 2)
    alpha = entropy_config(ENTROPY_PRESET).alpha
    # LLaMA last, so each model keeps its colour in the difference panel (colours follow the order)
    order = [label for label in labels if label != "LLaMA"] + ["LLaMA"]
    F.plot_layer_curves(
        seed_bands(m, "entropy", lambda r: np.mean(r["values"], axis=1), seeds, order),
        ylabel=f"matrix entropy (α={alpha:g}) [nats]",
        xlabel=F.layer_axis_label("values"),
        title=f"Value entropy per layer\n(mean, band: min-max over {len(seeds)} seeds)",
        ax=left,
    )
    F.plot_layer_curves(
        difference_series(diff, "value entropy"),
        ylabel="difference [nats]",
        xlabel=F.layer_axis_label("values"),
        baseline=0.0,
        baseline_label="no difference",
        title=f"Paired difference from LLaMA per layer\n(mean, {interval_label(len(seeds))})",
        ax=right,
    )
    return fig


def draw_per_layer(results: Path, m: dict, diff: Sequence[dict], seeds, labels: Sequence[str]) -> None:
    """The per-layer figures, each band labelled with what it is: value entropy (min-max over seeds)
    beside each model's paired difference from LLaMA (95 % paired t-interval); separability (min-max
    over seeds); both differences alone (95 % paired t-intervals). Needs only the per-run, per-layer
    means of ``m`` (so the committed per-run tables redraw them: figures/reanalysis.py)."""
    from lime_probe.output import plots as F

    F.save_figure(entropy_figure(m, diff, seeds, labels), results / "entropy_values")
    fig = F.plot_separability(
        seed_bands(m, "separability", lambda r: r["accuracy"], seeds, labels),
        site="values",
        words=WORDS,
        chance=0.25,
    )
    words = ", ".join(repr(w) for w in WORDS)
    fig.axes[0].set_title(f"Separability of {words}\n(values, mean, band: min-max over {len(seeds)} seeds)")
    F.save_figure(fig, results / "separability_values")
    for what, stem, ylabel, title in (
        ("value entropy", "entropy_difference", "entropy difference (nats)", "Value entropy"),
        ("separability", "separability_difference", "accuracy difference", "is/are/was/were separability"),
    ):
        series = difference_series(diff, what)
        minus = "LIMe - LLaMA" if len(series) == 1 else "model - LLaMA"
        fig = F.plot_layer_curves(
            series,
            ylabel=ylabel,
            baseline=0.0,
            baseline_label="no difference",
            title=f"{title}, {minus} per layer\n(mean, {interval_label(len(seeds))})",
        )
        F.save_figure(fig, results / stem)


def draw(
    results: Path,
    m: dict,
    diff: list[dict],
    seeds,
    curves: dict,
    tsne: dict,
    router,
    labels: Sequence[str] = tuple(MODELS),
) -> None:
    """The figures: the per-layer ones (`draw_per_layer`), loss vs FLOPs, t-SNE, router heatmaps."""
    from lime_probe.output import plots as F
    from lime_probe.specs import ANALYSES

    draw_per_layer(results, m, diff, seeds, labels)
    F.save_figure(F.plot_training_curves(curves, band=curve_band(len(seeds))), results / "loss_vs_flops")
    if tsne:
        F.save_figure(
            F.plot_tsne_grid(
                {k: v[0] for k, v in tsne.items()}, {k: list(v[1]) for k, v in tsne.items()}, site="values"
            ),
            results / "tsne_values",
        )
    for stem, fig in ANALYSES["router"].plot(router).items():
        F.save_figure(fig, results / stem)


CLAIMS = (
    ("perplexity", None, "LIMe reaches lower held-out perplexity (Sec. 5.1, Fig. 1: lower loss)"),
    ("value entropy", "mean", "LIMe's values keep higher matrix entropy (Fig. 2a), mean over layers"),
    (
        "separability",
        "upper half",
        "LIMe's values keep is/are/was/were more separable in the upper layers (Fig. 2b)",
    ),
    ("BLiMP probe (Table 2)", "values", "LIMe's values probe BLiMP better (Table 2)"),
    ("BLiMP probe (Table 2)", "hidden", "LIMe's hidden states probe BLiMP better (Table 2)"),
)


def format_p(p: float) -> str:
    """A p-value for a table: three significant digits, "<0.001" below that."""
    return "<0.001" if p < 0.001 else f"{p:.3g}"


def statistics_note(seeds: Sequence[int]) -> str:
    """The sentence every findings.md gives on the sign-flip p and the MDE at this many seeds."""
    n = len(seeds)
    return (
        f"Beside each interval: the t-test's p, the exact sign-flip permutation p (two-sided, all 2^{n} "
        f"sign patterns; its smallest possible value at {n} seeds is {format_p(2 / 2**n)}) and the minimum "
        f"detectable effect (MDE: the true difference a paired t-test at {n} seeds detects with 80 % power at "
        "5 %, given the observed paired std). A 'not resolved' difference smaller than its MDE says little "
        "either way."
    )


def exploratory_table(diff: Sequence[dict], measures: Sequence[str], alpha: float = 0.05) -> list[str]:
    """Markdown lines: per compared pair and measure, the layers whose exploratory difference has
    p < ``alpha`` unadjusted, after Holm and after BH, each split by sign."""

    def layers(rows: list[dict], key: str) -> str:
        hit = [r for r in rows if r[key] < alpha]
        parts = [
            f"{name}: {', '.join(str(r['layer']) for r in hit if (r['diff_mean'] > 0) == up)}"
            for name, up in (("higher", True), ("lower", False))
            if any((r["diff_mean"] > 0) == up for r in hit)
        ]
        return "; ".join(parts) or "none"

    lines = [
        f"| measure | difference | layers | p < {alpha:g}, unadjusted | Holm p < {alpha:g} | BH q < {alpha:g} |",
        "|---|---|---|---|---|---|",
    ]
    for measure in measures:
        for pair in dict.fromkeys((r["model"], r["reference"]) for r in diff):
            rows = [
                r
                for r in diff
                if (r["model"], r["reference"]) == pair
                and r["measure"] == measure
                and r["endpoint"] == "exploratory"
            ]
            if rows:
                lines.append(
                    f"| {measure} | {' - '.join(pair)} | {len(rows)} | {layers(rows, 'p_t')} | "
                    f"{layers(rows, 'p_holm')} | {layers(rows, 'q_bh')} |"
                )
    return lines


def _interval(r: dict) -> str:
    return f"{r['diff_mean']:+.4g} [{r['ci_low']:+.4g}, {r['ci_high']:+.4g}]"


def _tests(r: dict) -> str:
    return f"{format_p(r['p_t'])} | {format_p(r['p_sign_flip'])} | {r['mde']:.3g}"


def findings(
    diff: Sequence[dict],
    seeds: Sequence[int],
    compared: Sequence[str] = ("LIMe",),
    protocol: str | None = None,
) -> str:
    """findings.md: each of the paper's claims on its one primary endpoint (`CLAIMS`) with the measured
    difference, its paired t-interval, the t-test's and the sign-flip p, the MDE and the verdict; then,
    for the other models among ``compared``, the same endpoints as model minus LLaMA; then the per-layer
    differences as exploratory results, Holm- and BH-adjusted over layers. ``protocol`` names where the
    study's protocol is written (default: the repository's cpu-size study's)."""

    def row(label: str, measure: str, where: str | None) -> dict:
        return next(
            r
            for r in diff
            if r["model"] == label
            and r["measure"] == measure
            and r["endpoint"] != "exploratory"
            and where in (None, r.get("layer"), r.get("site"))
        )

    lines = [
        "# LIMe vs LLaMA at CPU scale: the paper's language-model findings",
        "",
        f"LIMe minus LLaMA, paired by seed over {len(seeds)} seeds ({', '.join(map(str, seeds))}). Each claim has "
        "one primary endpoint (the study's claim list, committed before its results: perplexity; value entropy "
        "averaged over all layers; separability averaged over the upper half of the layers; BLiMP probes on "
        "values; on hidden states), and its verdict comes from the 95 % paired t-interval over seeds: 'holds' "
        "when it excludes 0 with the paper's sign, 'reversed' when it excludes 0 with the other sign, else "
        f"'not resolved'. {statistics_note(seeds)} Protocol: {protocol or 'figures/lm-cpu/PROTOCOL.md'}.",
        "",
        "| claim (primary endpoint) | LIMe | LLaMA | difference [95 % paired t-interval] | p (t) | p (sign-flip) "
        "| MDE | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for measure, where, claim in CLAIMS:
        r = row("LIMe", measure, where)
        lines.append(
            f"| {claim} | {r['LIMe']:.4g} | {r['LLaMA']:.4g} | {_interval(r)} | {_tests(r)} | {r['verdict']} |"
        )
    baselines = [label for label in compared if label != "LIMe"]
    if baselines:
        lines += [
            "",
            "## The other models vs LLaMA (cross-layer baselines, ablations)",
            "",
            "Each model minus LLaMA on the same endpoints, paired by seed, 95 % paired t-interval over seeds. "
            "The paper states no sign for these, so the verdict only says which way a resolved difference goes.",
            "",
            "| measure | model | mean | LLaMA | difference [95 % paired t-interval] | p (t) | p (sign-flip) | MDE "
            "| verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for measure, where, _ in CLAIMS:
            for label in baselines:
                r = row(label, measure, where)
                lines.append(
                    f"| {measure}{f' ({where})' if where else ''} | {label} | {r[label]:.4g} | "
                    f"{r['LLaMA']:.4g} | {_interval(r)} | {_tests(r)} | {r['verdict']} |"
                )
    lines += [
        "",
        "## Per layer (exploratory)",
        "",
        "The per-layer differences were not pre-registered endpoints: one t-test per layer, adjusted over the "
        "layers of each model and measure with Holm (family-wise error 5 %) and Benjamini-Hochberg (false "
        "discovery rate 5 %). They carry no verdict. Every value (p_t, p_holm, q_bh, p_sign_flip, mde): "
        "differences.csv; the intervals: the *_difference figures.",
        "",
        *exploratory_table(diff, ("value entropy", "separability")),
    ]
    return "\n".join(lines) + "\n"
