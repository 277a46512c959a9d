"""How far each probe command's measurement is from one plain forward pass over the same inputs.

For each model (LIMe 16 x 64 from the ``wikitext-cpu`` recipe, untrained; a random GPT-2-shaped model from
``transformers.GPT2Config``) and each command, in one process, in interleaved rounds (each round runs every
path once, in a shuffled order):

- ``plain``: ``model(**batch, output_hidden_states=True)`` under inference mode over the command's inputs,
  padded batches built before timing (32 sentences, or the windows that fit 4096 tokens);
- ``old``: the measurement as it was: BLiMP extracts at 8 sequences a batch and scores the minimal pairs in a
  second pass (``sentence_logprobs``); entropy and separability extract one pass per site at 8 a batch;
- ``new``: the measurement as the commands now make it: one ``extract`` per input set, every site (and, for
  BLiMP, the minimal-pair log-probabilities) from one pass, token-budget batches.

Then, once, the whole BLiMP command (``ANALYSES["blimp"].run``: extraction, scores and the logistic-
regression probes). Prints the median process CPU time of each path and its ratio to ``plain`` (median of
the per-round ratios; process CPU time is the fairer clock on a shared machine, run with --threads 1).
Targets: each measurement within 1.5x of plain; the BLiMP command within 3x.

BLiMP reads ``$LIME_PROBE_DATA/blimp`` (the paper's ten Table 2 paradigms) and WikiText-2 from
``$LIME_PROBE_DATA/wikitext-2`` when present, else synthetic sentences of random vocabulary words.

    python bench/probe_speed.py --threads 1                                   # full size
    python bench/probe_speed.py --threads 1 --pairs 200 --gpt2-layers 6 --gpt2-hidden 256   # reduced
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lime_model.command_line import POSITIVE_INT, OneLineParser

COMMANDS = ("blimp", "entropy", "separability")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=POSITIVE_INT, default=1)
    p.add_argument("--models", nargs="+", default=["lime", "gpt2"], choices=["lime", "gpt2"])
    p.add_argument(
        "--pairs", type=POSITIVE_INT, default=1000, help="BLiMP pairs per paradigm (default: %(default)s)"
    )
    p.add_argument("--paradigms", type=POSITIVE_INT, default=10, help="BLiMP paradigms, of Table 2's ten")
    p.add_argument("--windows", type=POSITIVE_INT, default=64, help="entropy windows (default: %(default)s)")
    p.add_argument(
        "--window", type=POSITIVE_INT, default=2048, help="tokens per window, capped at the positions"
    )
    p.add_argument(
        "--documents", type=POSITIVE_INT, default=500, help="separability sequences (default: %(default)s)"
    )
    p.add_argument("--rounds", type=POSITIVE_INT, default=3)
    p.add_argument("--vocab", type=POSITIVE_INT, default=4096, help="BPE vocabulary trained for the bench")
    p.add_argument("--gpt2-layers", type=POSITIVE_INT, default=12)
    p.add_argument("--gpt2-hidden", type=POSITIVE_INT, default=768)
    p.add_argument("--gpt2-heads", type=POSITIVE_INT, default=12)
    p.add_argument("--lime-layers", type=POSITIVE_INT, default=None, help="override the recipe's 16 layers")
    p.add_argument("--no-command", action="store_true", help="skip timing the whole BLiMP command")
    p.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS, help="commands to time")
    return p.parse_args(argv)


def words_corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "cat",
        "dog",
        "bird",
        "man",
        "woman",
        "child",
        "house",
        "is",
        "are",
        "was",
        "were",
        "saw",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(6, 16))) + " ." for _ in range(n)]


def wikitext(data: Path | None) -> list[str]:
    path = data / "wikitext-2" / "test.txt" if data else None
    if path and path.is_file():
        return [
            line.strip() for line in path.read_text(encoding="utf-8").split("\n") if len(line.split()) > 8
        ]
    return words_corpus(4000, seed=1)


def blimp_data(data: Path | None, n_paradigms: int, pairs: int):
    """A BLiMP dataset of Table 2's first `n_paradigms` paradigms: the real files, or synthetic pairs."""
    import datasets

    from lime_probe.probes.blimp import load_blimp
    from lime_probe.protocol import TABLE2_TASKS

    names = list(TABLE2_TASKS)[:n_paradigms]
    if data and (data / "blimp").is_dir():
        ds = load_blimp(data / "blimp", paradigms=names)
        return ds, "BLiMP files"
    rows = {"sentence_good": [], "sentence_bad": [], "UID": [], "pairID": [], "linguistics_term": []}
    for k, name in enumerate(names):
        for i, good in enumerate(words_corpus(pairs, seed=100 + k)):
            w = good.split()
            w[1], w[2] = w[2], w[1]
            rows["sentence_good"].append(good)
            rows["sentence_bad"].append(" ".join(w))
            rows["UID"].append(name)
            rows["pairID"].append(str(i))
            rows["linguistics_term"].append("synthetic")
    return datasets.Dataset.from_dict(rows), "synthetic sentences"


def build_models(args, tok) -> dict:
    import torch
    import transformers as tf

    out = {}
    if "lime" in args.models:
        from lime_model.recipes import load_recipe
        from lime_model.train import model_config

        recipe = load_recipe("wikitext-cpu", {"data": "unused"})  # the model section only
        config = model_config(recipe, tok)
        if args.lime_layers:
            config.num_hidden_layers = args.lime_layers
        torch.manual_seed(0)
        out[f"LIMe {config.num_hidden_layers}x{config.hidden_size}"] = tf.AutoModelForCausalLM.from_config(
            config
        )
    if "gpt2" in args.models:
        config = tf.GPT2Config(
            vocab_size=len(tok),
            n_layer=args.gpt2_layers,
            n_embd=args.gpt2_hidden,
            n_head=args.gpt2_heads,
            n_positions=1024,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        out[f"GPT-2 {args.gpt2_layers}x{args.gpt2_hidden}"] = tf.GPT2LMHeadModel(config)
    return {name: m.eval() for name, m in out.items()}


def plain_batches(seqs: list[list[int]], per_batch: int, pad: int) -> list[dict]:
    from lime_probe.extraction.batching import pad_batch

    return [pad_batch(seqs[i : i + per_batch], pad, "right") for i in range(0, len(seqs), per_batch)]


def plain(model, batches: list[dict]) -> Callable[[], None]:
    import torch

    def run() -> None:
        with torch.inference_mode():
            for b in batches:
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True)

    return run


def cases(model, tok, args, data: Path | None) -> list[tuple[str, str, dict[str, Callable[[], object]]]]:
    """(command, inputs in words, {path: callable}) for each command."""
    import numpy as np

    from lime_probe.extraction.batching import DEFAULT_BATCH_TOKENS
    from lime_probe.extraction.loading import wrap
    from lime_probe.extraction.sites import DEFAULT_WORDS
    from lime_probe.extraction.tracing import extract
    from lime_probe.extraction.windows import token_windows
    from lime_probe.probes.blimp import fit_pairs, scoring_sequences, sentence_logprobs
    from lime_probe.specs.base import Checkpoint, value_sites
    from lime_probe.specs.blimp import probed_layers

    nn_model = wrap(model, tok)
    ck = Checkpoint("bench", "bench", nn_model, tok)
    positions = model.config.max_position_embeddings
    pad = tok.pad_token_id
    values = value_sites(ck, None)
    out = []

    # BLiMP Table 2: per paradigm, good + bad sentences; sites values (+ routed) and hidden, the paper's layers
    ds, source = blimp_data(data, args.paradigms, args.pairs)
    kept, _ = fit_pairs(ds, tok, positions)
    uids = np.asarray(ds["UID"], dtype=object)
    parts = [ds.select(kept[uids[kept] == q][: args.pairs]) for q in dict.fromkeys(uids)]
    sentences = [list(p["sentence_good"]) + list(p["sentence_bad"]) for p in parts]
    scored = [scoring_sequences(tok, s) for s in sentences]
    sites, layers = [*values, "hidden"], probed_layers(ck, "paper")
    batches = plain_batches([ids for s in sentences for ids in tok(s)["input_ids"]], 32, pad)
    common = dict(sites=sites, layers=layers, pool="mean", progress=False)
    out.append(
        (
            "blimp",
            f"{sum(map(len, sentences))} sentences ({source})",
            {
                "plain": plain(model, batches),
                "old": lambda: [
                    (
                        extract(nn_model, tok, s, batch_size=8, **common),
                        sentence_logprobs(model, tok, s, progress=False),
                    )
                    for s in sentences
                ],
                "new": lambda: [
                    extract(nn_model, tok, s, pretokenized=True, logprobs=True, **common) for s in scored
                ],
            },
        )
    )
    out[-1][2]["_command"] = lambda: blimp_command(ck, ds, args.pairs)

    # entropy: windows of the packed text, every value site, every layer, token rows
    window = min(args.window, positions)
    windows = token_windows(wikitext(data), tok, window, num_windows=args.windows)
    per_batch = max(1, DEFAULT_BATCH_TOKENS // window)
    out.append(
        (
            "entropy",
            f"{len(windows)} windows of {window}",
            {
                "plain": plain(model, plain_batches(windows, per_batch, pad)),
                "old": lambda: [
                    extract(
                        nn_model,
                        tok,
                        windows,
                        sites=[s],
                        pretokenized=True,
                        batch_size=8,
                        max_length=window,
                        progress=False,
                    )
                    for s in values
                ],
                "new": lambda: extract(
                    nn_model, tok, windows, sites=values, pretokenized=True, max_length=window, progress=False
                ),
            },
        )
    )

    # separability (and t-SNE, the same extraction): the words' tokens in WikiText sequences
    docs = wikitext(data)[: args.documents]
    ids = sorted({i for w in DEFAULT_WORDS for i in tok(w, add_special_tokens=False)["input_ids"][:1]})
    seqs = tok(docs, truncation=True, max_length=min(256, positions))["input_ids"]
    out.append(
        (
            "separability",
            f"{len(docs)} sequences",
            {
                "plain": plain(model, plain_batches(seqs, 32, pad)),
                "old": lambda: [
                    extract(
                        nn_model,
                        tok,
                        docs,
                        sites=[s],
                        token_ids=ids,
                        batch_size=8,
                        max_length=256,
                        progress=False,
                    )
                    for s in values
                ],
                "new": lambda: extract(
                    nn_model, tok, docs, sites=values, token_ids=ids, max_length=256, progress=False
                ),
            },
        )
    )
    return out


def blimp_command(ck, ds, pairs: int):
    """The whole BLiMP analysis (extraction, scores, probes) as ``lime-probe blimp`` runs it, no cache."""
    from lime_probe.specs import ANALYSES, Extraction

    paradigms = tuple(dict.fromkeys(ds["UID"]))
    return ANALYSES["blimp"].run([ck], ds, Extraction(progress=False), max_pairs=pairs, paradigms=paradigms)


def timed(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    import lime_model

    lime_model.register_models()
    from lime_model.tokenization import train_bpe

    data = Path(os.environ["LIME_PROBE_DATA"]) if os.environ.get("LIME_PROBE_DATA") else None
    tok = train_bpe(wikitext(data)[:5000], args.vocab)
    load = os.getloadavg()[0]
    print(f"threads {args.threads}, load average {load:.2f} at start, {args.rounds} rounds, process CPU time")
    print(
        f"{'model':<14} {'command':<13} {'inputs':<40} {'plain s':>8} {'old s':>8} {'old x':>6} {'new s':>8} {'new x':>6}"
    )
    for name, model in build_models(args, tok).items():
        for command, inputs, paths in cases(model, tok, args, data):
            if command not in args.commands:
                continue
            command_fn = paths.pop("_command", None)
            times: dict[str, list[float]] = {k: [] for k in paths}
            rng = random.Random(0)
            for _ in range(args.rounds):
                order = list(paths)
                rng.shuffle(order)
                for k in order:
                    times[k].append(timed(paths[k]))
            base = statistics.median(times["plain"])
            ratio = {
                k: statistics.median(t / p for t, p in zip(times[k], times["plain"], strict=True))
                for k in times
            }
            print(
                f"{name:<14} {command:<13} {inputs:<40} {base:8.2f} {statistics.median(times['old']):8.2f} "
                f"{ratio['old']:6.2f} {statistics.median(times['new']):8.2f} {ratio['new']:6.2f}",
                flush=True,
            )
            if command_fn is not None and not args.no_command:
                t = timed(command_fn)
                probes = t - statistics.median(times["new"])
                print(
                    f"{name:<14} {'blimp (all)':<13} {'extraction, scores and probes':<40} {base:8.2f} "
                    f"{'':>8} {'':>6} {t:8.2f} {t / base:6.2f}   (probes {probes:.1f} s: "
                    f"{t / (base + probes):.2f}x plain + probes)",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
