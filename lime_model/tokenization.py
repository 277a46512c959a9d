"""Tokenizers for training: an existing one, a byte-level BPE trained on the data, or characters.

All are `PreTrainedTokenizerFast` with bos/eos/pad tokens, so `save_pretrained(DIR)` makes
`AutoTokenizer.from_pretrained(DIR)` work.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

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


def check_vocabulary(
    tokenizer: PreTrainedTokenizerBase, where: str, folder: str | Path | None = None
) -> None:
    """ValueError naming the missing files when ``tokenizer`` knows no token but its special ones: transformers
    loads a folder without its vocabulary files (GPT-2's without vocab.json and merges.txt) as such a
    tokenizer, silently, and every text then encodes to nothing. ``folder``: where the files were looked for."""
    if len(tokenizer) > len(set(tokenizer.all_special_ids)):
        return
    files = list(dict.fromkeys(type(tokenizer).vocab_files_names.values()))
    missing = [f for f in files if folder is None or not (Path(folder) / f).is_file()] or files
    raise ValueError(
        f"the tokenizer of {where} ({type(tokenizer).__name__}) has no vocabulary, only its "
        f"{len(tokenizer)} special token(s): {', '.join(missing)} missing"
        + (f" from {folder}" if folder is not None else "")
        + "; save the complete tokenizer there (tokenizer.save_pretrained)"
    )


def check_embedding(tokenizer: PreTrainedTokenizerBase, model: Any, where: str) -> None:
    """ValueError in one line when ``tokenizer`` can give token ids that ``model``'s input embedding has
    no row for (a tokenizer larger than the model's vocabulary): checked once at load, since such an id
    would otherwise fail mid-run as an IndexError, or silently on a GPU. ``where`` names the checkpoint."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if get is not None else None
    except NotImplementedError:  # a model that does not say: nothing to check against
        return
    weight = getattr(embedding, "weight", None)
    if weight is None or weight.dim() != 2:
        return
    rows = int(weight.shape[0])
    if len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer of {where} has {len(tokenizer)} tokens but the model's embedding holds {rows} "
            f"rows: ids from {rows} on have no embedding; use the tokenizer the model was trained with"
        )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A tokenizer directory (or hub name); gives it an eos and a pad token if it lacks them."""
    path = Path(name_or_path)
    if (path.exists() or name_or_path.startswith((".", "/", "~"))) and not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {name_or_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name_or_path)
    except OSError as e:
        raise FileNotFoundError(f"cannot load tokenizer {name_or_path!r}: {str(e).splitlines()[0]}") from None
    check_vocabulary(tokenizer, repr(name_or_path), path if path.is_dir() else None)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no eos token, needed between packed documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
