"""Peak host memory of `lime_probe.load` in bfloat16 against float32, on a ~100M-parameter checkpoint.

A random LLaMA (hidden 768, 8 layers, vocabulary 32,000: 106M parameters, 0.42 GB in float32) is saved once
to a temporary folder with the tests' tiny tokenizer, in bfloat16 as most hub checkpoints are (or in
``--stored`` float32, as ``lime-model train`` saves). The saving and each load run in fresh subprocesses
(peak RSS, ``ru_maxrss``, is per process, and a forked child starts from its parent's): a load imports
everything first (the baseline), loads, then reads every weight once, as the first forward pass does (a
float32 load of float32 weights maps the file, and its pages count only once read), and reports its peak
RSS. Rows:

- ``float32``: ``load(ckpt, dtype="float32")``, the old default's memory;
- ``bfloat16``: ``load(ckpt, dtype="bfloat16")``, weights read straight into bfloat16;
- ``float32 -> bfloat16``: a float32 load then ``.to(torch.bfloat16)``, the float32 copy a bfloat16 load
  avoids.

    python bench/load_memory.py
    python bench/load_memory.py --stored bfloat16 --layers 4

Prints per row: peak RSS, its growth over the imports (what the load itself held at its peak) and that
growth against float32's. Target: the bfloat16 load's growth <= 0.6x float32's (the weights halve; the
rest is the model's non-weight state and one tensor in flight). With ``--stored float32`` a bfloat16 load
is not lower in RSS: the float32 file stays mapped while the weights are converted, and RSS counts its
pages read so far (clean page cache the kernel can drop, not memory the load allocates).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import TESTS, child_json, peak_rss_mib  # noqa: E402

from lime_model.command_line import POSITIVE_INT, OneLineParser  # noqa: E402

ROWS = ("float32", "bfloat16", "float32 -> bfloat16")


def save_checkpoint(folder: Path, args: argparse.Namespace) -> int:
    """Save the random model and tokenizer into `folder`; return its parameter count."""
    import torch
    import transformers as tf

    sys.path.insert(0, str(TESTS))
    from helpers import tiny_tokenizer

    config = tf.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("meta"):  # sized without being built: the saved model is built once, in its dtype
        n = sum(p.numel() for p in tf.LlamaForCausalLM(config).parameters())
    model = tf.LlamaForCausalLM._from_config(config, dtype=getattr(torch, args.stored))
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return n


def child(ckpt: str, row: str) -> None:
    """Load `ckpt` as `row` says, read every weight and print a JSON line: baseline and peak RSS, the
    weights' dtype."""
    import torch

    import lime_model  # noqa: F401  everything a load imports, before the baseline
    from lime_probe.extraction.loading import load

    torch.set_num_threads(1)
    baseline = peak_rss_mib()
    model, _ = load(ckpt, dtype="bfloat16" if row == "bfloat16" else "float32")
    hf = model._module
    if row == "float32 -> bfloat16":
        hf.to(torch.bfloat16)
    with torch.no_grad():
        sum(p.sum() for p in hf.parameters())  # every page of the weights read once, nothing copied
    print(json.dumps({"baseline": baseline, "peak": peak_rss_mib(), "dtype": str(hf.dtype)}))


def main() -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=POSITIVE_INT, default=768)
    p.add_argument("--layers", type=POSITIVE_INT, default=8)
    p.add_argument("--vocab", type=POSITIVE_INT, default=32000)
    p.add_argument("--stored", choices=("float32", "bfloat16"), default="bfloat16", help="the saved dtype")
    p.add_argument("--save", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--child", metavar="CKPT", help=argparse.SUPPRESS)
    p.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.save:
        print(save_checkpoint(Path(args.save), args))
        return
    if args.child:
        child(args.child, args.row)
        return
    with tempfile.TemporaryDirectory() as tmp:
        shape = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
        cmd = [sys.executable, __file__, "--save", tmp, "--stored", args.stored, *shape]
        n = int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])
        size = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors")) / 2**20
        print(f"checkpoint: {n / 1e6:.1f}M parameters, {size:.0f} MiB of {args.stored} weights on disk")
        results = {row: child_json(__file__, "--child", tmp, "--row", row) for row in ROWS}
    base = results["float32"]["peak"] - results["float32"]["baseline"]
    print(f"{'load':<22}{'dtype':<16}{'peak RSS MiB':>14}{'growth MiB':>12}{'x float32':>11}")
    for row, r in results.items():
        growth = r["peak"] - r["baseline"]
        print(f"{row:<22}{r['dtype']:<16}{r['peak']:>14.0f}{growth:>12.0f}{growth / base:>11.3f}")
    ratio = (results["bfloat16"]["peak"] - results["bfloat16"]["baseline"]) / base
    print(f"bfloat16 load / float32 load, growth over the imports: {ratio:.3f} (target <= 0.6)")
    print(f"peak RSS ratio, imports included: {results['bfloat16']['peak'] / results['float32']['peak']:.3f}")


if __name__ == "__main__":
    main()
