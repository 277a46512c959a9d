"""Cost of `activation_patching`'s batched grid against one plain forward per cell.

Activation patching patches every (layer, position) cell of a site from the clean into the corrupt run.
The baseline is what a hand-written loop costs: one forward pass of the corrupt prompts per cell, with a
forward hook writing the clean value (``model(**batch)`` under inference mode, the hook on the block).
Ours is one `activation_patching` call (clean and corrupt reads, then the cells several to a forward
pass, one batch row per patched run). Both in the same process on the same pairs, interleaved repeat by
repeat; the model is a random LLaMA built from a config (or LIMe with ``--routing full``).

    python bench/patching_cost.py --threads 1                   # 8 layers x 256, 16-token pairs, 4 pairs
    python bench/patching_cost.py --threads 1 --routing full --batch-size 64

Prints the process CPU time of each (median over repeats), ours as a multiple of one plain forward per
cell (cells x the loop's mean forward), and the median of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import tiny_tokenizer  # noqa: E402

from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402
from lime_probe.extraction.loading import wrap  # noqa: E402
from lime_probe.interventions.pairs import Pair  # noqa: E402
from lime_probe.interventions.patching import activation_patching, pair_tokens  # noqa: E402


def build(routing: str, vocab: int, layers: int, hidden: int) -> torch.nn.Module:
    import transformers as tf

    import lime_model

    torch.manual_seed(0)
    config = lime_model.LimeConfig(
        routing=routing, vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
        max_position_embeddings=512, pad_token_id=0,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config).eval()


def make_pairs(tok, n: int, length: int) -> list[Pair]:
    """`n` pairs of random token id prompts of `length` tokens that differ at one position."""
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(n):
        ids = torch.randint(10, len(tok), (length,), generator=g).tolist()
        other = list(ids)
        other[length // 2] = (ids[length // 2] + 1) % len(tok) or 10
        pairs.append(Pair(ids, other, int(ids[-1]), int(other[-1])))
    return pairs


def loop_patching(hf, clean: list[list[int]], corrupt: list[list[int]]) -> None:
    """The baseline: one hooked forward of the corrupt prompts per (layer, position) cell of ``hidden``."""
    blocks = hf.model.layers
    clean_ids, corrupt_ids = torch.tensor(clean), torch.tensor(corrupt)
    with torch.inference_mode():
        states = hf(clean_ids, output_hidden_states=True).hidden_states  # (L+1) x (n, T, d)
        for layer in range(len(blocks) + 1):
            for p in range(clean_ids.shape[1]):
                value = states[layer][:, p]

                def write(module, args, output, value=value, p=p):
                    output[:, p] = value
                    return output

                def write_input(module, args, value=value, p=p):
                    args[0][:, p] = value
                    return args

                if layer == 0:
                    handle = blocks[0].register_forward_pre_hook(write_input)
                else:
                    handle = blocks[layer - 1].register_forward_hook(write)
                try:
                    hf(corrupt_ids)
                finally:
                    handle.remove()


def cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routing", default="none", help="LIMe routing; none = LLaMA (default: %(default)s)")
    parser.add_argument("--layers", type=POSITIVE_INT, default=8)
    parser.add_argument("--hidden", type=POSITIVE_INT, default=256)
    parser.add_argument("--length", type=POSITIVE_INT, default=16, help="tokens per prompt")
    parser.add_argument("--pairs", type=POSITIVE_INT, default=4)
    parser.add_argument("--batch-size", type=POSITIVE_INT, default=32, help="patched runs per forward pass")
    parser.add_argument("--repeats", type=POSITIVE_INT, default=3)
    parser.add_argument("--threads", type=POSITIVE_INT, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = tiny_tokenizer()
    hf = build(args.routing, len(tok), args.layers, args.hidden)
    model = wrap(hf, tok)
    pairs = make_pairs(tok, args.pairs, args.length)
    clean, corrupt, _ = pair_tokens(tok, pairs)
    cells = (args.layers + 1) * len(clean[0])
    ours, loop = [], []
    for _ in range(args.repeats):
        ours.append(
            cpu_time(lambda: activation_patching(model, tok, pairs, "hidden", batch_size=args.batch_size))
        )
        loop.append(cpu_time(lambda: loop_patching(hf, clean, corrupt)))
    per_cell = statistics.median(loop) / cells
    print(
        f"routing {args.routing}, {args.layers} layers x {args.hidden}, {args.pairs} pairs of {len(clean[0])} tokens"
    )
    print(f"cells: {cells} (hidden, layers 0..{args.layers} x positions); batch size {args.batch_size}")
    print(
        f"loop (one hooked forward per cell): median {statistics.median(loop):.3f} s CPU, {per_cell * 1e3:.2f} ms per cell"
    )
    print(f"activation_patching (batched):     median {statistics.median(ours):.3f} s CPU")
    print(f"ours / (cells x one forward): {statistics.median(ours) / statistics.median(loop):.3f} "
          f"(paired per repeat: {statistics.median(o / x for o, x in zip(ours, loop, strict=True)):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
