"""Forward passes with edits: `run_with_edits` runs texts through a model whose sites are written as `Edit`s
say (and, for LIMe, whose routers mix as `RouteEdit`s say), and returns per-token log-probabilities, the
last position's logits and, where asked, activations read under the edits.

The writes go through nnsight: inside one trace each edited module's output (or input) is read, edited and
assigned back (``envoy.output = ...``), in the order the forward pass produces them. A site is read from a
module's value by its adapter's reader (a selection: a slice, a transpose, a flattening of heads); an edit
is written back through that reader's adjoint (its vector-Jacobian product places every value where the
reader read it), so any site that `extract` reads can be written, registered adapters included, and a
reader that is no selection is refused rather than written wrongly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import nnsight
import torch

from lime_probe.extraction.activations import Activations
from lime_probe.extraction.batching import DEFAULT_BATCH_TOKENS, first_position_of, pad_batch
from lime_probe.extraction.forward import envoy_path, select_rows
from lime_probe.extraction.planning import SitePlan, plan_sites, resolve_layers, site_sizes
from lime_probe.extraction.sites import HEADED, module_site
from lime_probe.extraction.tracing import as_nnsight, extract, text_items, tokenize_texts
from lime_probe.interventions.edits import (
    Edit,
    RouteEdit,
    apply_edit,
    cell_counts,
    cell_mask,
    check_value,
    head_columns,
    routes_edited,
)


@dataclass
class EditedRun:
    """What a forward pass under edits gave, per input sequence.

    Attributes:
        token_ids: LongTensor (t_i,) per sequence.
        logprobs: DoubleTensor (t_i - 1,) per sequence: entry j is log p(t_{j+1} | t_<=j).
        last_logits: (n_sequences, V) float32, the logits at each sequence's last token (V: the vocabulary,
            or the columns of ``logits_of``).
        acts: the sites read under the edits (``read``), as `extract` returns them; None when none were read.
    """

    token_ids: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    last_logits: torch.Tensor
    acts: Activations | None = None

    def loss(self) -> float:
        """The mean next-token loss (nats) over every predicted token of every sequence."""
        return -float(torch.cat(self.logprobs).mean())

    def table(self, tokenizer: Any) -> list[dict]:
        """A row per predicted token: sequence, position (of the predicted token), token (decoded), logprob."""
        rows = []
        for i, (ids, lp) in enumerate(zip(self.token_ids, self.logprobs, strict=True)):
            for j, value in enumerate(lp.tolist(), start=1):
                rows.append(
                    {"sequence": i, "position": j, "token": tokenizer.decode([int(ids[j])]), "logprob": value}
                )
        return rows


@dataclass(frozen=True)
class Step:
    """What the trace does at one module value (`path`: its nnsight path ending in .input/.output): the edits
    written there, then the reads taken from it (both as (site, layer, reader) with the edits' objects)."""

    path: str
    edits: tuple[tuple[Edit, Any, torch.Tensor | None], ...]  # (edit, reader, head columns)
    reads: tuple[tuple[str, int, Any], ...]


def run_with_edits(
    model: Any,
    tokenizer: Any,
    texts: Iterable[str | list[int]],
    edits: Sequence[Edit] = (),
    *,
    routes: Sequence[RouteEdit] = (),
    read: Sequence[str] = (),
    read_layers: Iterable[int] | None = None,
    logits_of: Sequence[int] | None = None,
    max_length: int = 512,
    batch_size: int | None = None,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
) -> EditedRun:
    """Run `texts` through `model` with `edits` written and `routes` mixed, and return what it predicts.

    Args:
        model: an nnsight model from `lime_probe.load`, or a Hugging Face model (with its tokenizer).
        tokenizer: its tokenizer (None: the nnsight model's own).
        texts: strings, or token id lists used as they are; every sequence in input order.
        edits: site edits (`Edit`), applied in order where several touch one site.
        routes: LIMe router edits (`RouteEdit`); a model without routers is refused.
        read: sites read under the edits into ``acts`` (every token, layers ``read_layers``, None: all).
        logits_of: token ids whose last-position logits are kept (None: the whole vocabulary).
        max_length: tokens per text at most (capped at the model's positions); longer texts are cut.
        batch_size: sequences per forward pass (None: as many as fit `batch_tokens`, padding included).

    Returns:
        `EditedRun`: per-token log-probabilities, last-position logits, and the activations read.

    Raises:
        ValueError: a site, layer, position, head or value shape the model or texts do not have, in one line.
    """
    nn_model, tokenizer = as_nnsight(model, tokenizer)
    hf = nn_model._module
    max_length = min(max_length, getattr(hf.config, "max_position_embeddings", None) or max_length)
    seqs = token_sequences(tokenizer, texts, max_length)
    edits = [with_mean(nn_model, tokenizer, e, max_length) if e.op == "mean" else e for e in edits]
    plan = plan_sites(hf, list(dict.fromkeys([e.site for e in edits] + list(read))), None, max_length)
    steps = plan_steps(hf, plan, edits, read, read_layers)
    lengths = [len(s) for s in seqs]
    counts = [cell_counts(e, lengths) for e in edits]
    for e, c in zip(edits, counts, strict=True):
        check_value(e, sum(c), None if module_site(e.site) else plan.dims[e.site])
    read_layers_of = {
        s: resolve_layers([s], read_layers, _sizes(hf, plan), hf.config.model_type)[s] for s in read
    }
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    parts: list[dict[str, Any]] = []
    first_index = 0
    with routes_edited(hf, routes):
        for chunk in consecutive_batches(lengths, batch_size, batch_tokens):
            batch = pad_batch([seqs[i] for i in chunk], pad_id, tokenizer.padding_side, first_position_of(hf))
            if any(_per_cell(e) for e in edits):
                in_batch = [_batch_rows(e, c, chunk) for e, c in zip(edits, counts, strict=True)]
                steps = plan_steps(hf, plan, in_batch, read, read_layers)
            with torch.no_grad():
                logits, rows = traced_forward(nn_model, batch, steps, first_index)
            parts.append(_batch_outputs(batch, logits, rows, logits_of))
            first_index += len(chunk)
    return _collect(parts, read_layers_of, plan)


def _per_cell(edit: Edit) -> bool:
    """Whether `edit`'s value is one row per cell (n_cells, dim) rather than one vector."""
    return edit.value is not None and torch.as_tensor(edit.value).dim() == 2


def _batch_rows(edit: Edit, counts: list[int], chunk: list[int]) -> Edit:
    """`edit` as the batch of consecutive sequences `chunk` sees it: a per-cell value cut to the rows of the
    batch's cells (`counts`: the edit's cells in each sequence of the input)."""
    if not _per_cell(edit):
        return edit
    start = sum(counts[: chunk[0]])
    return edit.with_value(torch.as_tensor(edit.value)[start : start + sum(counts[i] for i in chunk)])


def token_sequences(tokenizer: Any, texts: Iterable[str | list[int]], max_length: int) -> list[list[int]]:
    """Token id lists of `texts` (strings tokenised and cut to `max_length`, id lists kept as they are)."""
    items = list(texts)
    if not items:
        raise ValueError("texts is empty: nothing to run")
    pretokenized = not isinstance(items[0], str)
    return list(tokenize_texts(tokenizer, text_items(items, pretokenized), max_length, None, pretokenized))


def _sizes(hf: Any, plan: SitePlan) -> dict[str, int]:
    from lime_probe.extraction.adapters import adapter_for

    n_layers = len(hf.base_model.get_submodule(adapter_for(hf).layers))
    return site_sizes(adapter_for(hf), hf.config, n_layers) | {
        s: len(ls) for s, ls in plan.site_layers.items() if s not in ("hidden", "final")
    }


def with_mean(nn_model: Any, tokenizer: Any, edit: Edit, max_length: int) -> Edit:
    """A ``mean`` edit with its value: the site's mean over every token of its reference texts."""
    if edit.value is not None:
        return edit
    assert edit.reference is not None
    acts = extract(
        nn_model, tokenizer, list(edit.reference), sites=[edit.site], layers=[edit.layer], max_length=max_length,
        progress=False,
    )  # fmt: skip
    return edit.with_value(acts[edit.site][acts.layers(edit.site)[0]].mean(0))


def plan_steps(
    hf: Any, plan: SitePlan, edits: Sequence[Edit], read: Sequence[str], read_layers: Iterable[int] | None
) -> list[Step]:
    """The trace's steps in execution order: at each module value the edits written, then the reads taken."""
    sizes = _sizes(hf, plan)
    wanted_reads = {
        (s, layer) for s in read for layer in resolve_layers([s], read_layers, sizes, hf.config.model_type)[s]
    }
    resolved = []
    for edit in edits:
        layer = resolve_layers([edit.site], [edit.layer], sizes, hf.config.model_type)[edit.site][0]
        where = f"the edit of site {edit.site!r} layer {edit.layer}"
        resolved.append((edit, layer, head_columns(edit.heads, plan.heads.get(edit.site), where)))
    steps = []
    for r in plan.reads:
        at_edits = tuple(
            (edit, take, cols)
            for edit, layer, cols in resolved
            for site, lyr, take in r.targets
            if (site, lyr) == (edit.site, layer)
        )
        at_reads = tuple(t for t in r.targets if (t[0], t[1]) in wanted_reads)
        if at_edits or at_reads:
            steps.append(Step(r.path, at_edits, at_reads))
    return steps


def consecutive_batches(
    lengths: Sequence[int], batch_size: int | None, batch_tokens: int
) -> Iterator[list[int]]:
    """Indices 0..n-1 cut into consecutive batches of `batch_size` sequences, or (None) of as many as keep the
    padded batch within `batch_tokens` tokens (a longer sequence runs alone)."""
    batch: list[int] = []
    for i, n in enumerate(lengths):
        longest = max([lengths[j] for j in batch] + [n])
        if batch and (len(batch) >= batch_size if batch_size else (len(batch) + 1) * longest > batch_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def traced_forward(
    nn_model: Any, batch: dict[str, torch.Tensor], steps: Sequence[Step], first_index: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One nnsight trace of `batch` (sequences `first_index`.. of the input) with `steps`' edits written and
    reads taken: (logits (batch, seq, V), "<site>/<layer>" -> rows (n_tokens, dim) float32). Under
    ``torch.enable_grad()`` the logits stay differentiable through the edits (attribution patching)."""
    from lime_probe.extraction.loading import input_device

    hf = nn_model._module
    device = input_device(hf)
    mask = batch["attention_mask"]
    lengths = mask.sum(1)
    starts = (mask.cumsum(1) == 0).sum(1)
    inputs = {k: v.to(device) for k, v in batch.items()}
    if "position_ids" not in inspect.signature(hf.forward).parameters:
        del inputs["position_ids"]
    with nn_model.trace(**inputs):
        rows = nnsight.save({})
        for step in steps:
            module, what = envoy_path(step.path).rsplit(".", 1)
            envoy = nn_model.get(module)
            value = getattr(envoy, what)
            if step.edits:
                value = edited_value(value, step.edits, starts, lengths, first_index)
                setattr(envoy, what, value)
            for site, layer, take in step.reads:
                rows[f"{site}/{layer}"] = select_rows(
                    take(value).reshape(*mask.shape, -1), mask.bool(), "none"
                ).cpu()
        logits = nnsight.save(nn_model.output.logits)
    return logits, rows


def edited_value(
    value: Any,
    edits: Sequence[tuple[Edit, Any, torch.Tensor | None]],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    first_index: int,
    cells_of: Callable[[Edit, torch.Tensor, torch.Tensor, int, int], torch.Tensor] = cell_mask,
) -> Any:
    """A module's `value` with `edits` ((edit, its site's reader, its head columns)) applied: the edits of
    one reader in order on what it reads, then written back once (`write_back`). `starts` and `lengths`
    (batch,) place each sequence in the padded batch, `first_index` is its first sequence's input index;
    `cells_of` (`cell_mask`'s signature) picks each edit's cells (generation: `steering.step_cells`)."""
    by_reader: dict[Any, list[tuple[Edit, torch.Tensor | None]]] = {}
    batch = range(first_index, first_index + len(starts))
    for edit, take, columns in edits:
        if edit.sequences is None or any(i in batch for i in edit.sequences):
            by_reader.setdefault(take, []).append((edit, columns))
    for take, reader_edits in by_reader.items():
        x = take(value)
        width = x.shape[1]
        flat = x.reshape(len(starts), width, -1).clone()  # one copy, edited in place by each edit
        changed = False
        for edit, columns in reader_edits:
            cells = cells_of(edit, starts, lengths, width, first_index).to(x.device)
            if cells.any():
                apply_edit(edit, flat, cells, columns, f"the edit of site {edit.site!r} layer {edit.layer}")
                changed = True
        if changed:
            value = write_back(value, take, flat.reshape(x.shape), f"site {reader_edits[0][0].site!r}")
    return value


def write_back(value: Any, take: Any, new: torch.Tensor, where: str) -> Any:
    """`value` (a module's output or input: a tensor or a tuple holding tensors) with the part `take` reads
    replaced by `new`, exactly: where ``take^T 1`` (the reader's vector-Jacobian product of ones) marks an
    element, it takes ``take^T new``, elsewhere it keeps its own. Differentiable in `new` and `value`.
    ValueError where the reader is no selection (reading the written value back does not give `new`)."""
    leaves = list(value) if isinstance(value, (tuple, list)) else [value]
    index = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    with torch.enable_grad():
        proxies = [leaves[i].detach().requires_grad_() for i in index]
        x = take(_rebuilt(value, leaves, index, proxies))
        picked = torch.autograd.grad(x, proxies, torch.ones_like(x), allow_unused=True, retain_graph=True)
        put = torch.autograd.grad(x, proxies, new, allow_unused=True, create_graph=new.requires_grad)
    written = [
        leaves[i] if p is None else torch.where(p != 0, q, leaves[i])
        for i, p, q in zip(index, picked, put, strict=True)
    ]
    out = _rebuilt(value, leaves, index, written)
    with torch.no_grad():
        if not torch.equal(take(out), new):
            raise ValueError(
                f"{where}: the site's reader is no selection of its module's value: it cannot be written"
            )
    return out


def _rebuilt(value: Any, leaves: list[Any], index: list[int], tensors: list[torch.Tensor]) -> Any:
    """`value`'s structure with the leaves at `index` replaced by `tensors`."""
    out = list(leaves)
    for i, t in zip(index, tensors, strict=True):
        out[i] = t
    return type(value)(out) if isinstance(value, (tuple, list)) else out[0]


def _batch_outputs(
    batch: dict[str, torch.Tensor],
    logits: torch.Tensor,
    rows: dict[str, torch.Tensor],
    logits_of: Sequence[int] | None,
) -> dict[str, Any]:
    """Per-sequence token ids and log-probabilities, last-position logits and the read rows of one batch."""
    mask = batch["attention_mask"].bool()
    logp = logits.detach().float().log_softmax(-1)
    ids, lps, last = [], [], []
    for b in range(len(mask)):
        cols = mask[b].nonzero().squeeze(1)
        seq = batch["input_ids"][b, cols]
        ids.append(seq)
        lps.append(logp[b, cols[:-1]].gather(-1, seq[1:, None].to(logp.device)).squeeze(-1).double().cpu())
        row = logits[b, cols[-1]].detach().float().cpu()
        last.append(row if logits_of is None else row[list(logits_of)])
    return {"token_ids": ids, "logprobs": lps, "last_logits": torch.stack(last), "rows": rows}


def _collect(parts: list[dict[str, Any]], read_layers: dict[str, list[int]], plan: SitePlan) -> EditedRun:
    """The batches' outputs as one `EditedRun`, in input order."""
    ids = [t for p in parts for t in p["token_ids"]]
    acts = None
    if read_layers:
        counts = torch.tensor([len(t) for t in ids])
        part = {
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
            "token_ids": torch.cat(ids),
        } | {name: torch.cat([p["rows"][name] for p in parts]) for name in parts[0]["rows"]}
        heads = {s: plan.heads[s] for s in read_layers if s in plan.heads and s in HEADED}
        acts = Activations([part], read_layers, heads)
    return EditedRun(
        ids,
        [t for p in parts for t in p["logprobs"]],
        torch.cat([p["last_logits"] for p in parts]),
        acts,
    )
