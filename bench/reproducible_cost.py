"""What the reproducible mode costs: training-step time in the mode over the same step without it.

The mode (``lime_model.reproducible``) can only be entered before torch loads, so the two sides
cannot share a process: each round starts two fresh processes, one per mode, in alternating order, and
each times ``--steps`` full training steps (forward, backward, clipping, AdamW, as ``lime_model.train``
takes them, after two untimed steps) of the same model from the same seed, on one thread, by process
CPU time. The ratio of a round is mode / default; the row is the median over rounds with its
distribution-free confidence interval (``lime_probe.probes.stats.median_ci``). Rows: the demo's
LIMe (recipe ``arithmetic-cpu``) and a LIMe run of the language-model studies (``wikitext-cpu``, as
lm-cpu-fair trains it). Each child also checks that its mode took effect (torch's CPU capability).

    python bench/reproducible_cost.py                  # both rows, 10 rounds (bench/RESULTS.md)
    python bench/reproducible_cost.py --rounds 3 --steps 5 --rows demo   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from statistics import median

from lime_model.command_line import POSITIVE_INT, OneLineParser

# recipe and micro-batch vocabulary per row (the arithmetic recipe takes its vocabulary from its characters)
ROWS = {"demo": ("arithmetic-cpu", 20), "lm-study": ("wikitext-cpu", None)}


def child(row: str, mode: bool, steps: int) -> dict[str, float | str]:
    """Time ``steps`` training steps of ``row``'s LIMe in this (fresh) process, in the mode or not."""
    # first: with LIME_REPRODUCIBLE=1 (set by ``run_child``) the package enters the mode before torch loads
    import lime_model  # noqa: F401

    # isort: split
    import torch
    from transformers import AutoModelForCausalLM

    from lime_model.architectures import config_for
    from lime_model.optim import param_groups
    from lime_model.recipes import load_recipe
    from lime_model.reproducible import active

    if active() != mode:
        raise SystemExit(
            f"the child meant to run with the mode {'on' if mode else 'off'} runs with it {'off' if mode else 'on'}"
        )
    torch.set_num_threads(1)
    recipe = load_recipe(ROWS[row][0], {"data": "not read"})  # only the model and batch sizes are used
    model_fields = {k: v for k, v in recipe.model.items() if v is not None and k != "arch"}
    model_fields.setdefault("vocab_size", ROWS[row][1])
    torch.manual_seed(0)
    cfg = config_for("lime", routing=recipe.routing, max_position_embeddings=recipe.seq_len, **model_fields)
    model = AutoModelForCausalLM.from_config(cfg).train()
    optimizer = torch.optim.AdamW(param_groups(model, recipe.weight_decay, recipe.router_lr_mult, recipe.lr))
    tokens = torch.randint(cfg.vocab_size, (recipe.micro_batch_size, recipe.seq_len))

    def step() -> None:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return {"step_s": median(times), "capability": torch.backends.cpu.get_cpu_capability()}


def run_child(row: str, mode: bool, steps: int) -> dict:
    """One child process: the mode's side through ``LIME_REPRODUCIBLE=1`` (``import lime_model`` enters the
    mode before torch loads), the default side in an environment without any of the mode's pins."""
    from lime_model.reproducible import PINNED

    env = {k: v for k, v in os.environ.items() if k not in PINNED and k != "LIME_REPRODUCIBLE"}
    env |= {"OMP_NUM_THREADS": "1"} | ({"LIME_REPRODUCIBLE": "1"} if mode else {})
    argv = [sys.executable, __file__, "--child", row, "--steps", str(steps)] + (["--mode"] if mode else [])
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"child {row} (mode {mode}) failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    ap.add_argument("--rounds", type=POSITIVE_INT, default=10)
    ap.add_argument(
        "--steps", type=POSITIVE_INT, default=10, help="timed steps per process (after two untimed)"
    )
    ap.add_argument("--child", choices=sorted(ROWS), help=argparse.SUPPRESS)
    ap.add_argument("--mode", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.mode, args.steps)))
        return
    from lime_probe.probes.stats import median_ci

    print("row        ratio mode/default [95% CI of the median]   min-max      step s (default)  capability")
    for row in args.rows:
        ratios, base, caps = [], [], set()
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {mode: run_child(row, mode, args.steps) for mode in order}
            ratios.append(got[True]["step_s"] / got[False]["step_s"])
            base.append(got[False]["step_s"])
            caps |= {f"{'mode' if m else 'default'}={g['capability']}" for m, g in got.items()}
        lo, hi, cov = median_ci(ratios)
        print(
            f"{row:10s} {median(ratios):.3f} [{lo:.3f}-{hi:.3f}] ({cov:.0%}, {args.rounds} rounds)"
            f"   {min(ratios):.3f}-{max(ratios):.3f}   {median(base):.4f}          {', '.join(sorted(caps))}"
        )


if __name__ == "__main__":
    main()
