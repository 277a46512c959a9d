"""Peak memory of `lime_probe.extract` reading a .txt corpus lazily, at N and 10N documents, side by side.

The parent writes two corpora of random vocabulary words (N and 10N documents, each cut to ``SEQ`` tokens)
to a temporary folder; each (mode, size) runs in a fresh subprocess (peak RSS, ``ru_maxrss``, is per
process): it builds a random LLaMA and the tests' tiny tokenizer, warms the extraction path up on one
text, then extracts from a `Corpus` over the file (never read whole) and reports its peak RSS. Modes:

- ``mean``: every layer of ``hidden``, ``pool="mean"``, held in memory (one row per document);
- ``cache``: the last ``hidden`` layer of every token streamed to a cache folder, then read back chunk by
  chunk with ``iter_sequences`` (a sum of squares over every row), as the entropy command reads it;
- ``list`` (with ``--list``): ``mean`` from the documents read into a list first (``load_texts``), the
  input the per-document commands took before; its texts and token ids grow with the corpus.

    python bench/extract_streaming.py                       # N = 2,000 documents of 32 tokens
    python bench/extract_streaming.py --docs 500 --list

A block (what is tokenised, sorted and run before its results are kept) holds about ``SHARD_BYTES`` of
results; one pooled row of this toy model is 768 bytes against about 140 KB for a 1B LLaMA's 17 hidden
layers, so ``--shard-mib`` (default 1) scales the block down to about the 1,400 documents it holds there
(32 MiB). Prints per row: documents, peak RSS and its growth over the warmed-up process, and the peak RSS
ratio 10N / N. Target: <= 1.2x for the streamed modes (pooled rows still grow: 768 bytes a document).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import child_json, flags, peak_rss_mib, print_growth, tiny_llama  # noqa: E402

from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402

SEQ = 32
MODES = ("mean", "cache")


def write_corpus(path: Path, docs: int) -> None:
    from extract_overhead import make_texts
    from memory import TESTS

    sys.path.insert(0, str(TESTS))
    from helpers import tiny_tokenizer

    path.write_text("\n\n".join(make_texts(tiny_tokenizer(), docs, SEQ)) + "\n")


def child(args: argparse.Namespace) -> None:
    """Run one extraction as `args.mode` says and print a JSON line with the measurements."""
    import torch

    import lime_probe.extraction.tracing as ex
    from lime_model.data import load_texts

    torch.set_num_threads(1)
    ex.SHARD_BYTES = int(args.shard_mib * 2**20)
    model, tok = tiny_llama(64, 2, SEQ)
    with tempfile.TemporaryDirectory() as tmp:
        ex.extract(model, tok, ["a warm-up text"], max_length=SEQ, progress=False)  # imports, nnsight
        before = peak_rss_mib()
        kw = dict(sites=["hidden"], max_length=SEQ, progress=False)
        if args.mode == "cache":
            acts = ex.extract(model, tok, ex.Corpus(args.corpus), layers=[-1], cache_dir=tmp, **kw)
            total = 0.0
            for chunk in acts.iter_sequences("hidden", acts.layers("hidden")[0]):
                total += sum(float(x.double().square().sum()) for x in chunk)
        else:
            texts = load_texts(args.corpus) if args.mode == "list" else ex.Corpus(args.corpus)
            acts = ex.extract(model, tok, texts, pool="mean", **kw)
        print(json.dumps({"documents": acts.n_sequences, "before": before, "after": peak_rss_mib()}))


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=POSITIVE_INT, default=2000, help="N: documents of the smaller corpus")
    parser.add_argument("--shard-mib", type=float, default=1.0, help="results per block and cache shard")
    parser.add_argument("--list", action="store_true", help="also read the corpus into a list first")
    parser.add_argument("--child", choices=(*MODES, "list"), help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        child(args)
        return
    print(
        f"LLaMA 2 layers, hidden 64; documents of {SEQ} tokens read from a .txt file; blocks of {args.shard_mib} MiB"
    )
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {n: Path(tmp) / f"{n}.txt" for n in (args.docs, 10 * args.docs)}
        for n, path in corpora.items():
            write_corpus(path, n)
        for mode in (*MODES, "list") if args.list else MODES:
            small, large = (
                child_json(__file__, "--child", mode, *flags(corpus=path, shard_mib=args.shard_mib))
                for path in corpora.values()
            )
            print_growth(mode, small, large, "documents")


if __name__ == "__main__":
    main()
