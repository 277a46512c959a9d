"""Steering during generation: `generate_with_edits` generates (Hugging Face ``generate``, greedy by default)
with `Edit`s written at every forward pass of the generation, the prompt's and each new token's on the
cached path, and `RouteEdit`s held on LIMe's routers for the whole generation.

The edits go through nnsight's generation API: inside ``model.generate`` one ``tracer.all()`` loop runs the
trace body once per forward pass, writing each edited module's value as `run_with_edits` does
(`edited_value`); a second invoke reads the generated ids.

Positions under the cache: a prompt's tokens and the tokens generated after it are numbered 0, 1, ... from
the prompt's first token (left padding is not counted). An edit with ``positions=None`` applies to every
token, prompt and generated, each in the forward pass that computes it (the prompt's in the first, each
new token's in its own step); a position ``p >= 0`` applies wherever position ``p`` is computed (a prompt
token or a generated one); a negative ``p`` counts from the prompt's end (-1: its last token). Under a
cache, an earlier token's keys and values are computed once and kept, so editing them edits every later
step's reads of them. ``sequences`` selects prompts (indices into ``prompts``; with several output rows
per prompt, as ``num_return_sequences`` or beams give, all of a prompt's rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import nnsight
import torch

from lime_probe.extraction.batching import pad_batch
from lime_probe.extraction.forward import envoy_path
from lime_probe.extraction.planning import plan_sites
from lime_probe.extraction.tracing import as_nnsight
from lime_probe.interventions.edits import Edit, RouteEdit, routes_edited
from lime_probe.interventions.run import Step, edited_value, plan_steps, token_sequences, with_mean


@dataclass
class Generation:
    """What `generate_with_edits` generated, one entry per output row (prompt-major: each prompt's
    ``num_return_sequences`` rows together, in prompt order).

    Attributes:
        sequences: (rows, prompt_width + new) LongTensor, ``generate``'s own output: the left-padded prompts
            and the new tokens (a finished row padded after its end-of-sequence token).
        prompt_ids: LongTensor (p_i,) per row, its prompt's tokens without padding.
        token_ids: LongTensor (g_i,) per row, the generated tokens up to and including the first
            end-of-sequence token (the padding after it dropped).
        texts: the generated tokens of each row decoded (special tokens skipped).
    """

    sequences: torch.Tensor
    prompt_ids: list[torch.Tensor]
    token_ids: list[torch.Tensor]
    texts: list[str]


def generate_with_edits(
    model: Any,
    tokenizer: Any,
    prompts: Iterable[str | list[int]],
    edits: Sequence[Edit] = (),
    *,
    routes: Sequence[RouteEdit] = (),
    max_new_tokens: int = 20,
    **generate_kwargs: Any,
) -> Generation:
    """Generate from `prompts` with `edits` written at every forward pass and `routes` mixed throughout.

    Example: ``generate_with_edits(model, tok, ["The cat"], [Edit("hidden", 3, "add", value=v, scale=4.0)])``
    adds ``4 * v`` (v: (hidden,)) to the residual stream after block 2 at every token.

    Args:
        model: an nnsight model from `lime_probe.load`, or a Hugging Face model (with its tokenizer).
        tokenizer: its tokenizer (None: the nnsight model's own).
        prompts: strings, or token id lists used as they are; generated in one left-padded batch.
        edits: site edits (`Edit`) as `run_with_edits` takes them, positions and sequences as the module doc
            says; a ``set``/``add`` value is one (dim,) vector (the cells differ from step to step).
        routes: LIMe router edits (`RouteEdit`) held for the whole generation; a model without routers is
            refused.
        max_new_tokens: tokens generated per prompt at most.
        **generate_kwargs: passed to ``generate`` (default ``do_sample=False``: greedy).

    Returns:
        `Generation`: ``generate``'s output and, per row, the prompt, the new tokens and their text.

    Raises:
        ValueError: a site, layer, head, position, sequence or value shape the model or prompts do not have,
            in one line, before generating.
    """
    nn_model, tokenizer = as_nnsight(model, tokenizer)
    hf = nn_model._module
    max_length = getattr(hf.config, "max_position_embeddings", None) or 2048
    seqs = token_sequences(tokenizer, prompts, max_length)
    edits = [with_mean(nn_model, tokenizer, e, max_length) if e.op == "mean" else e for e in edits]
    plan = plan_sites(hf, list(dict.fromkeys(e.site for e in edits)), None, max_length)
    steps = plan_steps(hf, plan, edits, (), None)
    lengths = torch.tensor([len(s) for s in seqs])
    for edit in edits:
        _check_for_generation(edit, plan.dims.get(edit.site), lengths)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = pad_batch(seqs, pad_id, "left")  # generation appends on the right
    width = batch["input_ids"].shape[1]
    starts = width - lengths
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    kwargs = {"do_sample": False, "pad_token_id": pad_id, "max_new_tokens": max_new_tokens} | generate_kwargs
    with routes_edited(hf, routes), torch.no_grad():
        sequences, reached = _traced_generate(nn_model, inputs, kwargs, steps, starts, lengths)
    new = sequences.shape[1] - width
    if steps and reached < new:
        raise RuntimeError(f"the edits reached {reached} of the generation's {new} forward passes")
    return _generation(sequences.cpu(), seqs, width, _eos_ids(hf, kwargs), tokenizer)


def _traced_generate(
    nn_model: Any,
    inputs: dict[str, torch.Tensor],
    kwargs: dict[str, Any],
    steps: Sequence[Step],
    starts: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """One nnsight generation with `steps`' edits written at every forward pass: (``generate``'s ids
    (rows, width + new), the forward passes the edits reached). `starts`, `lengths`: (n_prompts,)."""
    from nnsight.intervention.interleaver import OutOfOrderError

    width = inputs["input_ids"].shape[1]
    with nn_model.generate(**kwargs) as tracer:
        with tracer.invoke(**inputs):
            reached = nnsight.save([0])
            if steps:
                try:
                    for step in tracer.all():
                        for s in steps:
                            module, what = envoy_path(s.path).rsplit(".", 1)
                            envoy = nn_model.get(module)
                            value = getattr(envoy, what)
                            per_prompt = _rows(value) // len(starts)  # beams, num_return_sequences
                            cells_of = partial(step_cells, end=width + step, per_prompt=per_prompt)
                            rows_starts = starts.repeat_interleave(per_prompt)
                            rows_lengths = lengths.repeat_interleave(per_prompt)
                            value = edited_value(value, s.edits, rows_starts, rows_lengths, 0, cells_of)
                            setattr(envoy, what, value)
                        reached[0] = step + 1
                except OutOfOrderError:
                    pass  # the open loop asked for a pass after the generation's last: how it ends
        with tracer.invoke():
            sequences = nnsight.save(tracer.result)
    return sequences, reached[0]


def step_cells(
    edit: Edit,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
    first: int,
    *,
    end: int,
    per_prompt: int,
) -> torch.Tensor:
    """The cells (rows, width) bool `edit` touches in one forward pass of a generation (positions and
    sequences as the module doc says), `cell_mask`'s signature for `edited_value`.

    Args:
        starts: (rows,) each row's first prompt token's column in the left-padded batch.
        lengths: (rows,) each row's prompt length.
        width: the tokens this pass computes (the last `width` of the `end` tokens so far).
        first: the index of the first row's prompt.
        end: the columns computed so far, this pass's included (the padded prompt, then one per step).
        per_prompt: output rows per prompt (rows ``i * per_prompt ..`` belong to prompt ``first + i``).
    """
    rows = len(starts)
    chosen = torch.ones(rows, dtype=torch.bool)
    if edit.sequences is not None:
        prompt = first + torch.arange(rows) // per_prompt
        chosen = torch.isin(prompt, torch.tensor(list(edit.sequences)))
    position = end - width + torch.arange(width)[None, :] - starts[:, None]  # (rows, width)
    if edit.positions is None:
        picked = position >= 0
    else:
        picked = torch.zeros(rows, width, dtype=torch.bool)
        for p in edit.positions:
            at = lengths + p if p < 0 else torch.full_like(lengths, p)
            picked |= position == at[:, None]
    return picked & chosen[:, None]


def _check_for_generation(edit: Edit, dim: int | None, lengths: torch.Tensor) -> None:
    """ValueError in one line for an edit a generation of prompts of `lengths` (n,) cannot apply: a prompt
    index out of range, a negative position before a prompt's first token, a value that is no (dim,)
    vector (`dim`: the site's width, None where only the module's first pass knows it)."""
    where = f"the edit of site {edit.site!r} layer {edit.layer}"
    n = len(lengths)
    chosen = list(range(n)) if edit.sequences is None else list(edit.sequences)
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise ValueError(f"{where}: sequence {bad[0]} out of range, there are {n} prompts")
    shortest = int(lengths[chosen].min())
    if edit.positions is not None and min(edit.positions) < -shortest:
        raise ValueError(
            f"{where}: position {min(edit.positions)} is before the first token of a {shortest}-token prompt"
        )
    if edit.op in ("set", "add", "mean") and edit.value is not None:
        shape = tuple(torch.as_tensor(edit.value).shape)
        if len(shape) != 1 or (dim is not None and shape != (dim,)):
            want = f"({dim},)" if dim is not None else "(dim,)"
            raise ValueError(f"{where}: its value is {shape}; in a generation it must be one {want} vector")


def _rows(value: Any) -> int:
    """The batch rows of a module's value (a tensor, or a tuple whose first tensor leads with them)."""
    leaves = list(value) if isinstance(value, (tuple, list)) else [value]
    return next(int(v.shape[0]) for v in leaves if isinstance(v, torch.Tensor))


def _eos_ids(hf: Any, kwargs: dict[str, Any]) -> set[int]:
    """The end-of-sequence ids the generation stops at: ``eos_token_id`` as passed, else the model's."""
    eos = kwargs.get("eos_token_id", getattr(hf.generation_config, "eos_token_id", None))
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _generation(
    sequences: torch.Tensor, seqs: list[list[int]], width: int, eos: set[int], tokenizer: Any
) -> Generation:
    """`Generation` of ``generate``'s output `sequences` (rows, width + new) for prompts `seqs`."""
    per_prompt = len(sequences) // len(seqs)
    prompt_ids, token_ids = [], []
    for row in range(len(sequences)):
        prompt_ids.append(torch.tensor(seqs[row // per_prompt], dtype=torch.long))
        new = sequences[row, width:]
        ends = [j for j, t in enumerate(new.tolist()) if t in eos]
        token_ids.append(new[: ends[0] + 1] if ends else new)
    texts = [tokenizer.decode(ids.tolist(), skip_special_tokens=True) for ids in token_ids]
    return Generation(sequences, prompt_ids, token_ids, texts)
