"""Training throughput (tokens/s) of LIMe against its LLaMA baseline, side by side in one process.

Both models come from the same recipe (model widths, seq_len, micro_batch_size) and differ only in
``routing``; each timed step is the trainer's own `lime_model.train.train_step` (forward, the summed
token loss, backward, gradient clipping, an AdamW step with the recipe's parameter groups) through
accelerate with the recipe's mixed precision, on one micro-batch of random tokens.
Rounds alternate between the two models so that machine load hits both alike.

    python bench/train_throughput.py                              # cpu-tiny widths, 3 rounds of 10 steps
    python bench/train_throughput.py --recipe arithmetic-cpu --routing last-2 --steps 20
    python bench/train_throughput.py --recipe lime-150m --micro-batch 8    # on a GPU when there is one

Prints the median tokens/s of each and the ratio LIMe / LLaMA (the paper reports LIMe's overhead
as small: a ratio close to 1).
"""

from __future__ import annotations

import statistics
import time

import torch

from lime_model import LimeConfig, LimeForCausalLM, param_groups
from lime_model.command_line import POSITIVE_INT, OneLineParser
from lime_model.recipes import Recipe, load_recipe
from lime_model.train import TrainingData, accelerator_for, train_step


def build(recipe: Recipe, routing: str, vocab: int, accelerator):
    """A prepared (model, optimizer, constant-LR scheduler) as `lime_model.train` makes them."""
    model_kwargs = {k: v for k, v in recipe.model.items() if v is not None}
    model_kwargs["vocab_size"] = vocab
    torch.manual_seed(0)
    config = LimeConfig(routing=routing, max_position_embeddings=recipe.seq_len, **model_kwargs)
    model = LimeForCausalLM(config).train()
    groups = param_groups(model, recipe.weight_decay, recipe.router_lr_mult, lr=recipe.lr)
    optimizer = torch.optim.AdamW(groups, betas=(recipe.beta1, recipe.beta2), eps=recipe.eps)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler


def train_steps(accelerator, run, data: TrainingData, recipe: dict, steps: range) -> float:
    """Seconds for ``steps`` calls of the trainer's own `train_step` (one optimizer step each)."""
    model, optimizer, scheduler = run
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in steps:
        train_step(accelerator, model, optimizer, scheduler, data, recipe, step)
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="cpu-tiny")
    parser.add_argument("--routing", default="full", help="the LIMe variant to compare against routing=none")
    parser.add_argument("--steps", type=POSITIVE_INT, default=10, help="timed optimizer steps per round")
    parser.add_argument("--rounds", type=POSITIVE_INT, default=3)
    parser.add_argument("--micro-batch", type=POSITIVE_INT, help="sequences per step (default: the recipe's)")
    parser.add_argument(
        "--vocab", type=POSITIVE_INT, default=512, help="vocabulary when the recipe leaves it open"
    )
    args = parser.parse_args()

    recipe = load_recipe(args.recipe, {"data": "unused"})
    batch = args.micro_batch or recipe.micro_batch_size
    recipe = load_recipe(recipe, {"batch_size": batch, "micro_batch_size": batch})  # one micro-batch per step
    vocab = recipe.model["vocab_size"] or args.vocab
    seq = recipe.seq_len
    accelerator = accelerator_for(recipe)  # the recipe's mixed precision (bf16 on capable GPUs), device
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (args.steps * batch, seq), generator=gen)
    data = TrainingData(None, rows, rows)
    runs = {
        "LLaMA": build(recipe, "none", vocab, accelerator),
        "LIMe": build(recipe, args.routing, vocab, accelerator),
    }
    for run in runs.values():  # warm-up (allocator, kernels)
        train_steps(accelerator, run, data, recipe, range(2))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(train_steps(accelerator, run, data, recipe, range(args.steps)))
    tokens = args.steps * batch * seq
    rate = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    print(
        f"recipe {args.recipe}: {batch} x {seq} tokens per step, {args.steps} steps x {args.rounds} rounds, "
        f"device {accelerator.device}, mixed precision {accelerator.mixed_precision}, "
        f"threads {torch.get_num_threads()}"
    )
    for name, r in rate.items():
        label = f"{name} ({args.routing})" if name == "LIMe" else f"{name} (none)"
        print(f"  {label:<18} {r:12,.0f} tokens/s")
    print(f"  ratio LIMe / LLaMA  {rate['LIMe'] / rate['LLaMA']:.3f}")


if __name__ == "__main__":
    main()
