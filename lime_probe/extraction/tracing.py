"""Per-layer representations of any supported checkpoint, read through nnsight traces: `extract` tokenises
the texts, cuts them into batches, runs one traced forward pass per batch that reads what `planning` plans
(the sites and their layer indices are listed there) and returns them as `Activations` (`activations`).

    model, tok = lime_probe.load("runs/lime")
    acts = extract(model, tok, texts, sites=["values", "hidden"])
    acts["values"][3]                  # (n_tokens, dim) float32 on CPU, padding removed
    acts.sequences("values", 3)        # list of (t_i, dim), one per sequence
    acts.per_head("values", 3)         # (n_tokens, kv_heads, head_dim)

Rows: every non-padding token (``pool="none"``), only tokens whose id is in ``token_ids``, or one
mean-pooled row per sequence (``pool="mean"``). Padding never reaches a row: batched results equal
one-sequence-at-a-time results, with left or right padding (positions are counted per sequence).

Batches (ours): sequences are sorted by length, longest first, and cut into batches of at most
``batch_tokens`` tokens padding included (`batching.DEFAULT_BATCH_TOKENS`), or of ``batch_size`` sequences
when that is given; results come back in the input order. The sort runs within blocks of about `SHARD_BYTES`
of results or `BLOCK_TOKENS` tokens, whichever is less, so memory stays bounded (pooled results too) and a
cache shard holds consecutive sequences.

Streaming: ``texts`` may be any iterable (a generator, `Corpus` over a large .txt/.jsonl file, a
``datasets`` dataset with ``streaming=True``, whose rows give their "text"). It is read lazily, one block
at a time, in the same blocks and batches as the list of the same texts, so the results are bit-identical
to the list's and memory holds one block plus the results: flat in corpus size when they are pooled
(``pool="mean"``) or go to ``cache_dir`` (read back with `Activations.iter_sequences`). A list is checked
for unknown tokens as a whole before any forward pass, a stream block by block; a ``cache_dir`` key is the
texts' digest, so a stream with a cache is read twice (a one-pass iterator cannot be: pass a `Corpus`).
A stream's `DataWarning` about unknown tokens comes from its first block.

With ``logprobs=True`` (causal LMs) the same forward pass also gives each sequence's summed token
log-probability, sum_{i>=1} log p(t_i | t_<i) (``acts.logprobs``): what minimal-pair scoring needs.

The traced forward pass of each batch is `forward`'s (`trace_batch`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import nnsight
import torch
from tqdm.auto import tqdm

from lime_probe.extraction.activations import Activations, merge_parts
from lime_probe.extraction.assembly import Assembly, Placer
from lime_probe.extraction.batching import DEFAULT_BATCH_TOKENS, first_position_of, pad_batch, plan_batches
from lime_probe.extraction.cache import ShardCache, describe_texts, extraction_key
from lime_probe.extraction.forward import attention_for, trace_batch
from lime_probe.extraction.loading import check_remote, input_device, wrap
from lime_probe.extraction.planning import SitePlan, plan_sites
from lime_probe.extraction.sites import SITES, check_site, module_site
from lime_probe.extraction.windows import DataWarning, check_unknown_tokens

if TYPE_CHECKING:
    from nnsight.modeling.transformers import TransformersModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

POOLS = ("none", "mean")
SHARD_BYTES = 32 * 2**20  # results held in memory before a cache shard is written (and freed)
# Tokens a block holds at most (ours): results alone bound a block only when they are per token; pooled
# (one row per sequence) they would let it grow with the corpus. 16 batches of the default size: enough
# sequences to sort by length, a few MB of token ids.
BLOCK_TOKENS = 16 * DEFAULT_BATCH_TOKENS
TOKENIZE_CHUNK = 256  # texts per tokenizer call (ours): a stream is read this far ahead of its block


# ---------------------------------------------------------------------------------------------------
# Blocks and texts


def _blocks(
    seqs: Iterable[list[int]], row_bytes: int, per_token: bool, batch_size: int | None, batch_tokens: int
) -> Iterator[list[list[int]]]:
    """Consecutive blocks of the token id lists `seqs`, read lazily, each holding about `SHARD_BYTES` of
    results (rows of `row_bytes`, one per token with `per_token`, else one per sequence) or `BLOCK_TOKENS`
    tokens, whichever comes first, and at least one batch: a whole number of `batch_size` sequences (no
    short batch where a block ends), or `batch_tokens` tokens; the last block may hold less."""
    block: list[list[int]] = []
    size = tokens = 0
    for seq in seqs:
        block.append(seq)
        size += row_bytes * (len(seq) if per_token else 1)
        tokens += len(seq)
        if (size >= SHARD_BYTES or tokens >= BLOCK_TOKENS) and (
            len(block) % batch_size == 0 if batch_size is not None else tokens >= batch_tokens
        ):
            yield block
            block, size, tokens = [], 0, 0
    if block:
        yield block


def tokenize_texts(
    tokenizer: Any,
    texts: Iterable[str | list[int]],
    max_length: int,
    token_budget: int | None,
    pretokenized: bool = False,
) -> Iterator[list[int]]:
    """Token id lists of `texts`, lazily (`TOKENIZE_CHUNK` texts per tokenizer call), truncated to
    `max_length`, within `token_budget` tokens in all (the sequence that crosses it is cut short, and no
    text after it is read). With `pretokenized`, `texts` already are token id lists, used as they are."""
    texts, i = iter(texts), 0
    while chunk := list(islice(texts, TOKENIZE_CHUNK)):
        if pretokenized:
            encoded = [list(cast(list[int], t)) for t in chunk]  # checked by `text_items` / `_validate`
        else:
            encoded = tokenizer(chunk, truncation=True, max_length=max_length)["input_ids"]
        for seq in encoded:
            if not seq:
                raise ValueError(f"text {i} tokenizes to no tokens; drop empty texts before extracting")
            if pretokenized and len(seq) > max_length:
                raise ValueError(
                    f"token sequence {i} has {len(seq)} tokens, over max_length={max_length} "
                    "(capped at the model's positions); pre-tokenised input is never truncated"
                )
            i += 1
            if token_budget is not None:
                seq = seq[:token_budget]
                token_budget -= len(seq)
            yield seq
            if token_budget == 0:
                return


def text_items(texts: Iterable[Any], pretokenized: bool) -> Iterator[str | list[int]]:
    """The texts of an iterable input, checked as they are read: strings (token id lists with
    `pretokenized`), or the "text" of each row of a ``datasets`` dataset."""
    for i, t in enumerate(texts):
        if isinstance(t, Mapping):
            if "text" not in t:
                raise ValueError(f"row {i} of the data has no 'text' field, only {sorted(t)}")
            t = t["text"]
        if pretokenized and not _is_token_list(t):
            raise ValueError(f"pretokenized=True: texts must be lists of integer token ids (item {i} is not)")
        if not pretokenized and not isinstance(t, str):
            raise ValueError(f"texts must be strings; item {i} is a {type(t).__name__}")
        yield t


class Corpus:
    """The documents of a .txt/.jsonl/.parquet file or folder, or of ``hf:NAME[:CONFIG][:SPLIT]`` (streamed
    from the hub), read lazily each time it is iterated (`lime_model.data.iter_texts`): at most
    `max_texts` of them. An input for `extract` that never sits in memory whole and can be read twice
    (what ``cache_dir`` needs)."""

    def __init__(self, spec: str | Path, max_texts: int | None = None, split: str | None = None):
        self.spec, self.max_texts, self.split = str(spec), max_texts, split

    def __iter__(self) -> Iterator[str]:
        from lime_model.data import iter_texts

        return islice(iter_texts(self.spec, self.split), self.max_texts)

    def __repr__(self) -> str:
        return f"Corpus({self.spec!r}, max_texts={self.max_texts})"


# ---------------------------------------------------------------------------------------------------
# Extraction


def as_nnsight(
    model: TransformersModel | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[TransformersModel, PreTrainedTokenizerBase]:
    """An nnsight model for `model` (as is when it already is one) and the tokenizer to use: `tokenizer`,
    else the nnsight model's own."""
    if isinstance(model, nnsight.Envoy):
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("this nnsight model carries no tokenizer: extract(model, tokenizer, texts)")
        return model, tokenizer
    if isinstance(model, torch.nn.Module):
        if tokenizer is None:
            raise ValueError(
                f"a {type(model).__name__} carries no tokenizer: extract(model, tokenizer, texts), or load it "
                "with lime_probe.load"
            )
        return wrap(cast("PreTrainedModel", model), tokenizer), tokenizer  # a Hugging Face model
    raise TypeError(f"model must be a Hugging Face model or an nnsight model, not {type(model).__name__}")


def _validate(
    texts: Any, sites: Any, pool: str, token_ids: Any, limits: tuple[int | None, ...], pretokenized: bool
) -> None:
    """Check the arguments of `extract` (`limits`: batch_size, batch_tokens, max_length, max_tokens); a list
    of texts as a whole, an iterable later, as it is read."""
    if isinstance(texts, (str, bytes, Mapping)) or not isinstance(texts, Iterable):
        raise ValueError("texts must be a list of strings, or an iterable of them")
    if isinstance(texts, Sequence):
        if len(texts) == 0:
            raise ValueError("texts is empty: nothing to extract")
        if pretokenized and not all(_is_token_list(t) for t in texts):
            raise ValueError("pretokenized=True: texts must be lists of integer token ids")
        if not pretokenized and not all(isinstance(t, str) for t in texts):
            raise ValueError("texts must be a list of strings")
    if not sites:
        raise ValueError(f"sites must be a non-empty list of site names from {SITES}")
    for site in sites:
        check_site(site)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, not {pool!r}")
    if token_ids is not None and pool != "none":
        raise ValueError("token_ids selects token rows; it cannot be combined with pool='mean'")
    for name, value in zip(("batch_size", "batch_tokens", "max_length", "max_tokens"), limits, strict=True):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, not {value!r}")


def _is_token_list(t: Any) -> bool:
    return isinstance(t, Sequence) and not isinstance(t, str) and all(isinstance(i, int) for i in t)


def extract(
    model: TransformersModel | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | Iterable[str | list[int]] | None = None,
    texts: Iterable[str | list[int]] | None = None,
    *,
    sites: Sequence[str] | str = ("hidden",),
    layers: Iterable[int] | int | None = None,
    pool: str = "none",
    token_ids: Iterable[int] | None = None,
    batch_size: int | None = None,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    max_length: int = 512,
    max_tokens: int | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    remote: bool | str = False,
    pretokenized: bool = False,
    allow_unknown_tokens: bool = False,
    logprobs: bool = False,
) -> Activations:
    """Run `texts` through `model` and collect the representations at `sites` (see the module doc;
    the sites are listed in `lime_probe.extraction.planning`'s).

    ``extract(model, texts)`` uses the tokenizer the nnsight model carries (`lime_probe.load`'s does);
    ``extract(model, tokenizer, texts)`` names one.

    Args:
        model: an nnsight model from `lime_probe.load`, or a Hugging Face model (wrapped here).
        tokenizer: its tokenizer (default: the nnsight model's own; a Hugging Face model needs it); its
            ``padding_side`` decides the padding side (results do not depend on it).
        texts: the input texts, one sequence each, truncated to `max_length` tokens (capped at the
            model's ``max_position_embeddings``): a list, or any iterable, read lazily block by block
            (a generator, a `Corpus`, a ``datasets`` dataset, e.g. ``streaming=True``; see the module doc).
        sites: site names, e.g. ("hidden", "values"), or one name.
        layers: layer indices kept for every site, or one index (negative: from each site's end); None = all.
        pool: "none" (a row per token) or "mean" (a row per sequence, the mean over its tokens).
        token_ids: keep only the positions holding one of these token ids.
        batch_size: sequences per forward pass; None: batches by `batch_tokens`.
        batch_tokens: tokens per forward pass, padding included, when `batch_size` is None (a longer
            sequence runs alone). Either way sequences run sorted by length and come back in order.
        max_tokens: stop after this many tokens in all (None: no limit); the sequence crossing it is cut.
        cache_dir: stream results to safetensors shards under this folder; a second call with the
            same checkpoint, data and settings reuses them, an interrupted one resumes. An iterable
            `texts` is then read twice (first for its digest), so it cannot be a one-pass iterator.
        progress: show a progress bar over sequences.
        remote: passed to ``model.trace`` ("local" runs nnsight's serialised remote path locally); a
            remote run (NDIF) needs a model built by its hub id, not loaded from a local folder.
        pretokenized: `texts` are token id lists (e.g. `lime_probe.extraction.windows.token_windows`), used
            exactly as given: no special tokens added, never truncated (longer than `max_length`: an error).
        allow_unknown_tokens: measure text even when over 10 % of its tokens are the tokenizer's unknown
            token (`lime_probe.extraction.windows.check_unknown_tokens`; a warning instead of the refusal).
        logprobs: also return each sequence's summed token log-probability (``acts.logprobs``, float64,
            sum_{i>=1} log p(t_i | t_<i) from the model's logits), from the same forward pass; causal LMs.

    Returns:
        Activations with ``acts[site][layer]`` float32 CPU tensors (n_rows, dim) (a bf16 or fp16 model's
        rows held in its dtype, half the memory, and widened as they are read).

    Raises:
        ValueError: empty or invalid texts, unknown site or layer, text that does not fit the tokenizer (see
            `allow_unknown_tokens`), non-finite activations (naming the site and layer); a one-pass iterator,
            or a model without weights (remote), with `cache_dir`; `remote` for a model from a local folder.
    """
    if texts is None:  # extract(model, texts): the model's own tokenizer
        texts, tokenizer = cast("Iterable[str | list[int]] | None", tokenizer), None
    sites = [sites] if isinstance(sites, str) else list(sites)
    layers = [layers] if isinstance(layers, int) else layers
    _validate(texts, sites, pool, token_ids, (batch_size, batch_tokens, max_length, max_tokens), pretokenized)
    texts = cast("Iterable[str | list[int]]", texts)  # checked by `_validate`
    # the tokenizer: a tokenizer or None, the texts of ``extract(model, texts)`` moved to `texts` above
    nn_model, tokenizer = as_nnsight(model, cast("PreTrainedTokenizerBase | None", tokenizer))
    plan, max_length = _plan(nn_model, sites, layers, max_length, remote, logprobs)
    select_ids = None if token_ids is None else torch.tensor(sorted(set(token_ids)), dtype=torch.long)
    source = _read(texts, tokenizer, max_length, max_tokens, pretokenized, cache_dir)
    if isinstance(source.seqs, list):  # a list is checked as a whole, before any forward pass
        check_unknown_tokens(source.seqs, tokenizer, allow=allow_unknown_tokens)
    run = _batching(nn_model, tokenizer, plan, pool, select_ids, batch_size, batch_tokens, logprobs, remote)
    with attention_for(nn_model._module, "attn_pattern" in plan.site_layers, remote) as attn:
        cache = None if cache_dir is None else _open_cache(cache_dir, run, source, attn)
        parts = _run_blocks(run, source, cache, progress, allow_unknown_tokens)
        return Activations(parts, plan.site_layers, plan.heads, logprobs, attn, run.all_tokens)


@dataclass(frozen=True)
class _Texts:
    """The texts of one extraction and their token id lists (`seqs`): a list tokenised up front, a stream
    lazily (its `first` text read ahead to refuse an empty one), with what tokenised them."""

    texts: Iterable[str | list[int]]
    seqs: Iterable[list[int]]
    first: str | list[int] | None
    streamed: bool
    tokenizer: Any
    max_length: int
    max_tokens: int | None
    pretokenized: bool

    def reread(self) -> Iterator[list[int]]:
        """The token id lists tokenised afresh from the texts (a stream's second pass)."""
        items = text_items(self.texts, self.pretokenized)
        return tokenize_texts(self.tokenizer, items, self.max_length, self.max_tokens, self.pretokenized)


@dataclass(frozen=True)
class _Batching:
    """What every batch of one extraction runs with: the traced model and its plan, the rows kept, the
    batch sizes and the padding."""

    nn_model: Any
    plan: SitePlan
    pool: str
    select_ids: torch.Tensor | None
    batch_size: int | None
    batch_tokens: int
    logprobs: bool
    remote: bool | str
    pad_id: int
    padding_side: str
    with_positions: bool

    def assembly(self, seqs: list[list[int]], first: int) -> Assembly:
        """Where the rows of input sequences `first` onwards (`seqs`) go."""
        return Assembly(seqs, first, self.pool, self.select_ids)

    @property
    def all_tokens(self) -> bool:
        """Whether every token gets a row (no pooling, no token selection)."""
        return self.pool == "none" and self.select_ids is None


def _plan(
    nn_model: Any,
    sites: list[str],
    layers: Iterable[int] | None,
    max_length: int,
    remote: bool | str,
    logprobs: bool,
) -> tuple[SitePlan, int]:
    """The plan of what each trace reads, and `max_length` capped at the model's positions; refuses what
    the model cannot give (a remote run's module sites, log-probabilities without an LM head)."""
    check_remote(nn_model, remote)
    hf = nn_model._module
    max_length = min(max_length, getattr(hf.config, "max_position_embeddings", None) or max_length)
    if remote and remote != "local" and any(module_site(s) for s in sites):
        raise ValueError("module: sites are ordered by a forward pass run here: extract them locally")
    plan = plan_sites(hf, sites, layers, max_length)
    if logprobs and (not hasattr(hf, "get_output_embeddings") or hf.get_output_embeddings() is None):
        raise ValueError(f"logprobs=True needs a model with an LM head, not {type(hf).__name__}")
    return plan, max_length


def _read(
    texts: Iterable[str | list[int]],
    tokenizer: Any,
    max_length: int,
    max_tokens: int | None,
    pretokenized: bool,
    cache_dir: str | Path | None,
) -> _Texts:
    """The texts and their token id lists: a list (any sequence) tokenised (and cut to the token budget)
    up front, so that what is measured is checked before any forward pass; an iterable as a lazy stream."""
    tokenising = (tokenizer, max_length, max_tokens, pretokenized)
    if isinstance(texts, Sequence):
        texts = list(texts)
        seqs = list(tokenize_texts(tokenizer, texts, max_length, max_tokens, pretokenized))
        return _Texts(texts, seqs, None, False, *tokenising)
    if cache_dir is not None and iter(texts) is texts:
        raise ValueError(
            "cache_dir keys the cache by the texts' digest, so it reads them twice: pass a list, a "
            "Corpus or a dataset, not a one-pass iterator (a generator)"
        )
    items = iter(text_items(texts, pretokenized))
    first = next(items, None)
    if first is None:
        raise ValueError("texts is empty: nothing to extract")
    stream = tokenize_texts(tokenizer, chain([first], items), max_length, max_tokens, pretokenized)
    return _Texts(texts, stream, first, True, *tokenising)


def _batching(
    nn_model: Any,
    tokenizer: Any,
    plan: SitePlan,
    pool: str,
    select_ids: torch.Tensor | None,
    batch_size: int | None,
    batch_tokens: int,
    logprobs: bool,
    remote: bool | str,
) -> _Batching:
    """The batches' settings, with the padding token (the pad token, else eos; neither: ValueError)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad batches with")
    # per-sequence positions make left padding exact; models without the argument count positions
    # themselves (exact with right padding)
    positioned = "position_ids" in inspect.signature(nn_model._module.forward).parameters
    side = tokenizer.padding_side
    return _Batching(
        nn_model, plan, pool, select_ids, batch_size, batch_tokens, logprobs, remote, pad_id, side, positioned
    )


def _open_cache(cache_dir: str | Path, run: _Batching, source: _Texts, attn: str) -> ShardCache:
    """The activation cache of this extraction, keyed on the model's weights, the texts and the settings
    (an eager `attn` implementation included); a model without weights (remote) is refused."""
    hf = run.nn_model._module
    if any(p.is_meta for p in hf.parameters()):
        raise ValueError(
            "cache_dir keys the cache by the model's weights, and this model holds none (built on "
            "'meta' for a remote run): extract without cache_dir"
        )
    settings = {
        "sites": run.plan.site_layers,
        "pool": run.pool,
        "batch_size": run.batch_size,
        "batch_tokens": run.batch_tokens,
        "logprobs": run.logprobs,
        "padding_side": run.padding_side,
        "token_ids": None if run.select_ids is None else run.select_ids.tolist(),
        "attn_implementation": attn,
    }
    # a stream hashes as the list of its texts would: one cache for both
    hashed = text_items(source.texts, source.pretokenized) if source.streamed else source.texts
    key = extraction_key(
        hf,
        source.tokenizer,
        hashed,
        max_length=source.max_length,
        max_tokens=source.max_tokens,
        settings=settings,
    )
    about = describe_texts([source.first] if source.first is not None else source.texts)
    return ShardCache(cache_dir, key, prefix=hf.config.model_type, about=about)


def _run_blocks(
    run: _Batching, source: _Texts, cache: ShardCache | None, progress: bool, allow_unknown_tokens: bool
) -> list[dict[str, torch.Tensor] | Path]:
    """Run the sequences `cache` does not hold yet, block by block: the results, as cache shards
    (those it held first) or in memory without a cache. A stream's blocks are checked as they are read."""
    if cache is not None and cache.complete:
        return list(cache.shards)
    start = cache.done_sequences if cache else 0
    if cache is not None and progress:  # what the cache will grow by, before it does (a stream: reread)
        rest = islice(source.reread() if source.streamed else source.seqs, start, None)
        wanted = None if run.select_ids is None else run.select_ids.tolist()
        cache.announce(run.plan.row_bytes, rest, pooled=run.pool != "none", token_ids=wanted)
    parts: list[dict[str, torch.Tensor] | Path] = list(cache.shards) if cache else []
    buffer: list[dict[str, torch.Tensor]] = []
    buffered_bytes = 0
    device = input_device(run.nn_model._module, run.remote)
    total = len(source.seqs) if isinstance(source.seqs, list) else None  # a list unless streamed
    bar = tqdm(total=total, initial=start, unit="seq", desc="extract", disable=not progress)
    blocks = _blocks(islice(source.seqs, start, None), run.plan.row_bytes, run.pool == "none", run.batch_size,
                     run.batch_tokens)  # fmt: skip
    if source.streamed:
        blocks = _checked(blocks, source.tokenizer, allow_unknown_tokens)
    # a list held in memory is placed in one result; a stream or a cache's shards block by block
    whole = None if cache is not None or source.streamed else run.assembly(cast(list, source.seqs), 0)
    for done in _run_pipelined(run, blocks, start, device, bar, whole):
        buffer.append(done.result())
        buffered_bytes += sum(t.numel() * t.element_size() for t in buffer[-1].values())
        if cache is not None and buffered_bytes >= SHARD_BYTES:
            parts.append(cache.add_shard(merge_parts(buffer)))
            buffer, buffered_bytes = [], 0
    if whole is not None:
        buffer.append(whole.result())
    if buffer:
        parts.append(cache.add_shard(merge_parts(buffer)) if cache is not None else merge_parts(buffer))
    bar.close()
    if cache is not None:
        cache.finish()
    return parts


@dataclass
class _Block:
    """A block's sequences as their batches finish: where their rows go, and how many batches are left."""

    assembly: Assembly
    left: int


def _run_pipelined(
    run: _Batching,
    blocks: Iterable[list[list[int]]],
    done: int,
    device: torch.device,
    bar: tqdm,
    whole: Assembly | None = None,
) -> Iterator[Assembly]:
    """Each block's `Assembly` once every batch of it is placed, in order (sequences `done` onwards of the
    input), its batches sorted by length; with `whole`, every block's rows go there instead (nothing is
    yielded: the caller holds it). A batch's rows are placed after the next batch has started, so the device runs that one
    meanwhile; on a GPU by a worker thread (`Placer`), while this one traces on. An interruption while a
    batch starts still yields the block of the batch before it, when that completes it (the cache keeps
    what was computed)."""
    open_blocks: list[_Block] = []
    waiting: tuple[Callable[[], dict[str, torch.Tensor]], _Block, list[int]] | None = None
    placer = Placer(threaded=places_in_a_thread(device))

    def collect(final: bool = False) -> Iterator[Assembly]:
        nonlocal waiting
        if waiting is not None:
            finish, block, index = waiting
            waiting = None
            placer.place(block.assembly, index, finish, owner=block)
            block.left -= 1
            bar.update(len(index))
        if final:
            placer.wait()
        while open_blocks and open_blocks[0].left == 0 and open_blocks[0] is not placer.busy:
            if (ready := open_blocks.pop(0).assembly) is not whole:
                yield ready

    try:
        for seqs in blocks:  # a stream's next block is read (and checked) here
            batches = plan_batches([len(s) for s in seqs], run.batch_size, run.batch_tokens)
            block = _Block(whole if whole is not None else run.assembly(seqs, done), len(batches))
            open_blocks.append(block)
            for local in batches:
                index = [done + i for i in local]
                finish = _start_batch(run, [seqs[i] for i in local], index, device)
                yield from collect()
                waiting = (finish, block, index)
            done += len(seqs)
        yield from collect(final=True)
    except GeneratorExit:  # closed by the caller: nothing more may be yielded
        raise
    except BaseException:  # Ctrl-C, a refused block: the batch before is kept
        yield from collect(final=True)
        raise
    finally:
        placer.close()


def places_in_a_thread(device: torch.device) -> bool:
    """Whether a worker thread places the rows: where the model runs on a GPU (on the CPU the forward
    pass itself keeps the cores busy)."""
    return device.type == "cuda"


def _start_batch(
    run: _Batching, seqs: list[list[int]], index: list[int], device: torch.device
) -> Callable[[], dict[str, torch.Tensor]]:
    """One batch (sequences `index` of the input) padded and traced; the function that waits for its
    rows (`TracedBatch.result`), per site and layer in the batch's order."""
    batch = pad_batch(seqs, run.pad_id, run.padding_side, first_position_of(run.nn_model._module))
    if not run.with_positions:
        del batch["position_ids"]
    keep = batch["attention_mask"].bool()
    if run.select_ids is not None:
        keep &= torch.isin(batch["input_ids"], run.select_ids)
    traced = trace_batch(
        run.nn_model, batch, keep, device, run.plan, run.pool, run.remote, index, run.logprobs
    )
    return traced.result


def _checked(blocks: Iterable[list[list[int]]], tokenizer: Any, allow: bool) -> Iterator[list[list[int]]]:
    """A stream's blocks, each checked (`_check_block`) as it is read."""
    for i, block in enumerate(blocks):
        _check_block(block, tokenizer, allow, first=i == 0)
        yield block


def _check_block(block: list[list[int]], tokenizer: Any, allow: bool, first: bool) -> None:
    """`check_unknown_tokens` on one block of a stream, clear of the progress bar: every block may be
    refused, the `DataWarning` comes from the first block only (one line, not one per block)."""
    with tqdm.external_write_mode(), warnings.catch_warnings():
        if not first:
            warnings.simplefilter("ignore", DataWarning)
        check_unknown_tokens(block, tokenizer, allow=allow)
