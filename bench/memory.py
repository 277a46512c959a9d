"""What the memory benches share: peak RSS, a child process's JSON line, a random tiny LLaMA, and the
N-versus-10N printout.

Peak RSS (``ru_maxrss``) is per process and a forked child starts from its parent's, so every
measurement runs in a fresh interpreter that prints one JSON line as its last output.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child_json(script: str, *args: str) -> dict:
    """Run ``python script args...`` in a fresh process; return the JSON of its last stdout line."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def tiny_llama(hidden: int, layers: int, seq: int, vocab: int | None = None):
    """A random LLaMA (seed 0) and the tests' tiny tokenizer; ``vocab`` defaults to the tokenizer's."""
    import torch
    import transformers as tf

    sys.path.insert(0, str(TESTS))
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    config = tf.LlamaConfig(
        vocab_size=vocab or len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).eval(), tok


def print_growth(label: str, small: dict, large: dict, size: str, describe=lambda r: "") -> None:
    """Print the N and 10N rows of one mode (``size`` names the count key) and their peak RSS ratio."""
    print(label)
    for r in (small, large):
        print(
            f"  {r[size]:>9,} {size}  {describe(r)}peak RSS {r['after']:7.1f} MiB  "
            f"(+{r['after'] - r['before']:6.1f} MiB over the warmed-up process)"
        )
    print(f"  peak RSS ratio 10N / N: {large['after'] / small['after']:.3f}")


def flags(**options: object) -> Sequence[str]:
    """``--key value`` pairs for a child's command line (underscores become dashes)."""
    return [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]
