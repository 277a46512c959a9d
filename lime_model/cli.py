"""``lime-model``: train LIMe / LLaMA from a recipe; perplexity, arithmetic and benchmark evals; list recipes.

Bad input (unknown recipe keys, bad routing, missing or empty data, a mismatched tokenizer, resuming
a directory of another config, an unwritable or misplaced path) ends with one ``lime-model: error: ...``
line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from .downstream import DEFAULT_PRESET, PRESETS
from .recipes import parse_set, recipe_names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lime-model", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's own choice); train records it in run_info.json",
    )

    t = sub.add_parser("train", parents=[common], help="train a recipe into a run directory")
    t.add_argument(
        "--recipe", required=True, help=f"a recipe name ({', '.join(recipe_names())}) or a JSON path"
    )
    t.add_argument("--out", required=True, help="run directory (new, or an existing one with --resume)")
    t.add_argument("--data", help="text: a .txt/.jsonl/.parquet file, a folder, or hf:NAME[:CONFIG][:SPLIT]")
    t.add_argument(
        "--eval-data",
        help="held-out text for validation loss/perplexity every eval_every steps (same forms as --data); "
        "or hold out the last rows of --data with --set eval_holdout=0.01",
    )
    t.add_argument(
        "--routing", help='routing spec, e.g. full, last-4, dilated-2; "none" is the LLaMA baseline'
    )
    t.add_argument(
        "--arch",
        help="model architecture: lime (default; LLaMA with --routing none) or a cross-layer baseline "
        "(denseformer, resformer, ...); shorthand for --set model.arch=NAME",
    )
    t.add_argument("--steps", type=int, help="optimizer steps (overrides the recipe's steps/epochs)")
    t.add_argument("--seed", type=int)
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint; the recipe must be the same, --steps "
        "included (it sets the learning-rate schedule), so a finished run cannot be extended: "
        "train longer into a new --out",
    )
    t.add_argument("--stop-after", type=int, help="end this invocation after that step (resume later)")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any recipe field, dotted for nested ones (model.hidden_size=64); values are JSON",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bars")

    p = sub.add_parser(
        "eval",
        parents=[common],
        help="perplexity of a checkpoint on text, over fixed non-overlapping windows",
        description="Perplexity (exp of the mean token NLL) over non-overlapping windows of --window tokens "
        "(documents joined with eos, as training packs them; the tail is dropped), so every checkpoint "
        "with the same tokenizer is scored on the same windows.",
    )
    p.add_argument("--ckpt", required=True, help="a run directory or one of its checkpoints/step-N")
    p.add_argument("--data", required=True, help="text: a .txt/.jsonl/.parquet file, a folder, or hf:NAME...")
    p.add_argument("--window", type=int, help="tokens per window (default: the model's training seq_len)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--out", help="also write the result there as JSON")

    e = sub.add_parser(
        "eval-arithmetic",
        parents=[common],
        help="greedy-decoding accuracy of an arithmetic run, per operator count (tier)",
    )
    e.add_argument("--ckpt", required=True, help="a finished arithmetic run directory")
    e.add_argument("--no-progress", action="store_true")

    d = sub.add_parser(
        "eval-downstream",
        parents=[common],
        help="benchmarks (ARC, HellaSwag, ...) of a checkpoint through lm-evaluation-harness",
        description="Runs lm-evaluation-harness (lm-eval, optional: pip install 'lime-probe[eval]') with its\n"
        "Hugging Face wrapper on a checkpoint; writes lm-eval's results plus our run info to\n"
        "CKPT/downstream/<preset or tasks>[.Nshot][.limitN].json. Hub tasks download their data (network); local\n"
        "task YAMLs (--include-path) and our agreement_demo run offline.",
        epilog="examples:\n"
        "  lime-model eval-downstream --ckpt runs/lime --limit 100  # not run in tests: needs the hub's task data\n"
        "  lime-model eval-downstream --ckpt runs/lime --tasks agreement_demo\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("--ckpt", required=True, help="a run directory or one of its checkpoints/step-N")
    d.add_argument(
        "--tasks",
        default=DEFAULT_PRESET,
        help="a preset, or comma-separated lm-eval task/group names; presets: "
        + "; ".join(f"{k}: {v.source}" for k, v in PRESETS.items())
        + " (default: %(default)s)",
    )
    d.add_argument(
        "--num-fewshot", type=int, help="few-shot examples (default: the preset's, else each task's own)"
    )
    d.add_argument("--limit", type=int, help="only the first N documents of each task (quick checks)")
    d.add_argument("--batch-size", type=int, default=8, help="requests per forward pass")
    d.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps")
    d.add_argument("--include-path", help="a folder of extra task YAMLs (local data: dataset_path: json)")
    d.add_argument(
        "--seed", type=int, help="lm-eval's random/numpy/torch/few-shot seeds (default: lm-eval's)"
    )
    d.add_argument("--output", help="the JSON file (default: CKPT/downstream/<tasks>[.Nshot][.limitN].json)")

    sub.add_parser("recipes", help="list the shipped recipes")
    return parser


def _train(args: argparse.Namespace) -> None:
    from .train import train

    overrides = parse_set(args.set)
    for key in ("data", "eval_data", "routing", "steps", "seed"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.arch is not None:
        overrides["model.arch"] = args.arch
    out = train(
        args.recipe,
        args.out,
        resume=args.resume,
        progress=not args.no_progress,
        stop_after=args.stop_after,
        **overrides,
    )
    print(out)


def _eval(args: argparse.Namespace) -> None:
    from .evaluate import perplexity

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    result = perplexity(args.ckpt, args.data, args.window, batch_size=args.batch_size, out=args.out)
    print(json.dumps(result))


def _eval_arithmetic(args: argparse.Namespace) -> None:
    from .train import evaluate_arithmetic

    accuracy = evaluate_arithmetic(args.ckpt, progress=not args.no_progress)
    print(json.dumps({str(n): a for n, a in accuracy.items()}))


def _eval_downstream(args: argparse.Namespace) -> None:
    from .downstream import evaluate_downstream

    report, path = evaluate_downstream(
        args.ckpt,
        args.tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size,
        device=args.device,
        include_path=args.include_path,
        seed=args.seed,
        output=args.output,
    )
    from lm_eval.utils import make_table  # lm-eval is there: evaluate_downstream checked

    print(make_table(report))
    print(path)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        if args.command == "train":
            _train(args)
        elif args.command == "eval":
            _eval(args)
        elif args.command == "eval-arithmetic":
            _eval_arithmetic(args)
        elif args.command == "eval-downstream":
            _eval_downstream(args)
        else:
            print("\n".join(recipe_names()))
    except (ValueError, OSError) as e:  # OSError: unwritable --out, a file where a folder should be, ...
        print(f"lime-model: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(error: Exception) -> str:
    """The first line of ``error``'s message; an OS error as ``PATH: reason`` (no errno prefix)."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
