"""``lime-model``: train LIMe / LLaMA from a recipe; perplexity, arithmetic and benchmark evals; list recipes.

Each subcommand is a ``lime_model.command_line.Command`` in ``COMMANDS`` (help, examples, options, what
runs); options that ``lime-probe`` also takes have its names and meanings (``--out`` is always a folder the
command writes into).

Exit codes: 0 done; 2 bad usage or input (unknown recipe keys, bad routing, missing or empty data, a
mismatched tokenizer, resuming a folder of another config, an unwritable or misplaced output, an
unavailable ``--device``, a corrupt weights file), one ``lime-model: error: ...`` line, checked before
any work; also 2, when it happens, a full disk (the line names the file) and a ``train`` into a run folder
that another one holds (the line names it); 1 an unexpected failure, one line (``--debug`` shows the traceback); 130 interrupted
(Ctrl-C): an interrupted ``train`` is continued by running the same command again, an interrupted
evaluation has written nothing (``lime_model.command_line.run_command``). Nothing heavy (torch, transformers) is
imported before the arguments are parsed and the inputs that need no model are checked (each command's
``Command.check``: paths, data, output folder), so ``--help``, usage errors and such mistakes are instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import command_line
from .checks import check_model_dir, check_positive, check_window, read_config
from .command_line import POSITIVE_INT, Command, add_device_option, run_command, run_program
from .downstream import DEFAULT_PRESET, PRESETS
from .files import check_writable
from .plan import DEFAULT_GPU_MEMORY, DEFAULT_MFU, DEFAULT_PEAK_TFLOPS, parse_memory

PROG = "lime-model"
DATA = "data/wikitext-2"  # the README's example folder: WikiText-2 as plain text files

DATA_HELP = "text: a .txt/.jsonl/.parquet file, a folder, or hf:NAME[:CONFIG][:SPLIT]"
CKPT_HELP = "a run directory or one of its checkpoints/step-N"


def _threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=POSITIVE_INT,
        metavar="N",
        help="torch CPU threads (default: torch's own choice); train records it in run_info.json",
    )


def _train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recipe", required=True, help="a recipe name (lime-model recipes lists them) or a JSON path"
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the run folder: new or empty, or one holding an unfinished run of the same recipe (continued)",
    )
    p.add_argument("--data", metavar="SPEC", help=DATA_HELP)
    p.add_argument(
        "--eval-data",
        metavar="SPEC",
        help="held-out text for validation loss/perplexity every eval_every steps (same forms as --data); "
        "or hold out the last rows of --data with --set eval_holdout=0.01",
    )
    p.add_argument(
        "--routing", help='routing spec, e.g. full, last-4, dilated-2; "none" is the LLaMA baseline'
    )
    p.add_argument(
        "--arch",
        help="model architecture: lime (default; LLaMA with --routing none) or a cross-layer baseline "
        "(denseformer, resformer, ...); shorthand for --set model.arch=NAME",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (overrides the recipe's steps/epochs)")
    p.add_argument("--seed", type=int, help="the run's seed (default: the recipe's)")
    p.add_argument(
        "--init",
        metavar="DIR",
        help="start from this saved model's weights and tokenizer (a finished run, a checkpoint, an "
        "upcycled LLaMA) instead of a random init; its shape must be the recipe's; a LLaMA run with a routed "
        "recipe is upcycled (routers at self-only routing); shorthand for --set init=DIR",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="require a run in --out to continue from its last checkpoint (an unfinished one is continued "
        "without it too); the recipe must be the same, --steps included (it sets the learning-rate "
        "schedule), so a finished run cannot be extended: train longer into a new --out",
    )
    p.add_argument("--stop-after", type=int, help="end this invocation after that step (resume later)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any recipe field, dotted for nested ones (model.hidden_size=64); values are JSON",
    )
    p.add_argument(
        "--report-to",
        choices=("none", "tensorboard", "wandb"),
        default="none",
        help="also log metrics.jsonl's numbers through accelerate's trackers: TensorBoard event files in "
        "OUT/tensorboard (pip install 'lime-probe[tracking]'), or Weights & Biases (pip install wandb)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _threads(p)
    p.add_argument(
        "--reproducible",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pin MKL, oneDNN, openBLAS and PyTorch's CPU kernels to AVX2, one thread and deterministic "
        "algorithms, so that the same seed gives the same bits on any Intel x86-64 CPU with AVX2 (MKL ignores "
        "its pin on AMD ones: lime_model.reproducible); "
        "recorded in run_info.json and the model card; a run is continued only in the mode it started in",
    )


def _train(args: argparse.Namespace) -> None:
    from .recipes import parse_set
    from .train import train

    overrides = parse_set(args.set)
    for key in ("data", "eval_data", "routing", "steps", "seed", "init"):
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
        report_to=args.report_to,
        **overrides,
    )
    print(out)


def _upcycle_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt", required=True, metavar="DIR|HUB_ID", help="a LLaMA-style causal LM: a folder or a hub id"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the LIMe checkpoint's folder (new or empty)")
    p.add_argument(
        "--routing",
        default="full",
        help="the LIMe routing spec, e.g. full, last-4, dilated-2, dynamic (default: %(default)s); "
        "its routers start at self-only routing",
    )
    _threads(p)


def _upcycle(args: argparse.Namespace) -> None:
    from .upcycle import upcycle

    print(upcycle(args.ckpt, args.out, args.routing))


def _prepare_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="the recipe the runs will train (as train takes it)")
    p.add_argument("--data", metavar="SPEC", help=DATA_HELP)
    p.add_argument("--eval-data", metavar="SPEC", help="held-out text, as train takes it")
    p.add_argument(
        "--steps", type=int, help="optimizer steps, as train takes it (one_pass reads that many rows)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="recipe fields, as train takes them"
    )
    p.add_argument(
        "--num-proc",
        type=POSITIVE_INT,
        default=os.cpu_count() or 1,
        metavar="N",
        help="tokenising processes (default: the CPU count, %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _prepare(args: argparse.Namespace) -> None:
    from .evaluate import default_cache_dir
    from .recipes import load_recipe, parse_set
    from .train import prepare_data

    overrides = parse_set(args.set)
    for key in ("data", "eval_data", "steps"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    recipe = load_recipe(args.recipe, overrides)
    if recipe.task == "arithmetic":
        raise ValueError("the arithmetic task makes its rows in memory: there is nothing to prepare")
    data = prepare_data(recipe, progress=not args.no_progress, num_proc=args.num_proc)
    print(
        f"{len(data.input_ids)} training rows of {recipe.seq_len} tokens in {default_cache_dir(recipe.cache_dir)}"
    )


def _eval_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="DIR", help=CKPT_HELP)
    p.add_argument("--data", required=True, metavar="SPEC", help=DATA_HELP)
    p.add_argument(
        "--window",
        type=POSITIVE_INT,
        help="tokens per window, at most the model's positions (default: those, the training seq_len)",
    )
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8, metavar="B", help="windows per forward pass")
    add_device_option(p)
    p.add_argument(
        "--out", metavar="DIR", help="also write the result to DIR/perplexity.json (default: only print it)"
    )
    _threads(p)


def _check_data(*specs: str | None) -> None:
    """The data specs given (None: not given), checked as far as their first document (``check_source``)."""
    from .data import check_source

    for spec in specs:
        if spec is not None:
            check_source(spec)


def _check_out(args: argparse.Namespace) -> None:
    if args.out is not None:
        check_writable(args.out, folder=True)


def _check_eval(args: argparse.Namespace) -> None:
    check_model_dir(args.ckpt)
    check_window(args.window, read_config(args.ckpt), args.ckpt, minimum=2)
    _check_out(args)
    _check_data(args.data)


def _eval(args: argparse.Namespace) -> None:
    from .evaluate import perplexity

    result = perplexity(
        args.ckpt,
        args.data,
        args.window,
        batch_size=args.batch_size,
        device=args.device,
        out=None if args.out is None else os.path.join(args.out, "perplexity.json"),
    )
    print(json.dumps(result))


def _eval_arithmetic_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="DIR", help="a finished arithmetic run directory")
    add_device_option(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _threads(p)


def _eval_arithmetic(args: argparse.Namespace) -> None:
    from .train import evaluate_arithmetic

    accuracy = evaluate_arithmetic(args.ckpt, progress=not args.no_progress, device=args.device)
    print(json.dumps({str(n): a for n, a in accuracy.items()}))


def _eval_downstream_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="DIR", help=CKPT_HELP)
    p.add_argument(
        "--tasks",
        default=DEFAULT_PRESET,
        help="a preset, or comma-separated lm-eval task/group names; presets: "
        + "; ".join(f"{k}: {v.source}" for k, v in PRESETS.items())
        + " (default: %(default)s)",
    )
    p.add_argument(
        "--num-fewshot", type=int, help="few-shot examples (default: the preset's, else each task's own)"
    )
    p.add_argument("--limit", type=int, help="only the first N documents of each task (quick checks)")
    p.add_argument(
        "--batch-size", type=POSITIVE_INT, default=8, metavar="B", help="requests per forward pass"
    )
    add_device_option(p)
    p.add_argument("--include-path", help="a folder of extra task YAMLs (local data: dataset_path: json)")
    p.add_argument(
        "--seed", type=int, help="lm-eval's random/numpy/torch/few-shot seeds (default: lm-eval's)"
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="folder of the results file, <preset or tasks>[.Nshot][.limitN].json (default: CKPT/downstream)",
    )
    _threads(p)


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
        out=args.out,
    )
    from lm_eval.utils import make_table  # lm-eval is there: evaluate_downstream checked

    print(make_table(report))
    print(path)


def _check_train(args: argparse.Namespace) -> None:
    _check_out(args)
    _check_data(args.data, args.eval_data)
    if args.init is not None:
        from .upcycle import check_init_dir

        check_init_dir(args.init)


def _check_upcycle(args: argparse.Namespace) -> None:
    from .upcycle import check_inputs  # imports no torch

    check_inputs(args.ckpt, args.out)


def _check_downstream(args: argparse.Namespace) -> None:
    check_model_dir(args.ckpt)
    _check_out(args)


def _plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recipe", required=True, help="a recipe name (lime-model recipes lists them) or a JSON path"
    )
    p.add_argument(
        "--gpus", type=POSITIVE_INT, default=8, metavar="N", help="data-parallel GPUs (default: %(default)s)"
    )
    p.add_argument(
        "--gpu-memory",
        default=DEFAULT_GPU_MEMORY,
        metavar="SIZE",
        help="memory of one GPU, e.g. 80GiB, 141GB (default: %(default)s, an H100's)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help="model-FLOPs utilisation for the step time, in (0, 1] (default: %(default)s, ours)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=DEFAULT_PEAK_TFLOPS,
        metavar="T",
        help="one GPU's peak TFLOP/s (default: %(default)s, H100/H200 SXM dense bf16; ours)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="recipe fields, as train takes them"
    )
    p.add_argument("--json", metavar="FILE", help="also write the plan to FILE as JSON")


def _check_plan(args: argparse.Namespace) -> None:
    parse_memory(args.gpu_memory)
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must lie in (0, 1], got {args.mfu}")
    check_positive(args.peak_tflops, "--peak-tflops")
    if args.json is not None:
        check_writable(args.json, option="--json")


def _plan(args: argparse.Namespace) -> None:
    from .files import atomic_write
    from .plan import format_plan, plan
    from .recipes import load_recipe, parse_set

    # a placeholder for recipes that name no data: the plan reads none
    recipe = load_recipe(args.recipe, {"data": "(not read)", **parse_set(args.set)})
    result = plan(recipe, args.gpus, parse_memory(args.gpu_memory), args.mfu, args.peak_tflops)
    print(format_plan(args.recipe, result))
    if args.json is not None:
        atomic_write(args.json, json.dumps({"recipe": args.recipe, **result}, indent=1))


def _recipes(args: argparse.Namespace) -> None:
    import textwrap

    from .plan import overview
    from .recipes import load_recipe, recipe_names

    for name in recipe_names():
        # a placeholder for recipes that name no data: the overview reads none
        o = overview(load_recipe(name, {"data": "(not read)"}))
        tokens = "" if o["tokens"] is None else f"{_count(o['tokens'])} tokens, "
        print(f"{name}  {_count(o['params'])} parameters; {tokens}{o['length']}")
        print(textwrap.fill(o["purpose"], 100, initial_indent="    ", subsequent_indent="    "))


def _count(n: float) -> str:
    """``n`` with a unit: 1.23M, 45.6B (three significant digits)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


# The subcommands; their examples are run as written by tests/test_docs_examples.py.
COMMANDS = {
    c.name: c
    for c in [
        Command(
            "train",
            "train a recipe into a run directory",
            f"""\
lime-model train --recipe cpu-tiny --data {DATA}/valid.txt --out runs/tiny
# stopped (Ctrl-C, a crash, --stop-after N)? the same command again continues from the last checkpoint
# several processes read the data `prepare` packed once (each node, unless the cache folder is shared)
lime-model prepare --recipe lime-1b-gqa --data hf:HuggingFaceFW/fineweb-edu --num-proc 16   # not run in tests: the hub's data
accelerate launch --num_processes 8 -m lime_model.cli train --recipe lime-1b-gqa --data hf:HuggingFaceFW/fineweb-edu --out runs/1b
""",
            _train,
            _train_options,
            check=_check_train,
            description="Train a recipe into a run directory. A run stopped by Ctrl-C, a crash or --stop-after is\n"
            "continued by the same command: from its last checkpoint (every save_every steps), or from the\n"
            "start before the first.",
            interrupted="run the same command again to continue the run in {out}",
        ),
        Command(
            "upcycle",
            "convert a pretrained LLaMA-style causal LM into a LIMe whose routers start at self-only routing",
            f"""\
# runs/llama: a LLaMA run (lime-model train ... --routing none); then train on from self-only routing
lime-model upcycle --ckpt runs/llama --out runs/llama-lime && lime-model train --recipe cpu-tiny --init runs/llama-lime --data {DATA}/valid.txt --out runs/llama-lime-more
lime-model upcycle --ckpt meta-llama/Llama-3.2-1B --out runs/llama32-lime --routing last-4   # not run in tests: the hub's weights
""",
            _upcycle,
            _upcycle_options,
            check=_check_upcycle,
            description="Copies a LLaMA, a Mistral without a sliding window or a lime-model LLaMA run (routing\n"
            "none) by parameter name into a LIMe with --routing, its routers at self-only routing (each head\n"
            "reads its own layer's K/V), so its logits equal the source's until it trains (train --init).\n"
            "What LIMe cannot represent exactly (Qwen2's q/k/v biases, a sliding window) is refused.",
        ),
        Command(
            "prepare",
            "tokenise and pack a recipe's data into the cache that train reads, in parallel",
            f"""\
lime-model prepare --recipe cpu-tiny --data {DATA}/valid.txt --num-proc 2
# then the same recipe and data on several processes (not run in tests):
# accelerate launch --num_processes 2 -m lime_model.cli train --recipe cpu-tiny --data {DATA}/valid.txt --out runs/tiny-2
""",
            _prepare,
            _prepare_options,
            check=lambda args: _check_data(args.data, args.eval_data),
            description="Tokenise and pack a recipe's data (and --eval-data) once, with --num-proc processes, into\n"
            "the cache that train reads ($LIME_MODEL_CACHE, else ~/.cache/lime_model; or the recipe's\n"
            "cache_dir); a BPE the recipe trains on the data is trained and cached too. A train on several\n"
            "processes only reads this cache: run prepare first with the same --recipe, --data, --eval-data,\n"
            "--steps and --set (on each node, unless the cache folder is shared).",
        ),
        Command(
            "eval",
            "perplexity of a checkpoint on text, over fixed non-overlapping windows",
            f"""\
lime-model eval --ckpt runs/tiny --data {DATA}/test.txt --out out/tiny
lime-model eval --ckpt runs/tiny --data {DATA}/test.txt --window 64 --device cuda   # not run in tests: needs a GPU
""",
            _eval,
            _eval_options,
            check=_check_eval,
            description="Perplexity (exp of the mean token NLL) over non-overlapping windows of --window tokens\n"
            "(documents joined with eos, as training packs them; the tail is dropped), so every checkpoint\n"
            "with the same tokenizer is scored on the same windows.",
        ),
        Command(
            "eval-arithmetic",
            "greedy-decoding accuracy of an arithmetic run, per operator count (tier)",
            """\
# a finished run of: lime-model train --recipe arithmetic-cpu --out runs/aet
lime-model eval-arithmetic --ckpt runs/aet
""",
            _eval_arithmetic,
            _eval_arithmetic_options,
            description="Greedy-decoding accuracy of a finished arithmetic run on its test expressions, per operator\n"
            "count (tier); printed, and written to CKPT/arithmetic_eval.json.",
        ),
        Command(
            "eval-downstream",
            "benchmarks (ARC, HellaSwag, ...) of a checkpoint through lm-evaluation-harness",
            """\
lime-model eval-downstream --ckpt runs/lime --limit 100  # not run in tests: needs the hub's task data
lime-model eval-downstream --ckpt runs/lime --tasks agreement_demo
""",
            _eval_downstream,
            _eval_downstream_options,
            check=_check_downstream,
            description="Runs lm-evaluation-harness (lm-eval, optional: pip install 'lime-probe[eval]') with its\n"
            "Hugging Face wrapper on a checkpoint; writes lm-eval's results plus our run info to\n"
            "CKPT/downstream/<preset or tasks>[.Nshot][.limitN].json (or into --out). Hub tasks download their\n"
            "data (network); local task YAMLs (--include-path) and our agreement_demo run offline.",
        ),
        Command(
            "plan",
            "per-GPU peak memory, tokens, FLOPs and time of a recipe's training step, planned without a GPU",
            """\
lime-model plan --recipe cpu-tiny --gpus 1 --gpu-memory 16GiB
lime-model plan --recipe lime-1b-gqa --gpus 8 --gpu-memory 80GiB --json plan.json  # not run in tests: a few minutes of CPU
""",
            _plan,
            _plan_options,
            check=_check_plan,
            description="Runs one training step of the recipe (forward, loss, backward, clipping, AdamW) on\n"
            "shape-only tensors (FakeTensorMode) under torch's MemTracker: the per-GPU peak memory by\n"
            "category under DDP and, on 2 GPUs or more, under FSDP2 (torch's FSDPMemTracker, a fake process\n"
            "group; LIMe: each with and without recompute_routed_kv), whether it fits --gpu-memory and by\n"
            "how much; tokens per step, FLOPs per token and the step time at --mfu of --peak-tflops.\n"
            "Tensor bytes plus the CUDA allocator's block rounding and cuBLAS workspaces, as\n"
            "torch.cuda.max_memory_allocated counts them (lime_model.plan says what is modelled and what is\n"
            "not); DDP's validated against real CPU steps (tests/test_plan.py).",
        ),
        Command(
            "recipes",
            "list the shipped recipes: each one's parameters, training tokens and purpose",
            "lime-model recipes   # the paper's 1B GQA/MHA, 150M, deep 32/64/128, arithmetic, CPU-sized ones\n",
            _recipes,
        ),
    ]
}


def build_parser() -> argparse.ArgumentParser:
    """The ``lime-model`` argument parser: one subcommand per entry of ``COMMANDS``."""
    return command_line.build_parser(
        PROG,
        "Train LIMe / LLaMA from a recipe; perplexity, arithmetic and benchmark evals; list recipes.",
        COMMANDS.values(),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command, map errors to exit codes (see the module doc)."""
    return run_program(PROG, argv, build_parser, _run)


def _run(args: argparse.Namespace) -> int:
    command = COMMANDS[args.command]

    def work() -> None:
        if getattr(args, "reproducible", False):  # the checks may load NumPy, which reads the pins then
            from .reproducible import pin

            pin()
        command.check(args)  # before torch: see Command.check
        if getattr(args, "reproducible", False):  # before torch loads: it reads the mode's variables then
            from . import reproducible

            if args.threads not in (None, 1):
                raise ValueError(f"--reproducible runs on one thread; leave out --threads {args.threads}")
            reproducible.enable()
        if getattr(args, "threads", None) is not None:
            import torch

            torch.set_num_threads(args.threads)
        import lime_model

        lime_model.register_models()  # what `import lime_model` does for a library user (see there)
        command.run(args)

    return run_command(
        f"{PROG} {args.command}",
        work,
        debug=args.debug,
        interrupted=command.interrupted.format(**vars(args)),
        error_prefix=PROG,
    )


if __name__ == "__main__":
    sys.exit(main())
