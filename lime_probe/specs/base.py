"""What every analysis is made of: checkpoints in, a `Result` of numbers out, figures drawn apart.

An analysis is one `Spec`: its name (the command), a one-line help, a runnable example, a parameter
dataclass (the command-line options are generated from its fields, see `option`), ``compute`` and
``plot``. ``compute(checkpoints, data, params, extraction)`` returns a `Result` (tidy rows, structured
extras, a summary text) and draws nothing; ``plot(result)`` returns ``{file stem: Figure}``.

This module imports no probe, model or plotting library, so the registry (and ``lime-probe --help``)
stays cheap; each analysis imports what it uses when it runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lime_probe.extraction.settings import Extraction, Loading, option
from lime_probe.extraction.sites import SITES, check_site

# What an analysis's --data holds: texts (required or optional), a BLiMP dataset, clean/corrupt prompt pairs
# (given as --pairs), or nothing (the analysis reads the checkpoints' own run folders).
DataKind = Literal["texts", "optional-texts", "blimp", "pairs", "none"]


# The torch thread default (ours), measured on the 2-core machine (bench/RESULTS.md, "Thread default"):
# with OpenMP's default ACTIVE wait policy, 2 threads beside any other busy process ran an extraction at
# 10-105 seq/s against 234-936 at 1 thread (idle threads spin and steal the core the working one needs);
# with the PASSIVE policy 2 threads ran at 218-775, about as fast as 1.
FEW_CORES = 4

THREADS_HELP = (
    "torch CPU threads (default: 1 on a machine with fewer than 4 usable cores, else the cores the load "
    "average leaves free, at least 1; OpenMP's threads wait passively unless OMP_WAIT_POLICY is set: "
    "on 2 cores, 2 spinning threads beside one busy process ran 10-30x slower than 1 thread)"
)


def default_threads(cores: int, load: float) -> int:
    """The torch thread count for a machine with ``cores`` usable cores and a 1-minute load average of
    ``load`` (ours; see `THREADS_HELP`): 1 below `FEW_CORES` cores (a second thread there gains little
    and costs much when anything else runs), else the cores the load leaves free, at least 1."""
    if cores < FEW_CORES:
        return 1
    return max(1, min(cores, cores - math.ceil(load)))


def configure_threads(requested: int | None) -> int:
    """Set torch's CPU threads to ``requested``, or to `default_threads` of this machine, and return the
    count in effect. Before torch is first imported it also sets ``OMP_WAIT_POLICY=PASSIVE`` unless the
    environment sets a policy (OpenMP reads it once, when torch loads it)."""
    import os
    import sys

    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    if requested is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        requested = min(torch.get_num_threads(), default_threads(cores, load))
    torch.set_num_threads(requested)
    return torch.get_num_threads()


def seed_option() -> Any:
    """The ``seed`` field every seeded analysis shares (one ``--seed`` in ``report``)."""
    return option(0, "seed for sampling, folds, t-SNE and the bootstrap CI")


@dataclass
class Checkpoint:
    """A loaded checkpoint: its label in tables and legends, its path or hub id, model and tokenizer, and the
    hub revision it was loaded at (None: a local folder, or the hub's default branch)."""

    label: str
    source: str
    model: Any
    tokenizer: Any
    revision: str | None = None

    @property
    def config(self) -> Any:
        """The Hugging Face config (``model`` may be an nnsight wrapper)."""
        return getattr(self.model, "_module", self.model).config


def labels_for(ckpts: Sequence[str], labels: Sequence[str] | None) -> list[str]:
    """One label per checkpoint: the given ones, or each path's last component; must be unique."""
    if labels and len(labels) != len(ckpts):
        raise ValueError(
            f"got {len(labels)} --label for {len(ckpts)} --ckpt; give one label per checkpoint or none"
        )
    out = list(labels) if labels else [Path(c.rstrip("/")).name or c for c in ckpts]
    dupes = sorted({x for x in out if out.count(x) > 1})
    if dupes:
        raise ValueError(f"checkpoint labels must be unique, {dupes} repeats; name them with --label")
    return out


def named_checkpoints(ckpts: Sequence[str], labels: Sequence[str] | None) -> list[Checkpoint]:
    """The checkpoints named but not loaded (model and tokenizer None), for analyses that read only their
    run folders (``data_kind="none"``)."""
    return [Checkpoint(lb, c, None, None) for lb, c in zip(labels_for(ckpts, labels), ckpts, strict=True)]


def load_checkpoints(
    ckpts: Sequence[str], labels: Sequence[str] | None, loading: Loading | str | None = None
) -> list[Checkpoint]:
    """Load every checkpoint with ``lime_probe.load`` as ``loading`` says (a device name: `Loading` on that
    device; None: `Loading`'s defaults), each at its hub revision (``revisions_for``); errors name the
    offending path, library loading chatter only with ``loading.verbose``."""
    names = labels_for(ckpts, labels)
    from lime_probe.extraction.loading import load, revisions_for

    how = Loading(device=loading) if isinstance(loading, str) else loading or Loading()
    out = []
    for label, ckpt, rev in zip(names, ckpts, revisions_for(ckpts, how.revision), strict=True):
        model, tok = load(
            ckpt,
            device=None if how.device_map else how.device,
            dtype=how.dtype,
            device_map=how.device_map,
            revision=rev,
            verbose=how.verbose,
        )
        out.append(Checkpoint(label, ckpt, model, tok, rev))
    return out


@dataclass
class Result:
    """What one analysis computed: numbers only.

    ``rows`` is the flat table (written as CSV and JSON), ``extra`` structured results that do not fit a
    table (matrices, per-head maps; written to the JSON), ``context`` what the figures need besides
    (class order, site; not written), ``columns`` the compact table's columns (default: all) or
    ``summary`` the compact table itself where rows are too many to show; ``tables`` further tables
    written as their own JSON + CSV and shown in the report, ``{file stem: rows}``.
    """

    analysis: str  # the registry name of the spec whose ``plot`` draws it
    name: str  # file stem of its results, e.g. "entropy_values"
    title: str
    rows: list[dict]
    text: str = ""
    extra: dict = field(default_factory=dict)
    context: dict = field(default_factory=dict)
    columns: tuple[str, ...] = ()
    summary: list[dict] | None = None
    tables: dict[str, list[dict]] = field(default_factory=dict)

    def table(self) -> list[dict]:
        """The rows shown on the terminal and in the report."""
        if self.summary is not None:
            return self.summary
        return [{c: r.get(c) for c in self.columns} for r in self.rows] if self.columns else self.rows


@dataclass(frozen=True)
class Spec:
    """One analysis, declared once: the CLI, ``report``, the demo, the notebooks and the tests read it.

    ``compute(checkpoints, data, params, extraction)``: ``data`` as ``data_kind`` says (texts, a BLiMP
    dataset or None), ``params`` an instance of ``params``, ``extraction`` the size limits, layers and
    cache (an `Extraction`; an analysis that reads no data ignores it). ``applies(checkpoint)``
    says whether ``report`` runs it on a checkpoint (the router analysis: LIMe checkpoints only), and
    ``applies_to`` names those checkpoints in words, for the line saying none of them is one.
    ``streams(params)`` says whether ``compute`` reads its texts only in order, one pass per checkpoint
    (e.g. per-document extraction): the command line then hands it a lazily read `Corpus` instead of a
    list; analyses that pack or sample the whole corpus up front keep a list.
    ``notebook`` is the stem of its notebook in analyses/. ``in_report``: whether ``report`` offers it (the
    interventions, which run a forward pass per cell or cut, are commands of their own). ``min_length``:
    the fewest tokens per sequence it can measure (the logit lens: 2, a prediction and the token it predicts).
    """

    name: str
    help: str
    example: str
    params: type
    compute: Callable[..., Result]
    plot: Callable[[Result], dict]
    data_kind: DataKind = "texts"
    notebook: str = ""
    applies: Callable[[Checkpoint], bool] = lambda ck: True
    streams: Callable[[Any], bool] = lambda params: False
    max_sequences: int = 64  # default --max-sequences (word probes need more text)
    in_report: bool = True
    applies_to: str = ""
    min_length: int = 1

    def run(
        self, cks: Sequence[Checkpoint], data: Any = None, extraction: Extraction | None = None, **params: Any
    ) -> Result:
        """``compute`` with ``params`` given as keywords (defaults for the rest) and ``extraction``'s settings
        (None: `Extraction`'s defaults)."""
        return self.compute(cks, data, self.params(**params), extraction or Extraction())


def extract_site(
    ck: Checkpoint,
    texts: Iterable[str | list[int]],
    site: str | Sequence[str],
    extraction: Extraction | None = None,
    **kw,
):
    """``lime_probe.extract`` of one site (or several, in one pass) for one checkpoint under ``extraction``'s
    settings (size limits, cache, layers; None: `Extraction`'s defaults), ``kw`` overriding them or adding
    other ``extract`` keywords. ``texts`` may be a list or an iterable read block by block (a `Corpus`, a
    dataset)."""
    from lime_probe.extraction.tracing import extract

    sites = [site] if isinstance(site, str) else list(site)
    for s in sites:
        check_site(s)
    settings = (extraction or Extraction()).extract_kwargs()
    return extract(ck.model, ck.tokenizer, texts, sites=sites, **{**settings, **kw})


# a --site's help: what it may name beyond the listed sites
SITE_HELP = f"one of {', '.join(SITES)}, or module:PATH[:input] (any module, {{i}} = each block)"


def value_site_option() -> Any:
    """The ``site`` field of the value probes (entropy, separability, t-SNE); None: `value_sites`'s default."""
    return option(
        None,
        "representation to probe (default: values, the W_V output, and for a model that routes also "
        f"routed_values, what its heads attend to): {SITE_HELP}",
        type=check_site,
        metavar="SITE",
    )


def value_sites(ck: Checkpoint, site: str | None) -> list[str]:
    """The sites a value probe measures on ``ck``: ``[site]`` when given; by default ``values`` (the W_V output,
    paper Sec. 5.3) and, for a model that routes (its adapter has ``routed_values``, i.e. LIMe with routing),
    ``routed_values`` (the official analysis's values). Other models have no routed values: only ``values``."""
    if site is not None:
        return [site]
    from lime_probe.extraction.adapters import adapter_for

    routed = "routed_values" in adapter_for(ck.model).block_sites(ck.config)
    return ["values", "routed_values"] if routed else ["values"]


def site_label(site: str) -> str:
    """A site as tables and legends name it: the two value sites spelled out, others by name."""
    from lime_probe.protocol import SITE_LABELS

    return SITE_LABELS.get(site, site)


def sites_text(rows: Sequence[dict]) -> str:
    """The sites of ``rows`` in words, for a result's text: "values (W_V output) and, for LIMe, routed values
    (what LIMe's heads attend to)" (a site measured on only some models names them)."""
    models = list(group(rows, "model"))
    parts = []
    for site, rs in group(rows, "site").items():
        measured = list(group(rs, "model"))
        parts.append(("" if measured == models else f"for {', '.join(measured)}, ") + site_label(site))
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def routing_note(rows: Sequence[dict], default: bool) -> str:
    """With ``default`` (the sites came from `value_sites`), a sentence naming the models of ``rows`` that do
    not route, hence have no routed values; "" otherwise."""
    routed = {r["model"] for r in rows if r["site"] == "routed_values"}
    plain = [m for m in group(rows, "model") if m not in routed]
    if not default or not plain:
        return ""
    return f" No routing in {', '.join(plain)}: its heads attend to the W_V output itself, so only that is shown."


def site_curves(rows: Sequence[dict], value: str, **band: str) -> dict[str, dict[str, list]]:
    """Per-layer curves (`curve`) keyed by model, or by "model: site label" when ``rows`` hold several sites;
    site by site, so the first two curves compare two models at the first site (the W_V output)."""
    by_site = group(rows, "site")
    return {
        (m if len(by_site) == 1 else f"{m}: {site_label(site)}"): curve(rs, value, **band)
        for site, in_site in by_site.items()
        for m, rs in group(in_site, "model").items()
    }


# Fewest rows of each class a test fold of a separability probe may hold (ours): below it a fold's accuracy
# moves in steps of more than 1/40 on the four default words and its standard error is over 0.08 at 50 %
# accuracy, larger than the LIMe vs LLaMA differences the probe is read for. The paper's 1,668 per word
# give 333 per word per fold.
MIN_PER_CLASS_PER_FOLD = 10


def check_words(words: Sequence[str]) -> None:
    """ValueError unless ``words`` are at least two distinct non-empty words (a probe tells them apart); a
    parameter check, run before any data or model is read."""
    if any(not isinstance(w, str) or not w for w in words):
        raise ValueError(f"--words must be non-empty strings, got {list(words)!r}")
    repeated = sorted({w for w in words if list(words).count(w) > 1})
    if repeated:
        raise ValueError(f"--words repeats {', '.join(map(repr, repeated))}: give each word once")
    if len(words) < 2:
        raise ValueError(f"--words needs at least two distinct words to tell apart, got {list(words)!r}")


def check_probe_sample(labels, n_splits: int, allow: bool, what: str) -> None:
    """Refuse (ValueError) a probe whose class-balanced sample of ``labels`` (n,) holds fewer than
    `MIN_PER_CLASS_PER_FOLD` rows of each class per test fold of ``n_splits``-fold cross-validation; with
    ``allow`` a `lime_probe.extraction.windows.DataWarning` instead."""
    import warnings

    import numpy as np

    from lime_probe.extraction.windows import DataWarning

    n = int(np.unique(labels, return_counts=True)[1].min()) if len(labels) else 0
    if n >= MIN_PER_CLASS_PER_FOLD * n_splits:
        return
    message = (
        f"{what}: {n} occurrences per word after balancing, {n / n_splits:.1f} per word in each of the "
        f"{n_splits} test folds (fewer than {MIN_PER_CLASS_PER_FOLD}): accuracies on so few rows mean little"
    )
    if not allow:
        raise ValueError(f"{message}; give more data (--data, --max-sequences) or --allow-small-samples")
    warnings.warn(message, DataWarning, stacklevel=2)


def check_class_counts(labels, classes: Sequence, minimum: int, what: str) -> None:
    """ValueError naming every class of ``classes`` with fewer than ``minimum`` rows in ``labels`` (n,)."""
    import numpy as np

    found = dict(zip(*np.unique(labels, return_counts=True), strict=True)) if len(labels) else {}
    short = {c: int(found.get(c, 0)) for c in classes if found.get(c, 0) < minimum}
    if short:
        counts = ", ".join(f"{c!r}: {n}" for c, n in short.items())
        raise ValueError(
            f"{what} too rare in the data (need at least {minimum} each): {counts}; "
            "give more data (--data, --max-sequences) or other words"
        )


def slug(label: str) -> str:
    """A file-name-safe form of a checkpoint label."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


def group(rows: Sequence[dict], key: str) -> dict[Any, list[dict]]:
    """Tidy rows grouped by the value of ``key``, groups and rows in first-seen order."""
    out: dict[Any, list[dict]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def curve(rows: Sequence[dict], value: str, **band: str) -> dict[str, list]:
    """A per-layer curve of ``figures.plot_layer_curves`` from one curve's rows: ``{"layers", "mean",
    **band}``, e.g. ``band={"std": "accuracy_std"}`` or ``{"low": "ci_low", "high": "ci_high"}``."""
    return {"layers": [r["layer"] for r in rows], "mean": [r[value] for r in rows]} | {
        name: [r[col] for r in rows] for name, col in band.items()
    }
