"""Tokenizers for training: an existing one, a byte-level BPE trained on the data, or characters.

All are `PreTrainedTokenizerFast` with bos/eos/pad tokens, so `save_pretrained(DIR)` makes
`AutoTokenizer.from_pretrained(DIR)` work.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"


def _wrap(backend: Tokenizer, unk: str | None = None) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=unk,
        clean_up_tokenization_spaces=False,
    )


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE with ``vocab_size`` entries (specials included) trained on ``texts``.

    Small corpora may yield fewer merges, hence a smaller vocabulary than asked for.
    """
    if vocab_size < 256 + 3:
        raise ValueError(
            f"a byte-level BPE needs vocab_size >= 259 (256 bytes + 3 specials), got {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return _wrap(backend)


def char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """One token per character of ``chars`` (ids 4..), after pad, bos, eos, unk (ids 0-3)."""
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *dict.fromkeys(chars)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return _wrap(backend, unk=UNK)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A tokenizer directory (or hub name); gives it an eos and a pad token if it lacks them."""
    path = Path(name_or_path)
    if (path.exists() or name_or_path.startswith((".", "/", "~"))) and not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {name_or_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name_or_path)
    except OSError as e:
        raise FileNotFoundError(f"cannot load tokenizer {name_or_path!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no eos token, needed between packed documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
