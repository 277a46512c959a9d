"""The logit lens (nostalgebraist, 2020): what each layer's residual stream already predicts, read through the
model's own final norm and unembedding.

For layer l of ``hidden`` (X_0 = the embeddings, X_l = the output of block l, L blocks) the lens logits of a
token are W_U norm(X_l) (+ the head's bias), computed by the model's own modules; at l = L they are the
model's logits. Per layer, over every token that has a next token in its sequence:

- next-token cross-entropy, -log softmax(lens logits)[next token], in nats (at l = L: the model's loss);
- top-1 agreement: the share of tokens whose lens argmax equals the model's own prediction (the argmax at
  l = L; 1 there by construction).

    acts = lime_probe.extract(model, tok, texts, sites="hidden", logprobs=True)
    lens = lime_probe.logit_lens(model, acts)     # {layer: LensLayer}
    lens[3].cross_entropy, lens[3].agreement

Any causal LM whose head is ``get_output_embeddings()`` applied to its final norm's output works (LIMe, the
LLaMA family, GPT-2, GPT-NeoX and models found without an adapter); `lens_head` refuses others in one line,
and `logit_lens` checks that the last layer's lens reproduces the model's own log-probabilities.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from tqdm.auto import tqdm

from lime_probe.extraction.adapters import adapter_for

# Rows per unembedding pass: their (rows, vocab) float32 logits are 100 MB at a 50,000-token vocabulary.
LENS_ROWS = 512
# The last layer's lens must give the model's own next-token NLL within this many nats per token (ours): equal
# up to float round-off in float32, within a few 1e-3 in bfloat16 (the same modules on the same inputs).
LOSS_TOLERANCE = 1e-2


def lens_head(model: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(final norm, unembedding) of a causal LM (a Hugging Face model or an nnsight wrapper of one): the
    adapter's final norm (registered, or found by `verified_places`) and
    ``get_output_embeddings()``. ValueError in one line for a model without either."""
    hf = getattr(model, "_module", model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if head is None:
        raise ValueError(
            f"the logit lens needs a causal LM with an unembedding (get_output_embeddings()); "
            f"{type(hf).__name__} has none"
        )
    norm = adapter_for(hf).final_norm
    if norm is None:
        raise ValueError(
            f"the logit lens needs the final norm of {type(hf).__name__}, and none was found (registered, or the "
            "one module mapping the last block's output to the model's); register an adapter naming it"
        )
    return hf.base_model.get_submodule(norm), head


def _execution_device(module: torch.nn.Module, weight: torch.Tensor) -> torch.device:
    """Where `module` runs: accelerate's execution device for a dispatched (possibly offloaded) module."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device) if device is not None else weight.device


@torch.inference_mode()
def lens_logits(hidden: torch.Tensor, norm: torch.nn.Module, unembed: torch.nn.Module) -> torch.Tensor:
    """Lens logits of residual-stream rows: hidden (n, d) -> unembed(norm(hidden)) (n, vocab) float32, run
    in the unembedding's dtype on its device (extraction gives float32; a float16/bfloat16 stream converts
    back exactly)."""
    weight = cast(torch.Tensor, unembed.weight)  # a linear layer's weight (torch types it tensor or module)
    return unembed(norm(hidden.to(_execution_device(unembed, weight), weight.dtype))).float()


def sequence_lens(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    norm: torch.nn.Module,
    unembed: torch.nn.Module,
    reference: torch.Tensor | None = None,
) -> tuple[float, int, torch.Tensor]:
    """The lens of one sequence at one layer: hidden (t, d), ids (t,) -> (summed next-token NLL over its t-1
    predictions, how many of them agree with `reference` (t-1,) (None: with themselves), their top-1 ids
    (t-1,)). Rows go through the head `LENS_ROWS` at a time."""
    targets = ids[1:]  # position i predicts token i+1; the last position predicts nothing here
    nll, rows = 0.0, []
    for start in range(0, len(targets), LENS_ROWS):
        logits = lens_logits(hidden[start : min(start + LENS_ROWS, len(targets))], norm, unembed)
        target = targets[start : start + len(logits)].to(logits.device)
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        rows.append(logits.argmax(-1).cpu())
    top1 = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    agree = len(top1) if reference is None else int((top1 == reference).sum())
    return nll, agree, top1


@dataclass(frozen=True)
class LensLayer:
    """The lens of one layer, per sequence: ``nll`` (s,) summed next-token NLL in nats, ``agree`` (s,) tokens
    whose top-1 equals the model's, ``count`` (s,) predicted tokens (each sequence's length - 1); ``top1``
    the per-sequence top-1 ids when kept (the reference layer's), else None."""

    nll: np.ndarray
    agree: np.ndarray
    count: np.ndarray
    top1: list[torch.Tensor] | None = None

    @property
    def cross_entropy(self) -> float:
        """Mean next-token NLL per predicted token (nats)."""
        return float(self.nll.sum() / self.count.sum())

    @property
    def agreement(self) -> float:
        """Share of predicted tokens whose top-1 equals the model's own."""
        return float(self.agree.sum() / self.count.sum())


def lens_layer(
    sequences: Iterable[torch.Tensor],
    ids: Sequence[torch.Tensor],
    norm: torch.nn.Module,
    unembed: torch.nn.Module,
    reference: Sequence[torch.Tensor] | None = None,
) -> LensLayer:
    """`sequence_lens` of every sequence of one layer: `sequences` yields (t_i, d) in order (streamed, e.g.
    from the activation cache), `ids` holds their token ids (t_i,), `reference` the model's top-1 per sequence
    (None: this is the reference layer, and its top-1 ids are kept)."""
    nll, agree, count, top1 = [], [], [], []
    for i, hidden in enumerate(sequences):
        n, a, t = sequence_lens(hidden, ids[i], norm, unembed, None if reference is None else reference[i])
        nll.append(n)
        agree.append(a)
        count.append(len(t))
        if reference is None:
            top1.append(t)
    if len(count) != len(ids):
        raise ValueError(f"got {len(count)} sequences of hidden states for {len(ids)} sequences of token ids")
    return LensLayer(
        np.asarray(nll, dtype=np.float64),
        np.asarray(agree, dtype=np.int64),
        np.asarray(count, dtype=np.int64),
        top1 if reference is None else None,
    )


def check_model_loss(reference: LensLayer, logprobs: torch.Tensor) -> None:
    """ValueError unless the last layer's lens gives the model's own summed log-probabilities (`logprobs` (s,),
    as ``extract(..., logprobs=True)`` returns them) within `LOSS_TOLERANCE` nats per token: a model whose
    logits are not unembed(final norm(X_L)) (e.g. a soft-capped or rescaled head) cannot be read this way."""
    gap = abs(reference.nll.sum() + float(logprobs.double().sum())) / max(1, reference.count.sum())
    if gap > LOSS_TOLERANCE:
        raise ValueError(
            f"the last layer's logit lens is {gap:.3g} nats per token away from the model's own loss: its logits "
            "are not its unembedding of its final norm's output, which the logit lens reads"
        )


def logit_lens(
    model: Any, acts: Any, *, progress: bool = True, desc: str = "logit lens"
) -> dict[int, LensLayer]:
    """The lens of every extracted layer of ``acts["hidden"]`` (`Activations` of `model` with ``pool="none"``,
    every token of each sequence, and the last layer X_L), keyed by layer; with ``acts.logprobs`` (extracted
    with ``logprobs=True``) the last layer is checked against the model's own loss (`check_model_loss`)."""
    norm, unembed = lens_head(model)
    hf = getattr(model, "_module", model)
    last = len(hf.base_model.get_submodule(adapter_for(hf).layers))
    if "hidden" not in acts or last not in acts["hidden"]:
        raise ValueError(f"the logit lens needs the hidden site with its last layer, X_{last}, extracted")
    if not getattr(acts, "all_tokens", True) or (acts.token_ids < 0).any():
        raise ValueError("the logit lens needs every token's row: extract with pool='none' and no token_ids")
    ids = list(torch.split(acts.token_ids, acts.offsets.diff().tolist()))

    def stream(layer: int) -> Iterable[torch.Tensor]:
        return (seq for chunk in acts.iter_sequences("hidden", layer) for seq in chunk)

    out = {last: lens_layer(stream(last), ids, norm, unembed)}
    if acts.logprobs is not None:
        check_model_loss(out[last], acts.logprobs)
    reference = out[last].top1
    for layer in tqdm(
        [x for x in acts.layers("hidden") if x != last], desc=desc, unit="layer", disable=not progress
    ):
        out[layer] = lens_layer(stream(layer), ids, norm, unembed, reference)
    return dict(sorted(out.items()))


def lens_top_tokens(model: Any, tokenizer: Any, acts: Any, k: int = 5, sequences: int = 4) -> list[dict]:
    """The per-token logit lens as a table: for each of the first `sequences` sequences of ``acts["hidden"]``
    (every token's row), each position with a next token and each extracted layer, the lens's `k` most
    probable next tokens, decoded. A row per (sequence, position, layer, rank): token (the input token at the
    position), next (the token that follows), rank, prediction, probability, and whether it is the next token."""
    if k < 1 or sequences < 1:
        raise ValueError(f"k and sequences must be positive, got {k} and {sequences}")
    if not getattr(acts, "all_tokens", True) or (acts.token_ids < 0).any():
        raise ValueError(
            "the per-token lens needs every token's row: extract with pool='none' and no token_ids"
        )
    norm, unembed = lens_head(model)
    ids = list(torch.split(acts.token_ids, acts.offsets.diff().tolist()))[:sequences]
    rows = []
    for layer in acts.layers("hidden"):
        for s, hidden in enumerate(acts.sequences("hidden", layer)[: len(ids)]):
            probs = lens_logits(hidden[:-1], norm, unembed).softmax(-1)  # (t - 1, vocab)
            top = probs.topk(min(k, probs.shape[-1]), dim=-1)
            for p in range(len(probs)):
                nxt = int(ids[s][p + 1])
                for rank, (prob, tid) in enumerate(
                    zip(top.values[p].tolist(), top.indices[p].tolist(), strict=True)
                ):
                    rows.append(
                        {"sequence": s, "position": p, "token": tokenizer.decode([int(ids[s][p])]),
                         "next": tokenizer.decode([nxt]), "layer": layer, "rank": rank + 1,
                         "prediction": tokenizer.decode([tid]), "probability": prob, "correct": tid == nxt}
                    )  # fmt: skip
    return rows
