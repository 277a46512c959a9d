"""Routing specs: which buffered K/V layers each attention layer of LIMe mixes.

Layer ``i`` (0-based) of an L-layer model can read the K/V of layers ``0..i`` (``i`` is its own).
A spec string names the variant from the paper's ablations; :func:`parse_routing` validates it and
:meth:`RoutingSpec.sources` gives the exact, ascending source set of each layer.

=================  ============================================================  ==============
spec               sources of layer i                                             learned weights
=================  ============================================================  ==============
``none``           none: plain LLaMA attention, no router module                  --
``full``           ``0..i``                                                       ``[kv, |S|*kv]``
``average``        ``0..i``, fixed weights ``1/(i+1)`` on the same head            none
``first-<j>``      ``0..min(j,i)-1`` plus ``i``                                   ``[kv, |S|*kv]``
``last-<j>``       ``max(0,i-j+1)..i`` (the j most recent, own included)          ``[kv, |S|*kv]``
``dilated-<d>``    ``i, i-d, i-2d, ... >= 0`` (own plus every d-th earlier one)   ``[kv, |S|*kv]``
``no-head-mix``    ``0..i``; head h reads only head h of each source              ``[kv, |S|]``
``per-dim``        ``0..i``; each source head weighted by a ``head_dim`` vector    ``[kv, |S|*kv, head_dim]``
``dynamic``        ``0..i``; weights = static ``full`` router + ``W x_t``          ``[kv, |S|*kv]`` + Linear
=================  ============================================================  ==============

A layer whose only source is itself (always layer 0) has no learned router weights: it attends
to its own K/V exactly as LLaMA does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SIMPLE_KINDS = ("none", "full", "average", "no-head-mix", "per-dim", "dynamic")
_PARAMETRIC = re.compile(r"^(first|last|dilated)-(\d+)$")


@dataclass(frozen=True)
class RoutingSpec:
    """A parsed routing spec: ``kind`` plus ``n`` (j or d) for the parametric kinds."""

    kind: str
    n: int | None = None

    def __str__(self) -> str:
        return self.kind if self.n is None else f"{self.kind}-{self.n}"

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def sources(self, layer_idx: int) -> list[int]:
        """Ascending indices of the layers whose K/V layer ``layer_idx`` mixes (its own is last)."""
        i = layer_idx
        if i < 0:
            raise ValueError(f"layer index must be >= 0, got {i}")
        if self.kind == "none":
            return [i]
        if self.kind == "first":
            return list(range(min(self.n, i))) + [i]
        if self.kind == "last":
            return list(range(max(0, i - self.n + 1), i + 1))
        if self.kind == "dilated":
            return list(range(i, -1, -self.n))[::-1]
        return list(range(i + 1))


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
    if text in SIMPLE_KINDS:
        return RoutingSpec(text)
    match = _PARAMETRIC.match(text)
    if match is None:
        kinds = ", ".join([*SIMPLE_KINDS, "first-<j>", "last-<j>", "dilated-<d>"])
        raise ValueError(f"unknown routing spec {spec!r}; expected one of: {kinds}")
    n = int(match.group(2))
    if n < 1:
        raise ValueError(f"routing spec {spec!r}: {match.group(1)}-<n> needs n >= 1")
    return RoutingSpec(match.group(1), n)
