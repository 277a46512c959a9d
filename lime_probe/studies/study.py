"""A study, declared as data: the models it trains over which seeds, what it measures on every run
(analyses of the registry, with their parameters), and the claims it tests, each fixed before its runs.

    Study(
        name="lm-cpu", question="...", recipe="wikitext-cpu", seeds=(0, 1, 2),
        models={"LIMe": {"routing": "full"}, "LLaMA": {"routing": "none"}},
        measures={"entropy": Measure("entropy", {"num_windows": 256})},
        claims=(Claim("LIMe", "LLaMA", VALUE_ENTROPY, sign=+1, text="..."),),
    )

`lime_probe.studies.runner.run_study` trains or reuses every (model, seed) run, measures each through
its `Spec` (cached per run and measure), reads each claim's endpoint per run and compares; nothing here
imports torch, so the registry of studies (and ``lime-probe --help``) stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# What a measure reads: the held-out text as documents or as every non-overlapping token window of the
# model's length ("test-windows", as training packs text), BLiMP, the run's own held-out arithmetic
# expressions (one per sequence, as in training), or nothing but the run folder.
DataSource = Literal["test", "test-windows", "blimp", "expressions", "none"]
Role = Literal["primary", "secondary", "exploratory"]  # a claim's role
ROLES = ("primary", "secondary", "exploratory")
LARGEST = "largest"  # an `Endpoint.where` value: the largest value of that key present (the hardest tier)


@dataclass(frozen=True)
class OfLargest:
    """An `Endpoint.where` value: ``fraction`` of the largest value of that key present, e.g. step 15,000
    of a 20,000-step run as ``OfLargest(0.75)``, so that a smoke run's shorter curve is read at the same
    point of it."""

    fraction: float

    def __str__(self) -> str:
        return f"{self.fraction:g} x the largest"


def _resolved(value: Any, key: str, rows: Sequence[Mapping]) -> Any:
    """``value`` of `Endpoint.where` as the value of ``key`` it names in ``rows`` (`LARGEST`, `OfLargest`)."""
    if value != LARGEST and not isinstance(value, OfLargest):
        return value
    top = max((r[key] for r in rows if key in r), default=None)
    if top is None:
        return value
    return top if value == LARGEST else top * value.fraction


@dataclass(frozen=True)
class Measure:
    """One analysis of the registry (``analysis``, a key of `lime_probe.specs.ANALYSES`) with its
    ``params``, run on ``data``. ``extract`` sets fields of its `Extraction` (e.g. ``{"max_length": 24}``).
    ``max_texts``: only the first texts of the data. A parameter ``"{run:LABEL}"`` is the path of model
    LABEL's run of the same seed (the mixing null's router); its weights join the measurement's cache key. ``per="run"``: each run alone, cached per run (what endpoints read); ``per="seed"``: the runs of
    ``models`` of one seed together, a descriptive figure per seed (t-SNE, routers)."""

    analysis: str
    params: Mapping[str, Any] = field(default_factory=dict)
    data: DataSource = "test"
    extract: Mapping[str, Any] = field(default_factory=dict)
    per: Literal["run", "seed"] = "run"
    models: tuple[str, ...] | None = None  # default: every model of the study
    max_texts: int | None = None  # the first texts of ``data`` only (default: all)


@dataclass(frozen=True)
class Endpoint:
    """A number per run, read from the rows of one measure: the rows matching ``where``, their
    ``value`` column, averaged over the keys ``over`` (nested, the last key first: ("paradigm", "layer")
    is each paradigm's mean over layers, then the mean over paradigms). ``part="upper half"`` keeps only
    the upper half of the first key's sorted values. ``scale`` and ``unit`` are for display only."""

    name: str
    measure: str
    value: str
    where: Mapping[str, Any] = field(default_factory=dict)
    over: tuple[str, ...] = ()
    part: Literal["all", "upper half"] = "all"
    scale: float = 1.0
    unit: str = ""

    def rows(self, rows: Sequence[Mapping]) -> list[Mapping]:
        where = {k: _resolved(v, k, rows) for k, v in self.where.items()}
        out = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
        if self.part == "upper half":
            keys = sorted({r[self.over[0]] for r in out})
            upper = set(keys[len(keys) // 2 :])
            out = [r for r in out if r[self.over[0]] in upper]
        if not out:
            raise ValueError(
                f"endpoint {self.name!r}: no row of measure {self.measure!r} matches {dict(self.where)}"
            )
        return out

    def of(self, rows: Sequence[Mapping]) -> float:
        """The endpoint of one run from its measure's ``rows``."""
        return _nested_mean(self.rows(rows), self.value, self.over)

    def per(self, key: str, rows: Sequence[Mapping]) -> dict[Any, float]:
        """One value per ``key`` (e.g. per layer): ``{key value: endpoint of the rows with that value}``."""
        groups: dict[Any, list[Mapping]] = {}
        for r in self.rows(rows):
            groups.setdefault(r[key], []).append(r)
        rest = tuple(k for k in self.over if k != key)
        return {k: _nested_mean(g, self.value, rest) for k, g in groups.items()}

    def label(self, per: str | None = None) -> str:
        """How tables name it: the name, the filter and what is averaged, e.g. "value entropy (values; mean
        over layers)"; ``per``: read per that key (exploratory), so nothing is averaged over it."""
        bits = [
            f"largest {k}" if v == LARGEST else f"{k} {v}" if isinstance(v, OfLargest) else str(v)
            for k, v in self.where.items()
        ]
        if self.over and per is None:
            over = " and ".join(f"{k}s" for k in self.over)  # the keys are singular: "layer"
            bits.append("upper half" if self.part == "upper half" else f"mean over {over}")
        return f"{self.name} ({'; '.join(bits)})" if bits else self.name


def _nested_mean(rows: Sequence[Mapping], value: str, over: tuple[str, ...]) -> float:
    import numpy as np

    if not over:
        if len(rows) != 1:
            raise ValueError(f"{len(rows)} rows where one was expected: say what to average over")
        return float(rows[0][value])
    groups: dict[Any, list[Mapping]] = {}
    for r in rows:
        groups.setdefault(r[over[0]], []).append(r)
    return float(np.mean([_nested_mean(g, value, over[1:]) for _, g in sorted(groups.items(), key=str)]))


@dataclass(frozen=True)
class Effect:
    """A per-seed difference used as one side of a comparison (the 2 x 2's interaction): ``model``
    minus ``reference``, shown as ``name``."""

    name: str
    model: str
    reference: str


@dataclass(frozen=True)
class Claim:
    """``model`` minus ``reference`` on ``endpoint``, paired by seed; either side may be an `Effect`.

    ``role``: "primary" (the one pre-registered endpoint of a claim), "secondary", or "exploratory" (one
    test per value of ``per``, e.g. per layer, Holm- and BH-adjusted over them, no verdict; without
    ``per``, one endpoint read alone, outside every Holm family, no verdict). ``sign``:
    the direction stated in advance (+1: model higher), None for a two-sided question.
    ``reference_endpoint``: the reference's own endpoint where the two sides are read at different
    sites (the official analysis compares LIMe's routed values with LLaMA's values); default ``endpoint``."""

    model: str | Effect
    reference: str | Effect
    endpoint: Endpoint
    role: Role = "primary"
    sign: int | None = None
    text: str = ""
    per: str | None = None
    reference_endpoint: Endpoint | None = None

    @property
    def endpoints(self) -> tuple[Endpoint, Endpoint]:
        """(the model's endpoint, the reference's)."""
        return self.endpoint, self.reference_endpoint or self.endpoint

    def label(self) -> str:
        """The endpoint as tables name it; a cross-site comparison names both sites, model's first."""
        e, r = self.endpoints
        if r is e:
            return e.label(self.per)
        return f"{e.label(self.per)} vs {r.label(self.per)}"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.per is not None and self.role != "exploratory":
            raise ValueError(
                f"a {self.role} claim is one test, not one per {self.per!r}: only exploratory ones are"
            )


@dataclass(frozen=True)
class Selection:
    """A hyperparameter choice declared before its runs: in each family (a name -> the model labels that
    are its candidate settings), the candidate with the lowest mean of ``endpoint`` over the seeds wins
    (ties: the first declared; a NaN mean, a diverged run, never). A selection study reports every candidate's mean and spread and the
    winners; it tests no claim."""

    endpoint: Endpoint
    families: Mapping[str, tuple[str, ...]]

    def choose(self, means: Mapping[str, float]) -> dict[str, str]:
        """``{family: winning label}`` from each candidate's mean endpoint ``means``; a NaN mean (a
        diverged run) never wins."""
        import math

        def key(label: str) -> float:
            return math.inf if math.isnan(means[label]) else means[label]

        return {f: min(labels, key=key) for f, labels in self.families.items()}


@dataclass(frozen=True)
class Study:
    """A seeded comparison of models trained with one recipe (see the module docstring).

    ``models``: label -> recipe overrides; an override ``"{run:LABEL}"`` is the run folder of model LABEL,
    declared before it, of the same seed (``{"init": "{run:LLaMA}"}``: a run that starts from that one). ``data``: the layout of ``--data`` that the recipe trains on
    and the measures read (`lime_probe.studies.runner.LAYOUTS`: "wikitext", "fineweb-edu"; BLiMP beside
    it), None when the recipe makes its own (arithmetic).
    ``protocol``: where the protocol is written (a path in the repository), ``results``: the committed
    results folder. ``select``: a `Selection` the study exists to make (a learning-rate sweep).
    ``tiny``: the smoke size the tests run: ``seeds``, recipe ``overrides``, per model further
    overrides (``models``, for models that set their own length) and, per measure, the `Measure` fields
    to change (``params`` merged into the declared ones). ``reproducible``: train in the reproducible mode
    (`lime_model.reproducible`, the default); False for a study whose runs were trained without it, so
    that its finished runs are reused rather than refused."""

    name: str
    question: str
    recipe: str
    models: Mapping[str, Mapping[str, Any]]
    seeds: tuple[int, ...]
    measures: Mapping[str, Measure]
    claims: tuple[Claim, ...]
    select: Selection | None = None
    data: Literal["wikitext", "fineweb-edu"] | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    protocol: str = ""
    results: str = ""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    reproducible: bool = True

    @property
    def needs_data(self) -> bool:
        return self.data is not None

    def sized(self, size: str) -> Study:
        """The study at ``size``: "full" as declared, "tiny" with `tiny`'s overrides (a smoke run)."""
        if size == "full":
            return self
        if size != "tiny":
            raise ValueError(f"size must be 'full' or 'tiny', got {size!r}")
        t = self.tiny
        measures = {}
        for k, m in self.measures.items():
            changes = dict(t.get("measures", {}).get(k, {}))
            measures[k] = replace(m, **{**changes, "params": {**m.params, **changes.get("params", {})}})
        models = {label: {**o, **t.get("models", {}).get(label, {})} for label, o in self.models.items()}
        return replace(
            self,
            seeds=tuple(t.get("seeds", self.seeds)),
            overrides={**self.overrides, **t.get("overrides", {})},
            models=models,
            measures=measures,
        )
