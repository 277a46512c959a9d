"""Training throughput (tokens/s) of LIMe against its LLaMA baseline, side by side in one process.

Both models come from the same recipe (model widths, seq_len, micro_batch_size) and differ only in
``routing``; each timed step is what `lime_model.train` does per micro-batch: forward, the summed
token loss, backward, gradient clipping and an AdamW step with the recipe's parameter groups.
Rounds alternate between the two models so that machine load hits both alike.

    python bench/train_throughput.py                              # cpu-tiny widths, 3 rounds of 10 steps
    python bench/train_throughput.py --recipe arithmetic-cpu --routing last-2 --steps 20
    python bench/train_throughput.py --recipe lime-150m --device cuda --micro-batch 8

Prints the median tokens/s of each and the ratio LIMe / LLaMA (the paper reports LIMe's overhead
as small: a ratio close to 1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lime_model import LimeConfig, LimeForCausalLM, param_groups
from lime_model.recipes import load_recipe
from lime_model.train import token_loss_sum


def build(recipe: dict, routing: str, vocab: int, device: str):
    model_kwargs = {k: v for k, v in recipe["model"].items() if v is not None}
    model_kwargs["vocab_size"] = vocab
    torch.manual_seed(0)
    config = LimeConfig(routing=routing, max_position_embeddings=recipe["seq_len"], **model_kwargs)
    model = LimeForCausalLM(config).to(device).train()
    groups = param_groups(model, recipe["weight_decay"], recipe["router_lr_mult"], lr=recipe["lr"])
    optimizer = torch.optim.AdamW(groups, betas=(recipe["beta1"], recipe["beta2"]), eps=recipe["eps"])
    return model, optimizer


def train_steps(model, optimizer, batches: list[torch.Tensor], grad_clip: float, autocast: bool) -> float:
    """Seconds for one optimizer step per batch."""
    device = batches[0].device
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for ids in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = token_loss_sum(model(input_ids=ids, use_cache=False).logits, ids) / ids.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="cpu-tiny")
    parser.add_argument("--routing", default="full", help="the LIMe variant to compare against routing=none")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default: the recipe's)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary when the recipe leaves it open")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    recipe = load_recipe(args.recipe, {"data": "unused"})
    vocab = recipe["model"]["vocab_size"] or args.vocab
    batch = args.micro_batch or recipe["micro_batch_size"]
    seq = recipe["seq_len"]
    autocast = args.device == "cuda"
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (batch, seq), generator=gen).to(args.device) for _ in range(args.steps)
    ]
    runs = {
        "LLaMA": build(recipe, "none", vocab, args.device),
        "LIMe": build(recipe, args.routing, vocab, args.device),
    }
    for model, opt in runs.values():  # warm-up (allocator, kernels)
        train_steps(model, opt, batches[:2], recipe["grad_clip"], autocast)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, opt) in runs.items():
            times[name].append(train_steps(model, opt, batches, recipe["grad_clip"], autocast))
    tokens = args.steps * batch * seq
    rate = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    print(
        f"recipe {args.recipe}: {batch} x {seq} tokens per step, {args.steps} steps x {args.rounds} rounds, "
        f"device {args.device}, threads {torch.get_num_threads()}"
    )
    for name, r in rate.items():
        label = f"{name} ({args.routing})" if name == "LIMe" else f"{name} (none)"
        print(f"  {label:<18} {r:12,.0f} tokens/s")
    print(f"  ratio LIMe / LLaMA  {rate['LIMe'] / rate['LLaMA']:.3f}")


if __name__ == "__main__":
    main()
