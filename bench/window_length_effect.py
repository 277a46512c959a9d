"""How much of a per-sequence entropy reflects sequence length: documents versus fixed-length windows.

A measurement of the protocol, not of speed. On one fixed random tiny LLaMA (the tests' tiny tokenizer),
the "lime" entropy of layer 1's values is computed for a short-document and a long-document set, first
per document (the old unit) and then over windows of one length drawn from each set. Prints each
mean with its 95% bootstrap CI, and the correlation of per-document entropy with log(length).

    python bench/window_length_effect.py                       # synthetic documents from one sentence pool
    python bench/window_length_effect.py --wikitext PATH.txt   # WikiText lines split at the median length

With synthetic documents the two sets differ only in length (and in how many BOS/EOS separators the
packing inserts); WikiText's short lines are mostly headings, so its two halves also differ in content.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import CORPUS, tiny_model, tiny_tokenizer  # noqa: E402

from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402
from lime_probe.extraction.tracing import extract  # noqa: E402
from lime_probe.extraction.windows import token_windows  # noqa: E402
from lime_probe.probes.entropy import layer_entropy  # noqa: E402


def synthetic(n: int, sentences: int, seed: int) -> list[str]:
    g = np.random.default_rng(seed)
    return [" ".join(g.choice(CORPUS, size=sentences)) for _ in range(n)]


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wikitext", type=Path, help="a WikiText .txt file (one document per line)")
    ap.add_argument("--max-texts", type=POSITIVE_INT, default=400)
    ap.add_argument("--window", type=POSITIVE_INT, default=48)
    ap.add_argument("--num-windows", type=POSITIVE_INT, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=POSITIVE_INT, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = tiny_tokenizer()
    model = tiny_model("llama", tok, seed=0)
    if args.wikitext:
        lines = [t for t in args.wikitext.read_text(encoding="utf-8").splitlines() if t.strip()][
            : args.max_texts
        ]
        lengths = np.array([len(tok.encode(t, add_special_tokens=False)) for t in lines])
        median = np.median(lengths)
        short = [t for t, n in zip(lines, lengths, strict=True) if n <= median]
        long = [t for t, n in zip(lines, lengths, strict=True) if n > median]
    else:
        short, long = synthetic(300, 1, seed=10), synthetic(40, 8, seed=11)

    def entropy(texts, **kw):
        acts = extract(model, tok, texts, sites="values", layers=[1], progress=False, **kw)
        return layer_entropy(acts.sequences("values", 1), "lime", n_boot=500), acts.offsets.diff().numpy()

    limit = model.config.max_position_embeddings
    both, lengths = entropy(short + long, max_length=limit)
    print(f"per-document entropy vs log(length): r = {np.corrcoef(both.values, np.log(lengths))[0, 1]:.3f}")
    for unit in ("documents", "windows"):
        for name, texts in (("short", short), ("long", long)):
            if unit == "documents":
                res, n = entropy(texts, max_length=limit)
            else:
                ids = token_windows(
                    texts, tok, window=args.window, num_windows=args.num_windows, seed=args.seed
                )
                res, n = entropy(ids, max_length=args.window, pretokenized=True)
            print(
                f"{unit:9s} {name:5s}: {len(n):4d} sequences of {n.min()}-{n.max()} tokens, "
                f"entropy {res.mean:.3f} [{res.ci_low:.3f}, {res.ci_high:.3f}]"
            )


if __name__ == "__main__":
    main()
