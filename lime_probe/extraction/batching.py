"""Padded batches of token id lists, the one way every traced forward pass of this package is fed:
`plan_batches` groups sequences by length within a token budget, `pad_batch` pads a group with positions
counted per sequence, from `first_position_of` the model, so a token sees the same position alone and in
a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Tokens per batch, padding included (ours): on one CPU thread, BLiMP sentences (about 12 tokens) ran at
# 320 seq/s in batches of 8, 640 of 32 and 690 of 128 (about 1,500 tokens); 4,096 is past that knee on
# a CPU and keeps a GPU busy, while a batch's logits (tokens x vocabulary) stay under about 0.5 GB at a
# 32,000-token vocabulary.
DEFAULT_BATCH_TOKENS = 4096


def pad_batch(
    sequences: list[list[int]], pad_id: int, side: str, first_position: int = 0
) -> dict[str, torch.Tensor]:
    """Pad token id lists to a batch: input_ids, attention_mask and position_ids, each (batch, seq).

    Positions count each sequence's own tokens from `first_position` (`first_position_of` the model)
    whichever side is padded, so a token sees the same position alone and in a batch (absolute-position
    models like GPT-2 depend on it).
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, cols] = torch.tensor(seq, dtype=torch.long)
        mask[row, cols] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0) + first_position
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def first_position_of(hf: Any) -> int:
    """The position id a model gives a sequence's first token when it counts them itself: RoBERTa-style
    embeddings start after their padding index (``padding_idx + 1``), others at their ``position_ids``
    buffer's first entry (Nystromformer's 2), most at 0."""
    embeddings = getattr(hf.base_model, "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    if isinstance(table, torch.nn.Embedding) and table.padding_idx is not None:
        return int(table.padding_idx) + 1
    buffer = getattr(embeddings, "position_ids", None)
    return int(buffer.flatten()[0]) if isinstance(buffer, torch.Tensor) and buffer.numel() else 0


def plan_batches(lengths: Sequence[int], batch_size: int | None, batch_tokens: int) -> list[list[int]]:
    """Batches of indices into `lengths`: longest sequence first (ties in input order), then cut into
    batches of `batch_size` sequences or, when it is None, of as many as keep the padded batch (count x
    its longest length) within `batch_tokens`; a longer sequence makes a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        full = batches and (
            len(batches[-1]) >= batch_size
            if batch_size is not None
            else (len(batches[-1]) + 1) * lengths[batches[-1][0]] > batch_tokens
        )
        if not batches or full:
            batches.append([])
        batches[-1].append(i)
    return batches
