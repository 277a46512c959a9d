"""The one runner of every study: train or reuse the runs, measure each through its analysis, compare.

Layout of ``out``::

    train/{label}-s{seed}/             lime-model runs: reused when finished, resumed when interrupted
    measure/{measure}/{run}-{key}.json  one measure of one run (rows, tables, extra), reused when present;
                                        ``key`` digests the analysis, its parameters, the data and the run
    measure/{measure}/s{seed}-{key}/    a per-seed measure's results and figures (t-SNE, routers)
    results/                           tables, figures and findings.md (`lime_probe.studies.findings`)

Training is seed-major and each seed's runs are measured before the next seed trains, so a study
stopped early holds whole seeds, measured; a rerun continues where it stopped. Every number comes from
a `Spec` of the registry, exactly as ``lime-probe ANALYSIS`` computes it.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lime_probe.extraction.settings import Extraction

from .study import Measure, Study

# A study's ``--data`` folder, by its `Study.data`: (the training text, the held-out text the measures
# read), each relative to the folder, which also holds blimp/. WikiText-2 trains on valid.txt and is
# measured on test.txt; FineWeb-Edu is a folder of the training shards (parquet or jsonl, tokenised once
# by ``lime-model prepare``) and a file of held-out documents never trained on.
LAYOUTS = {
    "wikitext": ("wikitext-2/valid.txt", "wikitext-2/test.txt"),
    "fineweb-edu": ("fineweb-edu/train", "fineweb-edu/test.jsonl"),
}


@dataclass(frozen=True)
class Data:
    """The shared data a language-model study reads: its training text, held-out text, BLiMP (`LAYOUTS`)."""

    train: Path
    test: Path
    blimp: Path

    @functools.cached_property
    def test_texts(self) -> list[str]:
        """The documents of ``test``, read once for every measure that reads them."""
        from lime_probe.specs.data import load_data

        return load_data("texts", str(self.test))

    @functools.cached_property
    def digests(self) -> dict[str, list[list[str]]]:
        """``{"test": [[name, sha256]], "blimp": [[name, sha256], ...]}``: the content of the files the
        measures read, for their cache keys. Content, not modification times: a copied or re-provisioned
        data folder keeps every cached measurement."""
        import hashlib

        def digest(files: list[Path]) -> list[list[str]]:
            return [[f.name, hashlib.sha256(f.read_bytes()).hexdigest()] for f in files]

        return {"test": digest([self.test]), "blimp": digest(sorted(self.blimp.glob("*.jsonl")))}

    @classmethod
    def under(cls, root: str | os.PathLike, layout: str = "wikitext") -> Data:
        root = Path(root)
        train, test = LAYOUTS[layout]
        data = cls(root / train, root / test, root / "blimp")
        for path in (data.train, data.test, data.blimp):
            if not path.exists():
                raise FileNotFoundError(
                    f"data not found: {path} (--data names the folder holding {train}, {test} and blimp/)"
                )
        return data


def run_name(label: str, seed: int) -> str:
    return f"{label.lower()}-s{seed}"


class Progress:
    """One line per step with the elapsed time and an estimate of what is left: the mean time of the
    steps that did work (a reused step takes no time and would skew the mean)."""

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


def finished(run: Path) -> bool:
    """Whether ``run`` is a complete lime-model run: its metrics reached the recipe's last step."""
    metrics, recipe = run / "metrics.jsonl", run / "recipe.json"
    if not (recipe.is_file() and metrics.is_file() and (run / "config.json").is_file()):
        return False
    lines = metrics.read_text().strip().splitlines()
    return bool(lines) and json.loads(lines[-1])["step"] == json.loads(recipe.read_text())["steps"]


def train_seed(
    study: Study, out: Path, seed: int, data: Data | None, progress: Progress, reproducible: bool = False
) -> dict[str, Path]:
    """Train every model of ``study`` at ``seed`` that is not finished; returns {label: run folder}. A run
    trained in the other mode (``reproducible``) is refused, finished or not."""
    from lime_model.reproducible import check_same_mode
    from lime_model.train import SecondEpochWarning, train

    runs: dict[str, Path] = {}
    for label, declared in study.models.items():
        # "{run:LABEL}": the run of a model declared before, of this seed (a run that starts from it)
        overrides = {k: v if (ref := _reference(v)) is None else str(runs[ref]) for k, v in declared.items()}
        run = out / "train" / run_name(label, seed)
        check_same_mode(run, reproducible)
        done = finished(run)
        progress.step(f"training {label} seed {seed}", reused=done)
        if not done:
            extra: dict[str, Any] = {"data": str(data.train)} if data is not None else {}
            with warnings.catch_warnings():  # the arithmetic recipes repeat their expressions by design
                warnings.simplefilter("ignore", SecondEpochWarning)
                train(
                    study.recipe,
                    run,
                    resume=(run / "recipe.json").is_file(),
                    seed=seed,
                    **extra,
                    **{**study.overrides, **overrides},
                )
        runs[label] = run
    return runs


# --------------------------------------------------------------------------- measuring


def measure_key(m: Measure, fingerprints: Sequence[str], data: Data | None) -> str:
    """A digest of everything a measurement depends on: the analysis and its parameters, the data (its
    files' content, `Data.digests`) and each run's identity (``fingerprints``: `checkpoint_identity`'s, of config and weights)."""
    from lime_model.digests import texts_hash

    source = {"test": "test", "test-windows": "test", "blimp": "blimp"}.get(m.data)
    files = data.digests[source] if source is not None and data is not None else []
    what = {"measure": asdict(m), "data": files, "runs": list(fingerprints)}
    return texts_hash([json.dumps(what, sort_keys=True, default=str)])[:12]


def cached(path: Path, compute: Callable[[], dict]) -> dict:
    """The JSON at ``path``; ``compute()`` written there (atomically) first if it is not there."""
    from lime_probe.output.results import atomic_write_text, to_jsonable

    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    atomic_write_text(path, json.dumps(to_jsonable(value)))
    return value


def measure_data(m: Measure, spec, ck, run: Path, data: Data | None) -> tuple[Any, Extraction]:
    """What ``m`` reads for checkpoint ``ck`` and the extraction settings that go with it: what the data
    needs, then the measure's own ``extract``, without the activation cache."""

    def settings(**needed: Any) -> Extraction:
        return Extraction(**{**needed, "cache_dir": None, **m.extract})

    if m.data == "none":
        return None, settings()
    if m.data == "expressions":
        from lime_model.recipes import load_recipe
        from lime_model.tasks.arithmetic import recipe_splits
        from lime_probe.studies.demo import sample_text

        recipe = load_recipe(str(run / "recipe.json"))
        _, test = recipe_splits(recipe, with_train=False)
        return [sample_text(s, ck.tokenizer) for s in test[: m.max_texts]], settings(
            max_length=recipe.seq_len
        )
    if data is None:
        raise ValueError(f"measure {m.analysis!r} reads {m.data!r}: the study needs --data")
    if m.data == "blimp":
        from lime_probe.specs.data import load_data

        return load_data("blimp", str(data.blimp), params=spec.params(**m.params)), settings()
    texts = data.test_texts[: m.max_texts]
    if m.data == "test":
        return texts, settings()
    from lime_probe.extraction.windows import max_positions, token_windows

    window = max_positions(ck.model)
    if window is None:
        raise ValueError(f"{ck.label} states no maximum length to cut windows of")
    return token_windows(texts, ck.tokenizer, window, None), settings(max_length=window, pretokenized=True)


def _reference(value: Any) -> str | None:
    """LABEL of a ``"{run:LABEL}"`` parameter value, else None."""
    ok = isinstance(value, str) and value.startswith("{run:") and value.endswith("}")
    return value[5:-1] if ok else None


def run_references(m: Measure) -> list[str]:
    """The models whose run of the same seed ``m``'s parameters name as ``"{run:LABEL}"`` (e.g. the
    router of the mixing null), in order."""
    return [label for v in m.params.values() if (label := _reference(v)) is not None]


def with_runs(m: Measure, runs: Mapping[str, Path]) -> Measure:
    """``m`` with each ``"{run:LABEL}"`` parameter replaced by the path of that model's run (``runs``)."""
    from dataclasses import replace

    params = {k: v if (label := _reference(v)) is None else str(runs[label]) for k, v in m.params.items()}
    return replace(m, params=params)


def run_measure(m: Measure, cks: list, runs: Sequence[Path], data: Data | None):
    """``m``'s analysis on the checkpoints ``cks`` (their runs ``runs``): a `Result`."""
    from lime_probe.specs import ANALYSES

    spec = ANALYSES[m.analysis]
    source, extraction = measure_data(m, spec, cks[0], runs[0], data)
    return spec.compute(cks, source, spec.params(**m.params), extraction)


def measure_runs(
    study: Study,
    out: Path,
    seed: int,
    runs: Mapping[str, Path],
    data: Data | None,
    device: str,
    progress: Progress,
) -> dict[str, dict[str, dict]]:
    """Every measure of ``study`` on the runs of one seed: the per-run ones ({measure: {label: {"rows",
    "tables", "extra"}}}, cached as JSON) and the per-seed ones (written with their figures under
    ``measure/``)."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.provenance import checkpoint_identity
    from lime_probe.specs import ANALYSES, Checkpoint, write_analysis

    fingerprints = {label: checkpoint_identity(run)["fingerprint"] for label, run in runs.items()}
    opened: dict[str, Checkpoint] = {}  # loaded once per seed, on the first measure that misses its cache

    def checkpoint(label: str, analysis: str) -> Checkpoint:
        if ANALYSES[analysis].data_kind == "none":  # reads the run folder only
            return Checkpoint(label, str(runs[label]), None, None)
        if label not in opened:
            opened[label] = Checkpoint(label, str(runs[label]), *load(runs[label], device=device))
        return opened[label]

    measured: dict[str, dict[str, dict]] = {name: {} for name, m in study.measures.items() if m.per == "run"}
    for label, run in runs.items():
        todo = {
            name: m for name, m in study.measures.items() if m.per == "run" and label in (m.models or runs)
        }
        paths = {
            name: out
            / "measure"
            / name
            / f"{run.name}-{measure_key(m, [fingerprints[x] for x in [label, *run_references(m)]], data)}.json"
            for name, m in todo.items()
        }
        progress.step(
            f"measuring {label} seed {seed}: {', '.join(todo)}",
            reused=all(p.is_file() for p in paths.values()),
        )
        for name, m in todo.items():

            def compute(m=m, label=label, run=run) -> dict:
                result = run_measure(with_runs(m, runs), [checkpoint(label, m.analysis)], [run], data)
                return {"rows": result.rows, "tables": result.tables, "extra": result.extra}

            measured[name][label] = cached(paths[name], compute)
    for name, m in study.measures.items():
        if m.per != "seed":
            continue
        labels = [label for label in runs if label in (m.models or runs)]
        folder = out / "measure" / name / f"s{seed}-{measure_key(m, [fingerprints[x] for x in labels], data)}"
        done = (folder / "done").is_file()
        progress.step(f"{name} of seed {seed}: {', '.join(labels)}", reused=done)
        if not done:
            cks = [checkpoint(x, m.analysis) for x in labels]
            result = run_measure(m, cks, [runs[x] for x in labels], data)
            write_analysis(result, folder, {"study": study.name, "seed": seed, "measure": asdict(m)})
            (folder / "done").write_text("")
    # a traced model sits in a reference cycle (nnsight's) that only the cyclic collector frees: without
    # this a study on a GPU would keep seed after seed's models on the device until it ran
    opened.clear()
    gc.collect()
    return measured


# --------------------------------------------------------------------------- the command


def apply_mode(reproducible: bool, name: str) -> None:
    """Enter the reproducible mode, or check that this process is not in it (its pins cannot be undone
    once torch has loaded them); a one-line ValueError where the process cannot run the study's mode."""
    from lime_model import reproducible as mode

    if reproducible:
        mode.enable()
    elif mode.active():
        raise ValueError(
            f"study {name} runs without the reproducible mode, but this process is in it: run it in a new "
            "process (or with --reproducible)"
        )


def run_study(
    name: str | Study,
    *,
    data: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    results: str | os.PathLike | None = None,
    seeds: Sequence[int] | None = None,
    size: str = "full",
    device: str = "cpu",
    reproducible: bool | None = None,
) -> Path:
    """Train or reuse the runs of study ``name`` (a key of `STUDIES`, or a `Study`), measure them, compare,
    and write ``results`` (default ``out/results``; ``out`` default ``runs/NAME``). ``seeds`` replaces the
    declared seeds (at least two: the interval needs a spread), e.g. the complete seeds of a study stopped
    early. ``size="tiny"`` is the study's smoke size. ``reproducible`` overrides the study's mode
    (`Study.reproducible`); the mode can only be entered before torch loads (`lime_model.reproducible`),
    as ``lime-probe reproduce`` does. Returns the results folder."""
    from lime_model.files import check_writable
    from lime_probe.studies.catalog import STUDIES
    from lime_probe.studies.findings import write_findings

    if isinstance(name, str):
        if name not in STUDIES:
            raise ValueError(f"unknown study {name!r}; choose from {', '.join(STUDIES)}")
        name = STUDIES[name]
    study = name.sized(size)
    seeds = tuple(study.seeds if seeds is None else seeds)
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be at least two distinct integers, got {list(seeds)}")
    if study.data is not None and data is None:
        train, test = LAYOUTS[study.data]
        raise ValueError(f"study {study.name} needs --data (the folder holding {train}, {test} and blimp/)")
    if not study.needs_data and data is not None:
        raise ValueError(f"study {study.name} makes its own data; leave out --data")
    shared = Data.under(data, study.data) if data is not None and study.data is not None else None
    out = Path(out) if out is not None else Path("runs") / study.name
    results = Path(results) if results is not None else out / "results"
    check_writable(out, folder=True, option="--out")
    check_writable(results, folder=True, option="--results")
    mode = study.reproducible if reproducible is None else reproducible
    apply_mode(mode, study.name)
    per_seed = len(study.models) + sum(m.per == "seed" for m in study.measures.values())
    progress = Progress(len(seeds) * (len(study.models) + per_seed) + 1)
    runs: dict[tuple[str, int], Path] = {}
    measured: dict[str, dict[tuple[str, int], dict]] = {}
    for seed in seeds:
        trained = train_seed(study, out, seed, shared, progress, mode)
        runs |= {(label, seed): run for label, run in trained.items()}
        for name, per_label in measure_runs(study, out, seed, trained, shared, device, progress).items():
            measured.setdefault(name, {}).update({(label, seed): v for label, v in per_label.items()})
    progress.step("comparing and writing the results")
    write_findings(study, results, seeds, runs, measured, out)
    return results
