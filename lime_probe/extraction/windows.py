"""Fixed-length token windows: the unit of text for statistics averaged over sequences (e.g. entropy).

Per-document sequences mix lengths (a WikiText heading is 6 tokens, a paragraph hundreds), and a
per-sequence statistic such as matrix entropy grows with the number of tokens, so an average over
documents mostly measures how the text was cut. Windows of one length remove that dependence:

    ids = token_windows(texts, tokenizer, window=512, num_windows=64, seed=0)
    acts = lime_probe.extract(model, tokenizer, ids, sites="values", max_length=512, pretokenized=True)

Packing (as the official code's training rows, src/datasets/preprocessing_fineweb.py): every document is
encoded without special tokens and framed as ``[BOS] + tokens + [EOS]`` (a token the tokenizer lacks is
left out), the documents are concatenated in order and the stream is cut into consecutive
non-overlapping windows; the incomplete tail is dropped. Documents that encode to no tokens (blank
lines) are skipped. The windows depend only on the texts, the tokenizer's vocabulary and the seed, so
two checkpoints sharing a tokenizer see the same token ids.

Data that does not fit the tokenizer (`check_unknown_tokens`, ours): where the tokenizer has an unknown
token of its own, the share of the measured tokens that are it is checked before any forward pass. Above
`UNKNOWN_REFUSE` (10 %) the text is refused, above `UNKNOWN_WARN` (1 %) a `DataWarning` says so. A
tokenizer that fits its language gives next to no unknown tokens (byte-level BPE none by construction);
one that does not (a character vocabulary of digits meeting English prose) gives most of the tokens
(95 % for the demo's arithmetic checkpoints on WikiText). WikiText-2's own ``<unk>`` markers (5.5 % of the
words of valid.txt, 6.3 % of test.txt) become the unknown token of a tokenizer whose unknown token is
``<unk>`` (LLaMA's, for one) and count too, so the refusal sits above them: between 1 % and 10 % the
numbers are reported with a warning, above 10 % they would describe the unknown token more than the text.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from lime_probe.protocol import OFFICIAL_WINDOW

UNKNOWN_WARN = 0.01  # share of unknown tokens above which a DataWarning is raised (ours)
UNKNOWN_REFUSE = 0.10  # share above which the text is refused unless allowed (ours; see the module doc)


class DataWarning(UserWarning):
    """The data allows the analysis but weakens it (unknown tokens, fewer rows than asked); the command
    line prints it as one line."""


def unknown_token_share(sequences: Sequence[Sequence[int]], tokenizer: Any) -> float | None:
    """The share of the tokens of `sequences` (token id lists) that are `tokenizer`'s unknown token, or
    None when the tokenizer has no unknown token of its own (none, or one shared with BOS/EOS as GPT-2's)."""
    unk = tokenizer.unk_token_id
    if unk is None or unk in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        return None
    total = sum(len(s) for s in sequences)
    return sum(list(s).count(unk) for s in sequences) / total if total else None


def check_unknown_tokens(sequences: Sequence[Sequence[int]], tokenizer: Any, allow: bool = False) -> None:
    """ValueError when over `UNKNOWN_REFUSE` of the tokens of `sequences` are the tokenizer's unknown token
    (unless `allow`); a `DataWarning` when over `UNKNOWN_WARN` (or allowed over the refusal)."""
    share = unknown_token_share(sequences, tokenizer)
    if share is None or share <= UNKNOWN_WARN:
        return
    what = (
        f"{share:.1%} of the {sum(len(s) for s in sequences)} measured tokens are the tokenizer's unknown "
        f"token {tokenizer.unk_token!r}"
    )
    if share > UNKNOWN_REFUSE and not allow:
        raise ValueError(
            f"the data does not fit the tokenizer: {what} (over {UNKNOWN_REFUSE:.0%}); give text in the "
            "tokenizer's language, or --allow-unknown-tokens to measure it anyway"
        )
    note = (
        "; the numbers partly describe that token, not the text (text that spells the token out counts too)"
    )
    warnings.warn(what + note, DataWarning, stacklevel=3)


def max_positions(model_or_config: Any) -> int | None:
    """The model's maximum number of positions (``max_position_embeddings``, or GPT-2's
    ``n_positions``), or None for models without a limit (e.g. pure RoPE without a stated maximum).

    Accepts a Hugging Face model or config, or an nnsight model wrapping one.
    """
    from lime_model.checks import config_positions

    obj = getattr(model_or_config, "_module", model_or_config)  # nnsight wrapper -> HF model
    return config_positions(getattr(obj, "config", obj))


def default_window(model_or_config: Any, preferred: int = OFFICIAL_WINDOW) -> tuple[int, str]:
    """The default window length ``min(preferred, max positions)`` and which bound applied.

    Returns (length, source) with source "official" when `preferred` (the official code's 2048-token
    rows) fits the model, else "max_positions" (the model's limit, smaller than `preferred`).
    """
    if not isinstance(preferred, int) or preferred < 2:
        raise ValueError(f"preferred window must be an integer >= 2, got {preferred!r}")
    limit = max_positions(model_or_config)
    if limit is not None and limit < preferred:
        return limit, "max_positions"
    return preferred, "official"


def pack_tokens(texts: Sequence[str], tokenizer: Any) -> list[int]:
    """The concatenated token stream of `texts`: ``[BOS] + tokens + [EOS]`` per non-empty document."""
    if (
        isinstance(texts, str)
        or not isinstance(texts, Sequence)
        or not all(isinstance(t, str) for t in texts)
    ):
        raise ValueError("texts must be a list of strings")
    if not texts:
        raise ValueError("texts is empty: nothing to pack into windows")
    frame_start = [] if tokenizer.bos_token_id is None else [int(tokenizer.bos_token_id)]
    frame_end = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    stream: list[int] = []
    # whole documents, cut into windows afterwards: no length check (verbose=False skips transformers'
    # "longer than the maximum sequence length" warning, which does not apply to a packed stream)
    for ids in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]:
        if ids:
            stream += frame_start + ids + frame_end
    return stream


def token_windows(
    texts: Sequence[str],
    tokenizer: Any,
    window: int,
    num_windows: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Non-overlapping `window`-token windows of the packed `texts` (see the module docstring).

    Args:
        texts: documents, in order: a list, since the windows are drawn at random from the whole packed
            corpus (per-document input can stream instead: `lime_probe.extract` takes an iterable).
        tokenizer: a Hugging Face tokenizer (its BOS/EOS frame each document).
        window: tokens per window (>= 2).
        num_windows: how many windows to keep, drawn without replacement with `seed`; None keeps all.
        seed: the draw's seed; the same texts, tokenizer and seed always give the same windows.

    Returns:
        `num_windows` lists of `window` token ids, in their order in the text.

    Raises:
        ValueError: bad arguments, or fewer complete windows in the text than `num_windows`.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    if num_windows is not None and (not isinstance(num_windows, int) or num_windows < 1):
        raise ValueError(f"num_windows must be a positive integer or None, got {num_windows!r}")
    stream = pack_tokens(texts, tokenizer)
    available = len(stream) // window
    if available == 0 or (num_windows is not None and num_windows > available):
        raise ValueError(
            f"the text packs into {len(stream)} tokens = {available} complete window(s) of {window}; "
            f"asked for {num_windows or 1}: give more text, a shorter window or fewer windows"
        )
    starts = np.arange(available) * window
    if num_windows is not None:
        starts = np.sort(np.random.default_rng(seed).choice(starts, size=num_windows, replace=False))
    return [stream[s : s + window] for s in starts.tolist()]
