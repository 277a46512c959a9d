"""``lime-model``: train LIMe / LLaMA from a recipe; perplexity, arithmetic and benchmark evals; list recipes.

Exit codes: 0 done; 2 bad usage or input (unknown recipe keys, bad routing, missing or empty data, a
mismatched tokenizer, resuming a folder of another config, an unwritable or misplaced output, an
unavailable ``--device``, a corrupt weights file), one ``lime-model: error: ...`` line, checked before
any work; 1 an unexpected failure, one line (``--debug`` shows the traceback); 130 interrupted
(Ctrl-C): an interrupted ``train`` is continued by running the same command again, an interrupted
evaluation has written nothing. Nothing heavy (torch, transformers) is imported before the arguments
are parsed, so ``--help`` and usage errors are instant.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from .checks import BAD_INPUT, OneLineParser, one_line
from .downstream import DEFAULT_PRESET, PRESETS

PROG = "lime-model"
DATA = "../shared/data/wikitext-2"

# Each command's help text, description and examples (run as written by tests/test_docs_examples.py).
EXAMPLES = {
    "train": f"""\
lime-model train --recipe cpu-tiny --data {DATA}/valid.txt --out runs/tiny
# stopped (Ctrl-C, a crash, --stop-after N)? the same command again continues from the last checkpoint
accelerate launch --num_processes 8 -m lime_model.cli train --recipe lime-1b-gqa --data hf:HuggingFaceFW/fineweb-edu --out runs/1b
""",
    "eval": f"""\
lime-model eval --ckpt runs/tiny --data {DATA}/test.txt --out out/tiny-perplexity.json
lime-model eval --ckpt runs/tiny --data {DATA}/test.txt --window 64 --device cuda   # not run in tests: needs a GPU
""",
    "eval-arithmetic": """\
# a finished run of: lime-model train --recipe arithmetic-cpu --out runs/aet
lime-model eval-arithmetic --ckpt runs/aet
""",
    "eval-downstream": """\
lime-model eval-downstream --ckpt runs/lime --limit 100  # not run in tests: needs the hub's task data
lime-model eval-downstream --ckpt runs/lime --tasks agreement_demo
""",
    "recipes": """\
lime-model recipes   # the paper's 1B GQA/MHA, 150M, deep 32/64/128, arithmetic, CPU-sized ones
""",
}


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Train LIMe / LLaMA from a recipe; perplexity, arithmetic and benchmark evals; list recipes.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    debug = OneLineParser(add_help=False)
    debug.add_argument("--debug", action="store_true", help="show the full traceback on failure")
    common = OneLineParser(add_help=False, parents=[debug])
    common.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's own choice); train records it in run_info.json",
    )

    def add(
        name: str, help: str, description: str | None = None, parents=(common,)
    ) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            parents=list(parents),
            help=help,
            description=description or help,
            epilog="examples:\n" + "".join(f"  {line}\n" for line in EXAMPLES[name].splitlines()),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    t = add(
        "train",
        "train a recipe into a run directory",
        "Train a recipe into a run directory. A run stopped by Ctrl-C, a crash or --stop-after is\n"
        "continued by the same command: from its last checkpoint (every save_every steps), or from the\n"
        "start before the first.",
    )
    t.add_argument(
        "--recipe", required=True, help="a recipe name (lime-model recipes lists them) or a JSON path"
    )
    t.add_argument(
        "--out",
        required=True,
        help="run directory: new or empty, or one holding an unfinished run of the same recipe (continued)",
    )
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
        help="require a run in --out to continue from its last checkpoint (an unfinished one is continued "
        "without it too); the recipe must be the same, --steps included (it sets the learning-rate "
        "schedule), so a finished run cannot be extended: train longer into a new --out",
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

    p = add(
        "eval",
        "perplexity of a checkpoint on text, over fixed non-overlapping windows",
        "Perplexity (exp of the mean token NLL) over non-overlapping windows of --window tokens\n"
        "(documents joined with eos, as training packs them; the tail is dropped), so every checkpoint\n"
        "with the same tokenizer is scored on the same windows.",
    )
    p.add_argument("--ckpt", required=True, help="a run directory or one of its checkpoints/step-N")
    p.add_argument("--data", required=True, help="text: a .txt/.jsonl/.parquet file, a folder, or hf:NAME...")
    p.add_argument("--window", type=int, help="tokens per window (default: the model's training seq_len)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument(
        "--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps (default: %(default)s)"
    )
    p.add_argument("--out", help="also write the result there as JSON")

    e = add(
        "eval-arithmetic",
        "greedy-decoding accuracy of an arithmetic run, per operator count (tier)",
        "Greedy-decoding accuracy of a finished arithmetic run on its test expressions, per operator\n"
        "count (tier); printed, and written to CKPT/arithmetic_eval.json.",
    )
    e.add_argument("--ckpt", required=True, help="a finished arithmetic run directory")
    e.add_argument(
        "--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps (default: %(default)s)"
    )
    e.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = add(
        "eval-downstream",
        "benchmarks (ARC, HellaSwag, ...) of a checkpoint through lm-evaluation-harness",
        "Runs lm-evaluation-harness (lm-eval, optional: pip install 'lime-probe[eval]') with its\n"
        "Hugging Face wrapper on a checkpoint; writes lm-eval's results plus our run info to\n"
        "CKPT/downstream/<preset or tasks>[.Nshot][.limitN].json. Hub tasks download their data (network); local\n"
        "task YAMLs (--include-path) and our agreement_demo run offline.",
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

    add("recipes", "list the shipped recipes", parents=(debug,))
    return parser


def _train(args: argparse.Namespace) -> None:
    from .recipes import parse_set
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
    result = perplexity(
        args.ckpt, args.data, args.window, batch_size=args.batch_size, device=args.device, out=args.out
    )
    print(json.dumps(result))


def _eval_arithmetic(args: argparse.Namespace) -> None:
    from .train import evaluate_arithmetic

    accuracy = evaluate_arithmetic(args.ckpt, progress=not args.no_progress, device=args.device)
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


def _recipes(args: argparse.Namespace) -> None:
    from .recipes import recipe_names

    print("\n".join(recipe_names()))


COMMANDS = {
    "train": _train,
    "eval": _eval,
    "eval-arithmetic": _eval_arithmetic,
    "eval-downstream": _eval_downstream,
    "recipes": _recipes,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command, map errors to exit codes (see the module doc)."""
    try:
        signal.signal(
            signal.SIGINT, signal.default_int_handler
        )  # Ctrl-C raises KeyboardInterrupt from here on
        return _main(argv)
    except KeyboardInterrupt:  # while parsing, or while reporting how the command ended
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad usage (2), its message already printed
        return int(e.code or 0)
    try:
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        import lime_model

        lime_model.register_models()  # what `import lime_model` does for a library user (see there)
        COMMANDS[args.command](args)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the message short
        if args.command == "train":
            after = f"run the same command again to continue the run in {args.out}"
        else:
            after = "nothing was written"
        print(f"{PROG} {args.command}: interrupted; {after}", file=sys.stderr)
        return 130
    except BAD_INPUT as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        print(
            f"{PROG} {args.command}: failed: {type(e).__name__}: {one_line(e)} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
