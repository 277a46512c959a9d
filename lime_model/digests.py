"""Content digests that key caches: of texts (or token id lists) and of tokenizers.

Both the training data cache (`lime_model.data`) and the activation cache (`lime_probe.extraction.cache`) key on
these, so one definition serves both. Imports nothing heavy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any


def texts_hash(texts: Iterable[str | Sequence[int]]) -> str:
    """SHA-256 (hex) of the texts in order; stable across processes and runs.

    Token id lists (pre-tokenised input) hash as their space-joined ids behind a marker, so they never
    collide with a text of the same characters.
    """
    h = hashlib.sha256()
    for t in texts:
        item = t if isinstance(t, str) else "\0ids:" + " ".join(map(str, t))
        h.update(hashlib.sha256(item.encode()).digest())
    return h.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """A digest that changes whenever the tokenizer would split text differently: the full
    serialisation of a fast tokenizer (vocabulary, merges, normaliser, special-token template),
    else its class and vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = repr([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
