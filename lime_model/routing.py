"""The routing table: which buffered K/V layers each attention layer mixes, and with which router.

Layer ``i`` (0-based) of an L-layer model can read the K/V of layers ``0..i`` (``i`` is its own).
A spec string names a variant: a kind from ``ROUTINGS``, with ``-<n>`` for the parametric ones.
``parse_routing`` validates it, ``RoutingSpec.sources`` gives each layer's exact, ascending
source set and ``RoutingSpec.router`` the router class (``lime_model.router``) that mixes it.

==================  ============================================================  ===============
spec                sources of layer i                                             origin
==================  ============================================================  ===============
``none``            none: plain LLaMA attention, no router module                  paper (LLaMA)
``full``            ``0..i``                                                       paper
``average``         ``0..i``, fixed weights ``1/(i+1)`` on the same head            reading (App. F)
``first-<j>``       ``0..min(j,i)-1`` plus ``i``                                   reading (App. F/G)
``last-<j>``        ``max(0,i-j+1)..i`` (the j most recent, own included)          paper
``dilated-<d>``     ``0, d, 2d, ... < i`` plus ``i`` (multiples of d from layer 0)  reading (App. G)
``dilated-back-<d>`` ``i, i-d, i-2d, ... >= 0`` (counted back from the own layer)   project variant
``no-head-mix``     ``0..i``; head h reads only head h of each source              paper; init ours
``per-dim``         ``0..i``; each source head weighted by a ``head_dim`` vector    paper; init ours
``dynamic``         ``0..i``; per-token weights, query x learnable keys            paper (App. E)
==================  ============================================================  ===============

App. F's first-j attends to "the first min(l, j) buffers plus the immediately preceding layer", App. G's
to "the first j layers plus itself": a layer's own K/V come from the preceding layer's output, so both
are read as the own buffer. App. F's average aggregates "via a uniform average, without any learned
head-specific weighting", not saying which heads feed head h: read as the same head. App. G's dilated-d routes to "a sparsified set of previous layers with fixed
dilation factor d (e.g., every 8th or 16th layer)" without saying where the set starts. ``dilated-<d>``
keeps layer 0, which the paper's Fig. 5 shows is the most-read source; the project's earlier reading,
counted back from the own layer, lives on as ``dilated-back-<d>``. Both readings give identical sets
on layers that are multiples of d and sets of different sizes elsewhere, so a checkpoint of one cannot
silently load as the other. The learned weights of each kind are described by its router class. A layer
whose only source is itself (always layer 0) attends to its own K/V exactly as LLaMA does.

Adding a variant is one router class, a subclass of ``lime_model.router.LimeRouter``: its ``routes``
declare the spec kind(s) it implements and their source sets, and ``ROUTINGS`` is built from those
declarations; a subclass defined later (in a user's own module) joins the table when it is defined
(docs/extending.md, "Adding a routing variant").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .router import LimeRouter, Sources


@dataclass(frozen=True)
class RoutingKind:
    """One row of the routing table.

    Attributes:
        sources: ``(layer i, n) -> ascending source layers``, ``i`` last (``n`` is None unless parametric).
        router: the router class, or None for the LLaMA baseline (no router module).
        parametric: whether the spec reads ``<kind>-<n>`` with ``n >= 1``.
    """

    sources: Sources
    router: type[LimeRouter] | None
    parametric: bool = False


def routing_table(base: type[LimeRouter] = LimeRouter) -> dict[str, RoutingKind]:
    """``none`` (LLaMA) plus every kind that ``base`` or a subclass declares in its own ``routes``
    (``"<kind>"`` or ``"<kind>-<n>"`` -> sources), breadth-first from ``base``."""
    table = {"none": RoutingKind(lambda i, n: [i], None)}
    classes = [base]
    for cls in classes:
        classes += [sub for sub in cls.__subclasses__() if sub not in classes]
        add_routes(table, cls)
    return table


def add_routes(table: dict[str, RoutingKind], cls: type[LimeRouter]) -> None:
    """Add the kinds ``cls`` declares in its own ``routes`` to ``table``. A kind another class declares
    already is a ValueError; one declared by a class of the same module and name is replaced (a notebook
    cell run again)."""
    for pattern, sources in cls.__dict__.get("routes", {}).items():
        kind = pattern.removesuffix("-<n>")
        old = table[kind].router if kind in table else cls
        if old is None or (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"routing kind {kind!r} is declared twice ({old}, {cls})")
        table[kind] = RoutingKind(sources, cls, parametric=kind != pattern)


ROUTINGS: dict[str, RoutingKind] = routing_table()


@dataclass(frozen=True)
class RoutingSpec:
    """A parsed routing spec: ``kind`` (a key of ``ROUTINGS``) plus ``n`` for the parametric kinds."""

    kind: str
    n: int | None = None

    def __str__(self) -> str:
        return self.kind if self.n is None else f"{self.kind}-{self.n}"

    @property
    def enabled(self) -> bool:
        return self.router is not None

    @property
    def router(self) -> type[LimeRouter] | None:
        """The router class of this kind (None for ``none``, the LLaMA baseline)."""
        return ROUTINGS[self.kind].router

    @property
    def input_dependent(self) -> bool:
        """Whether the routing weights depend on the token (the router analysis then needs hidden states)."""
        return self.router is not None and self.router.input_dependent

    def sources(self, layer_idx: int) -> list[int]:
        """Ascending indices of the layers whose K/V layer ``layer_idx`` mixes (its own is last)."""
        if layer_idx < 0:
            raise ValueError(f"layer index must be >= 0, got {layer_idx}")
        return ROUTINGS[self.kind].sources(layer_idx, self.n)


def parse_routing(spec: str | RoutingSpec) -> RoutingSpec:
    """Parse and validate a routing spec string (see the module docstring for the grammar).

    Raises:
        ValueError: for an unknown kind, a missing or non-positive ``j``/``d``.
    """
    if isinstance(spec, RoutingSpec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"routing spec must be a string, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ROUTINGS and not ROUTINGS[text].parametric:
        return RoutingSpec(text)
    match = re.fullmatch(r"(.+)-([0-9]+)", text)
    if match is None or match[1] not in ROUTINGS or not ROUTINGS[match[1]].parametric:
        kinds = ", ".join(f"{k}-<n>" if v.parametric else k for k, v in ROUTINGS.items())
        raise ValueError(f"unknown routing spec {spec!r}; expected one of: {kinds}")
    n = int(match[2])
    if n < 1:
        raise ValueError(f"routing spec {spec!r}: {match[1]}-<n> needs n >= 1")
    return RoutingSpec(match[1], n)
