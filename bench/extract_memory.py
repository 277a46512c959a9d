"""Peak memory of `lime_probe.extract` streaming to its cache, for N and 10N tokens, side by side.

Each size runs in a fresh subprocess (peak RSS is per process): it builds a random LLaMA and the
tests' tiny tokenizer, warms the extraction path up on one text, then extracts every layer of the
``hidden`` site for the whole data set into a cache folder (shards stream to disk). The child reports
its peak RSS (``ru_maxrss``) before and after the extraction and the size of what it wrote.

    python bench/extract_memory.py                       # N = 16,384 tokens, 4 MiB shards
    python bench/extract_memory.py --tokens 65536 --shard-mib 32 --in-memory

Prints per size: tokens, result bytes on disk, peak RSS, and the growth of peak RSS over the
warmed-up process. Target: peak RSS at 10N within 1.2x of N. ``--in-memory`` adds the same runs
without a cache folder (the result is then held in RAM and must grow), to show the measurement sees it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_overhead import make_texts  # noqa: E402
from memory import child_json, flags, peak_rss_mib, print_growth, tiny_llama  # noqa: E402

import lime_probe.extraction.tracing as ex  # noqa: E402
from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402

SEQ = 128


def child(args: argparse.Namespace) -> None:
    """Run one extraction and print a JSON line with the measurements."""
    torch.set_num_threads(1)
    ex.SHARD_BYTES = args.shard_mib * 2**20
    model, tok = tiny_llama(args.hidden, args.layers, SEQ)
    texts = make_texts(tok, args.tokens // SEQ, SEQ)
    with tempfile.TemporaryDirectory() as tmp:
        ex.extract(model, tok, texts[:1], max_length=SEQ, progress=False)  # warm-up: imports, nnsight
        before = peak_rss_mib()
        cache = None if args.in_memory else Path(tmp)
        acts = ex.extract(
            model, tok, texts, sites=["hidden"], max_length=SEQ, batch_size=8, cache_dir=cache, progress=False
        )
        after = peak_rss_mib()
        written = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        print(
            json.dumps({"tokens": len(acts.token_ids), "before": before, "after": after, "written": written})
        )


def run(tokens: int, args: argparse.Namespace, in_memory: bool) -> dict:
    shape = flags(tokens=tokens, shard_mib=args.shard_mib, hidden=args.hidden, layers=args.layers)
    return child_json(__file__, "--child", *shape, *(["--in-memory"] if in_memory else []))


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=POSITIVE_INT, default=16384, help="N: tokens of the smaller run")
    parser.add_argument(
        "--shard-mib", type=POSITIVE_INT, default=4, help="results held before a shard is written"
    )
    parser.add_argument("--hidden", type=POSITIVE_INT, default=64)
    parser.add_argument("--layers", type=POSITIVE_INT, default=2)
    parser.add_argument("--in-memory", action="store_true", help="also run without a cache folder")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(
        f"LLaMA {args.layers} layers, hidden {args.hidden}; all 'hidden' layers of every token; "
        f"{SEQ}-token sequences; shards of {args.shard_mib} MiB"
    )
    for in_memory in [False, True] if args.in_memory else [False]:
        small, large = run(args.tokens, args, in_memory), run(10 * args.tokens, args, in_memory)
        label = "in memory (no cache_dir)" if in_memory else "streamed to cache_dir"
        print_growth(label, small, large, "tokens", lambda r: f"written {r['written'] / 2**20:7.1f} MiB  ")


if __name__ == "__main__":
    main()
