"""``lime-probe demo``: the paper's story on a laptop, offline, in minutes.

Trains a tiny LIMe and its LLaMA twin (same recipe, ``routing="none"``) on the built-in
arithmetic expression task, then runs every analysis that applies to them and writes the
figures, the results and one HTML report:

- accuracy by operand count (paper Figure 4b) and training loss vs FLOPs and tokens (Figures 1, 10);
- matrix entropy of the values and of the hidden states per layer (Figures 4a, 7a);
- separability and t-SNE of close numbers, 1-4 and 100-103 (Figure 8);
- the LIMe router weights, layer x buffered layer and per head (Figures 5, 9).

The probed representation of a number. The task's tokenizer has one token per character, so
"103" is three tokens. A causal model has read the whole number only at its last digit, so a
number's representation is the one at the position of its last digit, and only whole numbers
count (the "1" and "0" inside "103" are not occurrences of 1 or 0). With a tokenizer that keeps
numbers whole the same rule picks the number's own token.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

import numpy as np
import torch

NUMBER_SETS = {"1-4": (1, 2, 3, 4), "100-103": (100, 101, 102, 103)}
_WHOLE_NUMBER = re.compile(r"(?<!\d)\d+(?!\d)")


def number_positions(pieces: Sequence[str], numbers: Collection[int]) -> list[tuple[int, int]]:
    """Where whole numbers of ``numbers`` occur in one sequence given as token strings.

    Args:
        pieces: the sequence's tokens as strings (e.g. ``tokenizer.convert_ids_to_tokens``),
            length t; their concatenation is the text.
        numbers: the numbers to find.

    Returns:
        ``(token index of the number's last character, number)`` per occurrence, in text order.
    """
    ends = np.cumsum([len(p) for p in pieces])  # ends[i]: text offset just after token i
    text = "".join(pieces)
    wanted = set(numbers)
    out = []
    for m in _WHOLE_NUMBER.finditer(text):
        if int(m.group()) in wanted:
            out.append((int(np.searchsorted(ends, m.end() - 1, side="right")), int(m.group())))
    return out


def number_rows(offsets: torch.Tensor, token_ids: torch.Tensor, tokenizer,
                numbers: Collection[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Rows of an extraction (``pool="none"``) that hold whole-number occurrences of ``numbers``.

    Args:
        offsets: (n_sequences+1,) row offsets per sequence (``Activations.offsets``).
        token_ids: (n_rows,) token id per row (``Activations.token_ids``).
        tokenizer: the tokenizer that produced the ids.
        numbers: the numbers to find.

    Returns:
        ``(rows, labels)``: LongTensor (n,) of row indices and the number at each, (n,) int.
    """
    pieces = tokenizer.convert_ids_to_tokens(token_ids.tolist())
    rows, labels = [], []
    bounds = offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        for pos, number in number_positions(pieces[start:end], numbers):
            rows.append(start + pos)
            labels.append(number)
    return torch.tensor(rows, dtype=torch.long), np.array(labels, dtype=np.int64)
