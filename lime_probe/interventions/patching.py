"""Activation patching, attribution patching and direct logit attribution on clean/corrupt prompt pairs.

A `Pair` is a clean and a corrupt prompt of equal token length and the answer and wrong-answer tokens; the
metric is the logit difference at the last position, logit(answer) - logit(wrong), averaged over pairs.
A patching score is its normalised recovery (as TransformerLens's IOI demo normalises it; ours to average
over pairs before normalising): ``(LD_patched - LD_corrupt) / (LD_clean - LD_corrupt)``, 0 for the corrupt
run and 1 for the clean one.

- `activation_patching`: the corrupt run with one cell (layer, position[, head]) of a site set to its clean
  value, every cell of the grid, several patched runs per forward pass (one batch row each).
- `attribution_patching`: its first-order estimate from one forward and one backward pass (Nanda,
  "Attribution Patching", 2023): ``(a_clean - a_corrupt) . d LD / d a`` at the corrupt run, normalised alike.
- `direct_logit_attribution`: what each block's attention and MLP output (and the embeddings) add to the
  last position's logit difference through the final norm with its scale frozen at the clean run's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from lime_probe.extraction.activations import Activations
from lime_probe.extraction.batching import first_position_of, pad_batch
from lime_probe.extraction.planning import plan_sites
from lime_probe.extraction.tracing import as_nnsight
from lime_probe.interventions.edits import Edit
from lime_probe.interventions.pairs import Pair
from lime_probe.interventions.run import (
    EditedRun,
    consecutive_batches,
    plan_steps,
    run_with_edits,
    traced_forward,
)


@dataclass
class PatchingResult:
    """A patching grid over (layer, position[, head]) and the baselines it is normalised by.

    Attributes:
        site: the patched site.
        scores: (n_layers, n_positions) or (n_layers, n_positions, n_heads): the normalised recovery.
        layers: the layer index of each row.
        clean_diff, corrupt_diff: the mean logit differences of the clean and the corrupt runs.
        tokens: the first pair's corrupt tokens, decoded (the position axis's labels).
    """

    site: str
    scores: torch.Tensor
    layers: list[int]
    clean_diff: float
    corrupt_diff: float
    tokens: list[str]

    def rows(self) -> list[dict]:
        """Tidy rows: site, layer, position (and head), score."""
        out = []
        for i, layer in enumerate(self.layers):
            for p in range(self.scores.shape[1]):
                heads = range(self.scores.shape[2]) if self.scores.dim() == 3 else [None]
                for h in heads:
                    score = self.scores[i, p] if h is None else self.scores[i, p, h]
                    row = {"site": self.site, "layer": layer, "position": p, "token": self.tokens[p]}
                    out.append(row | ({} if h is None else {"head": h}) | {"score": float(score)})
        return out


def pair_tokens(
    tokenizer: Any, pairs: Sequence[Pair]
) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """Token ids of the clean and corrupt prompts and the (n_pairs, 2) answer / wrong token ids; ValueError in
    one line naming the pair for unequal lengths, an answer that is not one token, or pairs of unequal lengths
    (a position grid compares positions across pairs)."""
    if not pairs:
        raise ValueError("no pairs: patching needs at least one clean/corrupt pair")
    clean: list[list[int]] = []
    corrupt: list[list[int]] = []
    answers: list[list[int]] = []
    for i, pair in enumerate(pairs):
        c, k = _ids(tokenizer, pair.clean), _ids(tokenizer, pair.corrupt)
        if len(c) != len(k):
            raise ValueError(
                f"pair {i}: the clean prompt has {len(c)} tokens and the corrupt one {len(k)}; they must match"
            )
        if clean and len(c) != len(clean[0]):
            raise ValueError(
                f"pair {i} has {len(c)} tokens and pair 0 {len(clean[0])}: every pair must have one length"
            )
        clean.append(c)
        corrupt.append(k)
        answers.append([_one_token(tokenizer, pair.answer, i), _one_token(tokenizer, pair.wrong, i)])
    return clean, corrupt, torch.tensor(answers)


def _ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    return list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]


def _one_token(tokenizer: Any, token: str | int, i: int) -> int:
    if isinstance(token, int):
        if not 0 <= token < len(tokenizer):
            raise ValueError(f"pair {i}: token id {token} is outside the tokenizer's {len(tokenizer)} tokens")
        return token
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(
            f"pair {i}: the answer {token!r} is {len(ids)} tokens; answers must be one token each"
        )
    return ids[0]


def logit_diff(last_logits: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """logit(answer) - logit(wrong) per row: last_logits (n, V), answers (n, 2) -> (n,)."""
    return last_logits.gather(1, answers).double() @ torch.tensor([1.0, -1.0], dtype=torch.float64)


@dataclass
class _Baselines:
    """What both patchings start from: the pairs' tokens, the clean (and, if read, corrupt) runs with `site`
    read at the chosen layers, and their mean logit differences."""

    clean: list[list[int]]
    corrupt: list[list[int]]
    answers: torch.Tensor
    clean_run: EditedRun
    corrupt_run: EditedRun
    layers: list[int]
    ld_clean: torch.Tensor
    ld_corrupt: torch.Tensor

    def result(self, site: str, scores: torch.Tensor, tokenizer: Any, dtype: torch.dtype) -> PatchingResult:
        """`scores` (differences from the corrupt run's logit difference) normalised into a `PatchingResult`
        in `dtype` (+ 0.0: no -0.0 where a cell changes nothing)."""
        normalised = (scores / (self.ld_clean - self.ld_corrupt)).to(dtype) + 0.0
        tokens = [tokenizer.decode([t]) for t in self.corrupt[0]]
        return PatchingResult(
            site, normalised, self.layers, float(self.ld_clean), float(self.ld_corrupt), tokens
        )


def _baselines(
    nn_model: Any, tokenizer: Any, pairs: Sequence[Pair], site: str, layers: Sequence[int] | None,
    batch_size: int, read_corrupt: bool,
) -> _Baselines:  # fmt: skip
    clean, corrupt, answers = pair_tokens(tokenizer, pairs)
    clean_run = run_with_edits(
        nn_model, tokenizer, clean, read=[site], read_layers=layers, batch_size=batch_size
    )
    corrupt_run = run_with_edits(
        nn_model,
        tokenizer,
        corrupt,
        read=[site] if read_corrupt else (),
        read_layers=layers,
        batch_size=batch_size,
    )
    assert clean_run.acts is not None
    return _Baselines(
        clean, corrupt, answers, clean_run, corrupt_run, clean_run.acts.layers(site),
        logit_diff(clean_run.last_logits, answers).mean(), logit_diff(corrupt_run.last_logits, answers).mean(),
    )  # fmt: skip


def activation_patching(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[Pair],
    site: str = "hidden",
    layers: Sequence[int] | None = None,
    per_head: bool = False,
    batch_size: int = 32,
) -> PatchingResult:
    """Patch every (layer, position[, head]) cell of `site` from the clean into the corrupt run.

    Each patched run is one batch row: the corrupt prompt of one pair with one cell set to the clean run's
    value, so a forward pass of `batch_size` rows patches `batch_size` cells (of every pair: the rows are
    the cells x pairs). ``scores[layer, position]`` is the normalised logit-difference recovery.

    Args:
        site: an extraction site (``hidden``, ``attn_out``, ``mlp_out``, ``values``, ``routed_values``, ...).
        layers: its layers to patch (None: all).
        per_head: patch each kv head of a per-head site (keys/values) on its own.
    """
    nn_model, tokenizer = as_nnsight(model, tokenizer)
    base = _baselines(nn_model, tokenizer, pairs, site, layers, batch_size, read_corrupt=False)
    clean_acts, chosen = cast(Activations, base.clean_run.acts), base.layers
    n_pairs, length = len(pairs), len(base.clean[0])
    if per_head and site not in clean_acts.heads:
        raise ValueError(f"per-head patching needs a per-head site (keys/values), not {site!r}")
    n_heads = clean_acts.heads[site][0] if per_head else 1
    cells = [(layer, p, h) for layer in chosen for p in range(length) for h in range(n_heads)]
    clean_rows = {layer: clean_acts[site][layer].unflatten(0, (n_pairs, length)) for layer in chosen}
    edits, texts = [], []
    for row, (layer, p, h) in enumerate(cells):
        for pair in range(n_pairs):
            index = row * n_pairs + pair
            edits.append(
                Edit(site, layer, "set", clean_rows[layer][pair, p], positions=[p], sequences=[index],
                     heads=[h] if per_head else None)
            )  # fmt: skip
            texts.append(base.corrupt[pair])
    patched = run_with_edits(nn_model, tokenizer, texts, edits, batch_size=batch_size)
    ld = logit_diff(patched.last_logits, base.answers.repeat(len(cells), 1)).view(len(cells), n_pairs).mean(1)
    scores = (ld - base.ld_corrupt).view(len(chosen), length, n_heads)
    return base.result(site, scores if per_head else scores[..., 0], tokenizer, torch.float64)


def attribution_patching(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[Pair],
    site: str = "hidden",
    layers: Sequence[int] | None = None,
    batch_size: int = 32,
) -> PatchingResult:
    """The first-order estimate of `activation_patching`'s grid: per cell ``(a_clean - a_corrupt) . grad``,
    the gradient of the corrupt run's mean logit difference w.r.t. the cell's activation, summed over pairs
    (the first-order change of the mean) and normalised as the patching scores are. One backward pass per batch of pairs, whatever the grid."""
    nn_model, tokenizer = as_nnsight(model, tokenizer)
    base = _baselines(nn_model, tokenizer, pairs, site, layers, batch_size, read_corrupt=True)
    clean_acts, corrupt_acts = (
        cast(Activations, base.clean_run.acts),
        cast(Activations, base.corrupt_run.acts),
    )
    n_pairs, length = len(pairs), len(base.clean[0])
    grads = _site_gradients(nn_model, tokenizer, base.corrupt, base.answers, site, base.layers, batch_size)
    # the gradients are of the mean over pairs already: summing the pairs' terms averages them once
    scores = torch.stack(
        [
            ((clean_acts[site][layer] - corrupt_acts[site][layer]).double() * grads[layer])
            .sum(-1)
            .view(n_pairs, length)
            .sum(0)
            for layer in base.layers
        ]
    )
    return base.result(site, scores, tokenizer, torch.float32)


def _site_gradients(
    nn_model: Any,
    tokenizer: Any,
    seqs: list[list[int]],
    answers: torch.Tensor,
    site: str,
    layers: list[int],
    batch_size: int,
) -> dict[int, torch.Tensor]:
    """d (mean logit difference over all sequences) / d activation at `site`, each layer (n_tokens, dim)
    float64: a zero tensor that requires grad added at every token of every layer, then one backward pass."""
    hf = nn_model._module
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    plan = plan_sites(hf, [site], None, len(seqs[0]))
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    first = 0
    for chunk in consecutive_batches([len(s) for s in seqs], batch_size, 4096):
        batch = pad_batch([seqs[i] for i in chunk], pad_id, tokenizer.padding_side, first_position_of(hf))
        n_cells = int(batch["attention_mask"].sum())
        leaves, edits = {}, []
        for layer in layers:
            leaves[layer] = torch.zeros(n_cells, plan.dims[site], dtype=hf.dtype, requires_grad=True)
            edits.append(
                Edit(site, layer, "add", leaves[layer], sequences=list(range(first, first + len(chunk))))
            )
        steps = plan_steps(hf, plan, edits, (), None)
        with torch.enable_grad():
            logits, _ = traced_forward(nn_model, batch, steps, first)
            final = logits[:, -1]  # every sequence has the pairs' one length: no padding
            metric = logit_diff(final, answers[chunk].to(final.device)).sum() / len(seqs)
            grads = torch.autograd.grad(metric, [leaves[layer] for layer in layers])
        for layer, g in zip(layers, grads, strict=True):
            out[layer].append(g.double())
        first += len(chunk)
    return {layer: torch.cat(gs) for layer, gs in out.items()}
