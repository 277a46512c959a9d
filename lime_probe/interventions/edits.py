"""What an intervention changes: edits of a site's activations, and edits of LIMe's router coefficients.

An `Edit` names a cell set of one extraction site (the same names and layer indices as
`lime_probe.extract`: site, layer, the sequences, the positions, the heads) and an operation on it:

- ``set``: the cells take ``value``; ``zero``: they become 0; ``mean``: they take the mean of the site over
  ``reference`` texts (computed by `run_with_edits`), ``value`` once computed;
- ``add``: ``scale * value`` is added (a steering vector);
- ``fn``: ``fn(x)`` replaces the cells, ``x`` being the whole site tensor (batch, seq, dim).

``value`` is (dim,), the same vector in every cell, or (n_cells, dim), one row per cell in sequence-major
order with positions ascending (what ``acts[site][layer]`` of the same texts and positions holds).

A `RouteEdit` changes the coefficients ``C (n, kv, S, kv, F)`` a LIMe layer mixes its sources with
(`lime_model.router.LimeRouter.coefficients`): the weights routed heads ``heads`` give to source layers
``sources`` are zeroed, scaled or set, optionally renormalised (ours: each routed head's remaining weights
rescaled to the L1 mass its weights had before the edit; the paper's router weights are unnormalised,
Sec. 4 Eq. 4, so there is no sum to keep, and the L1 mass is what its Figure 5 heatmap normalises).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lime_probe.extraction.sites import check_site

OPS = ("set", "zero", "mean", "add", "fn")
ROUTE_OPS = ("zero", "scale", "set")
# The sites whose writes reach the forward pass: attention weights are returned after they are used.
UNWRITABLE = {"attn_pattern": "attention weights are returned after the heads have used them"}


@dataclass(frozen=True)
class Edit:
    """One edit of a site's activations (see the module doc).

    Attributes:
        site: an extraction site name (``hidden``, ``values``, ``routed_values``, ``attn_out``, ``module:PATH``...).
        layer: its layer index (negative counts from the site's end, as in `extract`).
        op: one of `OPS`.
        value: (dim,) or (n_cells, dim) for ``set``/``add``; the mean itself for ``mean`` once computed.
        positions: token positions counted from each sequence's first token (negative from its last);
            None: every position.
        sequences: indices of the input sequences edited; None: all.
        heads: for the per-head sites (keys/values and the routed ones), the kv heads edited; None: all.
        scale: multiplies ``value`` for ``add``.
        fn: for ``fn``, (batch, seq, dim) -> (batch, seq, dim); only the edit's cells are taken from it.
        reference: for ``mean``, the texts whose mean activation (over all their tokens) the cells take.
    """

    site: str
    layer: int
    op: str = "set"
    value: torch.Tensor | None = None
    positions: Sequence[int] | None = None
    sequences: Sequence[int] | None = None
    heads: Sequence[int] | None = None
    scale: float = 1.0
    fn: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    reference: Sequence[str] | None = None

    def __post_init__(self) -> None:
        check_site(self.site)
        if self.site in UNWRITABLE:
            raise ValueError(f"site {self.site!r} cannot be edited: {UNWRITABLE[self.site]}")
        if self.op not in OPS:
            raise ValueError(f"edit op must be one of {', '.join(OPS)}, not {self.op!r}")
        needs = {"set": "value", "add": "value", "fn": "fn", "mean": "reference or value"}.get(self.op)
        given = {"value": self.value is not None, "fn": self.fn is not None}
        given["reference or value"] = self.reference is not None or self.value is not None
        if needs and not given[needs]:
            raise ValueError(f"edit op {self.op!r} at site {self.site!r} layer {self.layer} needs {needs}")
        for name in ("positions", "sequences", "heads"):
            items = getattr(self, name)
            if items is not None and (
                not items or not all(isinstance(i, int) and not isinstance(i, bool) for i in items)
            ):
                raise ValueError(f"edit {name} must be a non-empty list of integers, got {items!r}")

    def with_value(self, value: torch.Tensor) -> Edit:
        """This edit with ``value`` set (a ``mean`` edit once its reference mean is known)."""
        return Edit(
            self.site,
            self.layer,
            self.op,
            value,
            self.positions,
            self.sequences,
            self.heads,
            self.scale,
            self.fn,
        )


def cell_mask(
    edit: Edit, starts: torch.Tensor, lengths: torch.Tensor, width: int, first: int
) -> torch.Tensor:
    """The cells `edit` touches in a batch: (batch, width) bool.

    Args:
        starts: (batch,) the column of each sequence's first token (after left padding).
        lengths: (batch,) each sequence's token count.
        width: the padded batch's length.
        first: the index, in the whole input, of the batch's first sequence (batches keep input order).
    """
    batch = len(starts)
    rows = torch.ones(batch, dtype=torch.bool)
    if edit.sequences is not None:
        rows = torch.isin(torch.arange(first, first + batch), torch.tensor(list(edit.sequences)))
    columns = torch.arange(width)[None, :] - starts[:, None]  # each sequence's own positions
    if edit.positions is None:
        picked = (columns >= 0) & (columns < lengths[:, None])
    else:
        picked = torch.zeros(batch, width, dtype=torch.bool)
        for p in edit.positions:
            at = torch.where(torch.tensor(p) < 0, lengths + p, torch.full_like(lengths, p))
            if ((at < 0) | (at >= lengths))[rows].any():
                short = int(lengths[rows].min())
                raise ValueError(f"edit position {p} is outside a sequence of {short} tokens")
            picked |= columns == at[:, None]
    return picked & rows[:, None]


def cell_counts(edit: Edit, lengths: Sequence[int]) -> list[int]:
    """The number of cells `edit` touches in each sequence of token counts `lengths` (the whole input, in
    order), known before any forward pass; ValueError in one line for a sequence index out of range or a
    position outside a sequence the edit touches (as `cell_mask` would find it mid-run)."""
    n = len(lengths)
    bad = [i for i in edit.sequences or () if not 0 <= i < n]
    if bad:
        raise ValueError(f"edit sequence {bad[0]} out of range: there are {n} sequences")
    counts = []
    for i, length in enumerate(lengths):
        if edit.sequences is not None and i not in edit.sequences:
            counts.append(0)
        elif edit.positions is None:
            counts.append(length)
        else:
            outside = [p for p in edit.positions if not -length <= p < length]
            if outside:
                raise ValueError(f"edit position {outside[0]} is outside a sequence of {length} tokens")
            counts.append(len({p % length for p in edit.positions}))
    return counts


def apply_edit(
    edit: Edit, x: torch.Tensor, cells: torch.Tensor, columns: torch.Tensor | None, where: str
) -> None:
    """Apply `edit` to `x` (batch, seq, dim) in place at `cells` (batch, seq) and, where given, only the
    feature `columns` (dim,) bool of its heads. `x` must be the caller's own copy; the write is autograd's
    in-place index_put, so gradients flow through it."""
    n, dim = int(cells.sum()), x.shape[-1]
    old = x[cells]  # (n, dim)
    if edit.op == "zero":
        new = torch.zeros_like(old)
    elif edit.op == "fn":
        assert edit.fn is not None
        out = edit.fn(x)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"the fn of {where} returned {shape}, not the site's {tuple(x.shape)}")
        new = out[cells]
    else:
        value = _cell_values(edit, n, dim, where).to(x.device, x.dtype)
        new = old + edit.scale * value if edit.op == "add" else value.expand(n, dim)
    if columns is not None:
        new = torch.where(columns.to(x.device), new, old)
    x[cells] = new


def _cell_values(edit: Edit, n: int, dim: int, where: str) -> torch.Tensor:
    """`edit`'s value as (1, dim) or (n, dim) for its `n` cells; ValueError naming the shapes that fit."""
    value = edit.value
    assert value is not None  # checked by Edit (mean: computed before the run)
    value = torch.as_tensor(value)
    if value.shape == (dim,):
        return value[None]
    if value.shape == (n, dim):
        return value
    raise ValueError(
        f"the value of {where} is {tuple(value.shape)}; it must be ({dim},) or one row per edited cell ({n}, {dim})"
    )


def check_value(edit: Edit, n_cells: int, dim: int | None) -> None:
    """ValueError in one line, before any forward pass, where `edit`'s value is neither (dim,) nor one row per
    edited cell (`n_cells`, dim); `dim` None (a width known only once the site runs): any width."""
    if edit.value is None or edit.op in ("zero", "fn"):
        return
    shape = torch.as_tensor(edit.value).shape
    if dim is None and not shape:
        return  # a scalar: refused by the run, which knows the width
    _cell_values(
        edit, n_cells, shape[-1] if dim is None else dim, f"the edit of site {edit.site!r} layer {edit.layer}"
    )


def head_columns(
    heads: Sequence[int] | None, shape: tuple[int, int] | None, where: str
) -> torch.Tensor | None:
    """The feature columns (kv_heads * head_dim,) bool of `heads` for a per-head site of head `shape`
    (kv_heads, head_dim); None for every head. ValueError for a site without heads or a head out of range."""
    if heads is None:
        return None
    if shape is None:
        raise ValueError(f"{where} names heads, but the site has no heads (only keys/values sites do)")
    n_heads, head_dim = shape
    bad = [h for h in heads if not 0 <= h < n_heads]
    if bad:
        raise ValueError(f"{where}: head {bad[0]} out of range, the site has {n_heads} heads")
    picked = torch.zeros(n_heads, dtype=torch.bool)
    picked[list(heads)] = True
    return picked.repeat_interleave(head_dim)


# ---------------------------------------------------------------------------------------------------
# Route edits (LIMe)


@dataclass(frozen=True)
class RouteEdit:
    """An edit of the coefficients one LIMe layer mixes its source layers' K/V with.

    Attributes:
        layer: the reading layer.
        sources: the source layers (absolute indices) whose weights change; None: every source but the layer
            itself (cutting all cross-layer reads).
        heads: the routed kv heads whose weights change; None: all.
        op: "zero", "scale" (multiply by `value`) or "set" (to `value`, a float or a tensor broadcastable to
            the edited block of ``C``, (n, heads, sources, kv, F)).
        value: the factor or value.
        renormalize: rescale each routed head's weights to their L1 mass before the edit (module doc).
    """

    layer: int
    sources: Sequence[int] | None = None
    heads: Sequence[int] | None = None
    op: str = "zero"
    value: float | torch.Tensor = 0.0
    renormalize: bool = False

    def __post_init__(self) -> None:
        if self.op not in ROUTE_OPS:
            raise ValueError(f"route edit op must be one of {', '.join(ROUTE_OPS)}, not {self.op!r}")


def routers_of(hf: Any) -> list[Any]:
    """The LIMe routers of `hf`, one per layer; ValueError in one line for a model that does not route."""
    from lime_probe.extraction.sites import routes

    if not routes(hf):
        raise ValueError(
            f"route edits need a LIMe model that routes; this {getattr(hf.config, 'model_type', '?')} model has "
            "no routers"
        )
    return [layer.self_attn.router for layer in hf.base_model.layers]


def check_route_edit(edit: RouteEdit, routers: list[Any]) -> None:
    """ValueError in one line for a route edit naming a layer, source or head the model lacks."""
    if not 0 <= edit.layer < len(routers):
        raise ValueError(f"route edit layer {edit.layer} out of range: the model has {len(routers)} layers")
    router = routers[edit.layer]
    if len(router.sources) == 1:
        raise ValueError(f"layer {edit.layer} reads only its own K/V: it has no route to edit")
    if edit.sources is not None:
        bad = [s for s in edit.sources if s not in router.sources]
        if bad:
            raise ValueError(
                f"layer {edit.layer} does not read layer {bad[0]}; its sources are {router.sources}"
            )
    if edit.heads is not None:
        bad = [h for h in edit.heads if not 0 <= h < router.num_kv_heads]
        if bad:
            raise ValueError(
                f"route edit head {bad[0]} out of range: layer {edit.layer} has {router.num_kv_heads}"
            )


def edited_coefficients(c: torch.Tensor, sources: list[int], edits: Sequence[RouteEdit]) -> torch.Tensor:
    """Coefficients ``c (n, kv, S, kv, F)`` over `sources` with `edits` applied in order (a new tensor)."""
    c = c.clone()
    for edit in edits:
        before = c.abs().sum(dim=(2, 3), keepdim=True)  # each routed head's L1 mass (n, kv, 1, 1, F)
        own = sources[-1]
        chosen = [s for s in sources if s != own] if edit.sources is None else list(edit.sources)
        s_mask = torch.tensor([s in chosen for s in sources], device=c.device)
        h_mask = torch.ones(c.shape[1], dtype=torch.bool, device=c.device)
        if edit.heads is not None:
            h_mask = torch.zeros_like(h_mask)
            h_mask[list(edit.heads)] = True
        mask = (h_mask[:, None] & s_mask[None, :])[None, :, :, None, None]
        if edit.op == "zero":
            new = torch.zeros_like(c)
        elif edit.op == "scale":
            new = c * edit.value
        else:
            new = torch.as_tensor(edit.value, dtype=c.dtype, device=c.device).expand_as(c)
        c = torch.where(mask, new, c)
        if edit.renormalize:
            after = c.abs().sum(dim=(2, 3), keepdim=True)
            rows = h_mask[None, :, None, None, None]
            c = torch.where(rows & (after > 0), c * before / after.clamp_min(torch.finfo(c.dtype).tiny), c)
    return c


@contextlib.contextmanager
def routes_edited(hf: Any, edits: Sequence[RouteEdit]) -> Iterator[None]:
    """A context in which `hf`'s routers mix with `edits` applied to their coefficients (every forward pass
    and its backward read them through ``coefficients``); the routers are restored after."""
    if not edits:
        yield
        return
    routers = routers_of(hf)
    for edit in edits:
        check_route_edit(edit, routers)
    by_layer: dict[int, list[RouteEdit]] = {}
    for edit in edits:
        by_layer.setdefault(edit.layer, []).append(edit)
    try:
        for layer, layer_edits in by_layer.items():
            router = routers[layer]
            original = type(router).coefficients

            def coefficients(
                self: Any,
                hidden_states: torch.Tensor | None = None,
                _original: Any = original,
                _e: Any = layer_edits,
            ) -> torch.Tensor:
                return edited_coefficients(_original(self, hidden_states), self.sources, _e)

            # an instance attribute shadows the class's method for this router only
            object.__setattr__(router, "coefficients", types.MethodType(coefficients, router))
        yield
    finally:
        for layer in by_layer:
            routers[layer].__dict__.pop("coefficients", None)
