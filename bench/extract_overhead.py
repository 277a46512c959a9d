"""Cost of `lime_probe.extract` (nnsight traces) against a plain forward with output_hidden_states.

Both run on the same token batches, in the same process, interleaved repeat by repeat: the
baseline is ``model(**batch, output_hidden_states=True)`` under inference mode; ours is a full
``extract(...)`` call for one site (tokenising, tracing, selecting the non-padding rows and copying
them to CPU float32). Models are random LLaMA (and, if `lime_model` is importable, LIMe "full" for
the routed sites) built from configs; the tokenizer is the tests' tiny byte-level BPE.

    python bench/extract_overhead.py                        # 8 layers, hidden 256, a batch of 8 x 256 tokens
    python bench/extract_overhead.py --device cuda --layers 16 --hidden 1024
    python bench/extract_overhead.py --device cuda --dtype bfloat16   # the models in bfloat16

Each repeat runs the baseline and every site once, in a shuffled order. Prints, for wall-clock and
process CPU time, the median of each, the ratio of medians ours / baseline and the median of the
per-repeat ratios ("paired", steadier when other processes load the machine). CPU time is the
fairer clock on a shared machine; run with --threads 1 there. Target: <= 1.10x.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import tiny_tokenizer  # noqa: E402

from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402
from lime_probe.extraction.batching import pad_batch  # noqa: E402
from lime_probe.extraction.loading import wrap  # noqa: E402
from lime_probe.extraction.tracing import extract  # noqa: E402


def make_texts(tok, n: int, n_tokens: int, seed: int = 0) -> list[str]:
    """`n` texts of random vocabulary words, each longer than `n_tokens` tokens."""
    rng = random.Random(seed)
    words = [w.replace("Ġ", " ") for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isalpha()]
    return ["".join(rng.choice(words) for _ in range(2 * n_tokens)) for _ in range(n)]


def build(kind: str, vocab: int, layers: int, hidden: int, device: str, dtype: str) -> torch.nn.Module:
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=4096,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if kind == "lime":
        import lime_model

        config = lime_model.LimeConfig(routing="full", **kw)
    else:
        config = tf.LlamaConfig(**kw)
    return tf.AutoModelForCausalLM.from_config(config).to(device, getattr(torch, dtype)).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(kind: str, sites: list[str], args: argparse.Namespace, tok) -> None:
    hf = build(kind, len(tok), args.layers, args.hidden, args.device, args.dtype)
    model = wrap(hf, tok)
    texts = make_texts(tok, args.batches * args.batch_size, args.seq)
    ids = tok(texts, truncation=True, max_length=args.seq)["input_ids"]
    assert all(len(s) == args.seq for s in ids)
    batches = [
        {k: v.to(args.device) for k, v in pad_batch(ids[i : i + args.batch_size], 0, "left").items()}
        for i in range(0, len(ids), args.batch_size)
    ]

    def baseline():
        with torch.inference_mode():
            for batch in batches:
                hf(**batch, output_hidden_states=True)

    def ours(site):
        extract(
            model, tok, texts, sites=[site], batch_size=args.batch_size, max_length=args.seq, progress=False
        )

    runs = {"baseline": baseline} | {site: (lambda s=site: ours(s)) for site in sites}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    order = list(runs)
    rng = random.Random(0)
    for _ in range(args.repeats):
        rng.shuffle(order)  # a fresh order each repeat, so drifting machine load hits all runs alike
        for name in order:
            sync(args.device)
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name]()
            sync(args.device)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    print(
        f"{kind}: {args.layers} layers, hidden {args.hidden}, {args.batches} batch(es) of "
        f"{args.batch_size} x {args.seq} tokens, {args.dtype} on {args.device}, {torch.get_num_threads()} threads; "
        f"median of {args.repeats}"
    )
    print(
        f"  {'':32s} {'wall ms':>9s} {'ratio':>6s} {'paired':>6s}   {'CPU ms':>9s} {'ratio':>6s} {'paired':>6s}"
    )
    for name in runs:
        label = "baseline (output_hidden_states)" if name == "baseline" else f"extract {name}"
        print(f"  {label:32s} " + "   ".join(_stats(clock[name], clock["baseline"]) for clock in (wall, cpu)))


def _stats(times: list[float], base: list[float]) -> str:
    """Median time, ratio of medians to the baseline's, and the median of the per-repeat ratios."""
    paired = statistics.median(a / b for a, b in zip(times, base, strict=True))
    return f"{statistics.median(times) * 1e3:9.1f} {statistics.median(times) / statistics.median(base):6.3f} {paired:6.3f}"


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=POSITIVE_INT, default=8)
    parser.add_argument("--hidden", type=POSITIVE_INT, default=256)
    parser.add_argument("--seq", type=POSITIVE_INT, default=256)
    parser.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    parser.add_argument("--batches", type=POSITIVE_INT, default=1)
    parser.add_argument("--repeats", type=POSITIVE_INT, default=7)
    parser.add_argument(
        "--threads", type=POSITIVE_INT, default=None, help="torch CPU threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: not a multiple of 64 (heads of 32 features, K/V heads of 64)")
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = tiny_tokenizer()
    bench("llama", ["hidden", "final", "keys", "values"], args, tok)
    try:
        import lime_model  # noqa: F401
    except ImportError:
        print("lime_model not importable: skipping the routed sites")
        return
    bench("lime", ["hidden", "values", "routed_keys", "routed_values"], args, tok)


if __name__ == "__main__":
    main()
