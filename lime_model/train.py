"""The training loop: data, model, AdamW with warmup + decay, metrics, atomic checkpoints, resume.

Distributed runs go through `accelerate` (``torchrun`` or ``accelerate launch``): DDP, or, when the
recipe sets ``fsdp``, PyTorch's FSDP2 (``fully_shard``, applied here on CPUs and GPUs alike:
``shard``). Every process sees the same global batch order (a seeded permutation per epoch) and
takes its own slice; each micro-batch's loss is the summed token loss over the number of target
tokens in the *global* batch, so 1 process with accumulation and N processes give the same gradients.
Several processes never tokenise: they read the packed-token cache that ``lime-model prepare`` made
(``prepare_data``).

What a run folder holds and what each metric means is documented in docs/models.md, "The run folder".

Checkpoints are whole or absent and carry their files' digests (``lime_model.checkpoint``). A new
run's folder appears with its recipe, tokenizer and run info at once, and the final model's weights are
published last, so a run stopped at any moment (Ctrl-C, a crash) leaves a folder that the same command
continues: from the last intact checkpoint, or from the start before the first. One run at a time
writes a folder (a lock file in it); a full disk ends the run with one line naming the file that did
not fit, the files written so far left whole.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from . import data as data_mod
from . import reproducible
from .architectures import config_for
from .checkpoint import (
    RunLock,
    check_out_dir,
    checkpoints,
    claim,
    load_training_state,
    load_weights,
    open_run_dir,
    publish_final,
    save_checkpoint,
    trim_metrics,
)
from .checks import check_device, check_weights
from .config import LimeConfig
from .distributed import (
    TRACKER_PROJECT,
    accelerator_for,
    hparams,
    no_sync,
    on_main,
    prepare,
    shard,
    tracker_options,
)
from .evaluate import default_cache_dir, token_loss_sum, token_nll
from .files import atomic_dir, atomic_write, check_writable, naming_disk_full
from .flops import forward_flops
from .hub import write_model_card
from .optim import param_groups
from .recipes import Recipe, load_recipe
from .tasks import arithmetic
from .tokenization import char_tokenizer, load_tokenizer, train_bpe
from .upcycle import check_init_dir, init_config, load_init


@dataclass
class TrainingData:
    """Token rows ``input_ids`` (N, seq_len) and ``labels`` (N, seq_len), -100 where no loss; integer
    tensors (int32 memory-mapped rows for language modelling), made int64 per batch. ``eval_input_ids``
    and ``eval_labels`` (M, seq_len) are the held-out rows (None: no held-out evaluation)."""

    tokenizer: Any
    input_ids: torch.Tensor
    labels: torch.Tensor
    test_samples: list[arithmetic.Sample] | None = None
    lengths: torch.Tensor | None = None  # (N,) non-padding tokens per row; None: every row is full
    eval_input_ids: torch.Tensor | None = None
    eval_labels: torch.Tensor | None = None

    def n_tokens(self, idx: torch.Tensor) -> int:
        """Real (non-padding) input tokens in rows ``idx``."""
        return (
            int(self.lengths[idx].sum()) if self.lengths is not None else len(idx) * self.input_ids.shape[1]
        )


# ---------------------------------------------------------------------------------------------
# pure pieces


def lr_factor(step: int, recipe: Recipe, total_steps: int) -> float:
    """LR multiplier at 0-based optimizer step ``step``: linear warmup, then decay to ``min_lr/lr``."""
    warmup = recipe.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if recipe.schedule == "constant":
        return 1.0
    floor = recipe.min_lr / recipe.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if recipe.schedule == "cosine" else 1 - progress
    return floor + (1 - floor) * shape


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> torch.Tensor:
    """Row indices of global batch ``step`` in a stream of seeded per-epoch permutations of ``n`` rows."""
    positions = torch.arange(step * batch_size, (step + 1) * batch_size)
    epochs = positions // n
    out = torch.empty(batch_size, dtype=torch.long)
    for epoch in epochs.unique().tolist():
        mask = epochs == epoch
        out[mask] = _epoch_permutation(n, seed, epoch)[positions[mask] % n]
    return out


@lru_cache(maxsize=2)  # a batch spans at most two epochs; each step reuses them instead of redrawing
def _epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The row order of ``epoch`` (n,), drawn from its own seeded generator (read-only by convention)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def total_steps(recipe: Recipe, n_rows: int) -> int:
    if recipe.steps is not None:
        return recipe.steps
    assert recipe.epochs is not None  # a recipe gives steps or epochs (Recipe.__post_init__)
    return max(1, math.ceil(recipe.epochs * n_rows / recipe.batch_size))


# ---------------------------------------------------------------------------------------------
# data and model


def prepare_data(
    recipe: Recipe, tokenizer=None, progress: bool = False, num_proc: int = 1, build: bool = True
) -> TrainingData:
    """Training rows, held-out rows (and the arithmetic test set) for ``recipe``; ``tokenizer``
    overrides the recipe's. ``num_proc`` processes tokenise (the same rows for any number); with
    ``build=False`` the caches must hold everything (else ``lime_model.data.NotPrepared``).

    Language-model rows come from the packed-token cache when it holds them (memory-mapped, int32),
    checked before any text is read; a BPE trained on the data is cached the same way. Held-out
    rows are ``eval_data`` packed the same way, else the last ``eval_holdout`` of ``data``'s rows
    (cut at a row boundary: a document straddling it has its start trained on), else none; the
    arithmetic task holds out its test expressions. ``eval_max_rows`` keeps the first rows.
    """
    if recipe.task == "arithmetic":
        train_s, test_s = arithmetic.recipe_splits(recipe)
        tokenizer = tokenizer or char_tokenizer(arithmetic.CHARS)
        input_ids, labels = arithmetic.encode(train_s, tokenizer, recipe.seq_len)
        lengths = (input_ids != tokenizer.pad_token_id).sum(1)
        eval_ids, eval_labels = arithmetic.encode(test_s[: recipe.eval_max_rows], tokenizer, recipe.seq_len)
        return TrainingData(tokenizer, input_ids, labels, test_s, lengths, eval_ids, eval_labels)
    assert recipe.data is not None  # a text task names its data (Recipe.__post_init__)
    source = data_mod.TextSource(recipe.data, recipe.split, recipe.max_texts)
    cache = default_cache_dir(recipe.cache_dir)
    if tokenizer is None:
        if recipe.tokenizer is not None:
            tokenizer = load_tokenizer(recipe.tokenizer)
        elif recipe.model["vocab_size"] is None:
            raise ValueError("set model.vocab_size (the BPE size to train) or name a --set tokenizer=DIR")
        else:
            tokenizer = _cached_bpe(source, recipe.model["vocab_size"], cache, build)
    check_vocab(tokenizer, recipe)
    max_rows = None
    if recipe.one_pass and recipe.steps is not None:  # the rows the steps consume, plus the held-out share
        max_rows = math.ceil(recipe.steps * recipe.batch_size / (1 - recipe.eval_holdout))
    rows = torch.from_numpy(
        data_mod.packed_sequences(
            source, tokenizer, recipe.seq_len, cache, progress, max_rows, num_proc=num_proc, build=build
        )
    )
    held_out = None
    if recipe.eval_data is not None:
        eval_source = data_mod.TextSource(recipe.eval_data)
        held_out = torch.from_numpy(
            data_mod.packed_sequences(
                eval_source, tokenizer, recipe.seq_len, cache, num_proc=num_proc, build=build
            )
        )
    elif recipe.eval_holdout > 0:
        n_eval = max(1, round(recipe.eval_holdout * len(rows)))
        if n_eval >= len(rows):
            raise ValueError(f"eval_holdout {recipe.eval_holdout} leaves no training rows of {len(rows)}")
        rows, held_out = rows[:-n_eval], rows[-n_eval:]
    if held_out is not None:
        held_out = held_out[: recipe.eval_max_rows]
    return TrainingData(tokenizer, rows, rows, eval_input_ids=held_out, eval_labels=held_out)


def _cached_bpe(source: data_mod.TextSource, vocab_size: int, cache_dir, build: bool = True) -> Any:
    """``train_bpe`` on ``source``, saved under ``cache_dir`` and loaded from there next time
    (``build=False``: only loaded, ``lime_model.data.NotPrepared`` if it is not there)."""
    folder = data_mod.cache_path(cache_dir, "bpe", {"texts": source.key(), "vocab_size": vocab_size})
    assert folder is not None  # `cache_dir` is given
    if not folder.is_dir():
        if not build:
            raise data_mod.NotPrepared(f"no BPE tokenizer at {folder}")
        with atomic_dir(folder) as tmp:
            train_bpe(source.load(), vocab_size).save_pretrained(tmp)
    return load_tokenizer(str(folder))


def check_vocab(tokenizer, recipe: Recipe) -> None:
    vocab = recipe.model["vocab_size"]
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}: "
            "raise model.vocab_size or use another tokenizer"
        )


def model_config(recipe: Recipe, tokenizer) -> LimeConfig:
    model = {k: v for k, v in recipe.model.items() if v is not None and k != "arch"}
    model.setdefault("vocab_size", len(tokenizer))
    return config_for(
        recipe.arch,
        routing=recipe.routing,
        max_position_embeddings=recipe.seq_len,
        use_cache=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **model,
    )


# ---------------------------------------------------------------------------------------------
# the loop


def micro_batch_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, n_targets: int) -> torch.Tensor:
    """One micro-batch's share of the step's loss: its summed token loss (``input_ids``/``labels``
    ``(micro, seq_len)``) over the number of target tokens in the global batch (a scalar tensor)."""
    return token_loss_sum(model(input_ids=input_ids, use_cache=False).logits, labels) / n_targets


def build_optimizer(model, recipe: Recipe, foreach: bool | None = None) -> torch.optim.AdamW:
    """The recipe's AdamW over ``lime_model.optim.param_groups`` (``foreach``: torch's own choice
    when None, as training leaves it)."""
    return torch.optim.AdamW(
        param_groups(model, recipe.weight_decay, recipe.router_lr_mult, lr=recipe.lr),
        betas=(recipe.beta1, recipe.beta2),
        eps=recipe.eps,
        foreach=foreach,
    )


def train_step(accelerator, model, optimizer, scheduler, data: TrainingData, recipe, step: int):
    """One optimizer step on global batch ``step``: (this process's share of the loss, grad norm, lr).

    The process's slice of the batch runs in micro-batches; gradients are synchronised on the last.
    Loss and grad norm stay tensors (no device sync per step).
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    per_rank, micro = recipe.batch_size // world, recipe.micro_batch_size
    idx = batch_indices(step, recipe.batch_size, len(data.input_ids), recipe.seed)
    n_targets = int((data.labels[idx][:, 1:] != -100).sum().clamp(min=1))
    local = idx[rank * per_rank : (rank + 1) * per_rank]
    loss_sum = torch.zeros((), device=accelerator.device)
    for m in range(0, per_rank, micro):
        rows = local[m : m + micro]
        input_ids = data.input_ids[rows].to(accelerator.device, torch.long)
        labels = data.labels[rows].to(accelerator.device, torch.long)
        with nullcontext() if m + micro >= per_rank else no_sync(accelerator, model):
            loss = micro_batch_loss(model, input_ids, labels, n_targets)
            accelerator.backward(loss * world)  # DDP and FSDP average gradients over processes
        loss_sum += loss.detach()
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    lr = optimizer.param_groups[0]["lr"]  # the "decay" group's; routers run at lr x router_lr_mult
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, lr


def train(
    recipe: str | Mapping[str, Any] | Recipe,
    out_dir: str | os.PathLike,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    report_to: str = "none",
    **overrides: Any,
) -> Path:
    """Train the recipe into ``out_dir`` and return it (a self-contained HF model directory).

    Args:
        recipe: a shipped recipe name, a JSON path, or a dict (see ``lime_model.recipes``).
        out_dir: the run directory: absent or empty for a new run; a folder holding an unfinished run
            of the same recipe is continued from its last intact checkpoint (see
            ``lime_model.checkpoint.check_out_dir``). One run at a time writes it: a second is
            refused while the first holds its lock (``lime_model.checkpoint.RunLock``).
        resume: require a run in ``out_dir`` to continue (a finished one is republished).
        progress: show tqdm progress bars.
        stop_after: end this invocation after that global step (with a checkpoint) so that a later
            ``resume`` continues it; the schedule still spans the recipe's full length.
        report_to: also log every ``metrics.jsonl`` line through accelerate's trackers: ``"tensorboard"``
            (event files under ``out_dir/tensorboard``), ``"wandb"`` (project ``lime-model``, the run
            named after ``out_dir``) or ``"none"``.
        **overrides: recipe fields, e.g. ``steps=100, routing="none", model={"hidden_size": 64}``.
    """
    recipe = load_recipe(recipe, overrides)
    if recipe.init is not None:  # its refusals come before anything is written
        check_init_dir(recipe.init)
        init_config(recipe, model_config(recipe, load_tokenizer(recipe.init)))
    out_dir = Path(out_dir)
    accelerator = accelerator_for(recipe, **tracker_options(report_to, out_dir))
    world = accelerator.num_processes
    if recipe.batch_size % (world * recipe.micro_batch_size):
        raise ValueError(
            f"batch_size {recipe.batch_size} is not a multiple of {world} processes x "
            f"micro_batch_size {recipe.micro_batch_size}"
        )
    resume = check_out_dir(out_dir, recipe, resume)  # its refusals write nothing
    if resume:  # half of a run's steps on another code path would be neither mode's result
        reproducible.check_same_mode(out_dir, reproducible.active())
    lock = RunLock()
    try:
        ckpt = on_main(accelerator, partial(claim, lock, out_dir, resume))
        data = _training_data(recipe, out_dir, resume, accelerator, progress)
        on_main(accelerator, partial(open_run_dir, lock, out_dir, recipe, data.tokenizer, accelerator, ckpt))
        accelerator.init_trackers(  # main process only; after the run folder exists
            TRACKER_PROJECT,
            hparams(recipe),
            init_kwargs={"wandb": {"name": out_dir.name, "dir": str(out_dir)}},
        )
        run, start, tokens = _start(accelerator, recipe, data, out_dir, ckpt)
        steps = total_steps(recipe, len(data.input_ids))
        last = steps if stop_after is None else min(steps, stop_after)
        _train_steps(run, start, tokens, last, progress)
        _finish(run, last == steps, progress)
    finally:
        lock.release()
    return out_dir


@dataclass
class _Run:
    """One invocation of ``train``: its prepared model, optimizer and schedule, and where it writes."""

    accelerator: Any
    recipe: Recipe
    config: LimeConfig
    data: TrainingData
    out_dir: Path
    model: Any
    optimizer: Any
    scheduler: Any


def _training_data(recipe: Recipe, out_dir: Path, resume: bool, accelerator, progress: bool) -> TrainingData:
    """``prepare_data`` with the run's own tokenizer when a continued run saved one."""
    world = accelerator.num_processes
    saved_tokenizer = resume and (out_dir / "tokenizer_config.json").exists()
    source = str(out_dir) if saved_tokenizer else recipe.init  # an init's embeddings are its tokenizer's
    tokenizer = None if source is None else load_tokenizer(source)
    try:  # several processes only read the caches: rank 0 tokenising behind a barrier times out at scale
        return prepare_data(
            recipe, tokenizer, progress=progress and accelerator.is_main_process, build=world == 1
        )
    except data_mod.NotPrepared as e:
        raise FileNotFoundError(
            f"{e}: a run on {world} processes does not tokenise; run `lime-model prepare` with the same "
            "--recipe, --data, --eval-data, --steps and --set first"
        ) from None


def _start(accelerator, recipe: Recipe, data: TrainingData, out_dir: Path, ckpt: Path | None):
    """The model, optimizer and schedule, from ``ckpt`` when given (else the weights of ``recipe.init``,
    else a random init): ``(run, first step, tokens seen)``."""
    torch.manual_seed(recipe.seed)
    init = None if recipe.init is None else Path(recipe.init)
    config = model_config(recipe, data.tokenizer)
    if init is not None:
        config = init_config(recipe, config)
    model = AutoModelForCausalLM.from_config(config)  # the arch's class (registered by lime_model)
    if ckpt is not None:
        load_weights(ckpt, model)
    elif init is not None:
        load_init(init, model)
    model.train()
    world = accelerator.num_processes
    if recipe.fsdp and world > 1:  # before the optimizer: sharding replaces the parameters
        from torch.distributed.device_mesh import init_device_mesh

        model = shard(model, init_device_mesh(accelerator.device.type, (world,)))
    steps = total_steps(recipe, len(data.input_ids))
    optimizer = build_optimizer(model, recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe, steps))
    model, optimizer = prepare(accelerator, model, optimizer)
    start, tokens = (
        (0, 0) if ckpt is None else load_training_state(ckpt, accelerator, model, optimizer, scheduler)
    )
    if accelerator.is_main_process:
        trim_metrics(out_dir, start)
    return _Run(accelerator, recipe, config, data, out_dir, model, optimizer, scheduler), start, tokens


def _train_steps(run: _Run, start: int, tokens: int, last: int, progress: bool) -> None:
    """Global steps ``start`` to ``last``: a ``metrics.jsonl`` line every ``log_every`` steps, on
    evaluation steps and at the last; a checkpoint every ``save_every`` steps and at the last."""
    accelerator, recipe, data = run.accelerator, run.recipe, run.data
    main, n_rows = accelerator.is_main_process, len(data.input_ids)
    seq_flops = 3 * forward_flops(run.config, recipe.seq_len)
    bar = tqdm(total=last, initial=start, desc="train", disable=not (progress and main), unit="step")
    window_t, window_tokens = time.perf_counter(), 0
    has_eval = data.eval_input_ids is not None and len(data.eval_input_ids) > 0
    for step in range(start, last):
        if main and second_epoch_starts(step, recipe.batch_size, n_rows):
            warn_second_epoch(step, recipe, n_rows)
        loss, grad_norm, lr = train_step(
            accelerator, run.model, run.optimizer, run.scheduler, data, recipe, step
        )
        batch_tokens = data.n_tokens(batch_indices(step, recipe.batch_size, n_rows, recipe.seed))
        tokens += batch_tokens
        window_tokens += batch_tokens
        done = step + 1
        evaluate_now = has_eval and (done == last or (recipe.eval_every and done % recipe.eval_every == 0))
        if done % recipe.log_every == 0 or done == last or evaluate_now:
            loss_value = accelerator.reduce(loss, reduction="sum").item()
            # every process evaluates every held-out row (FSDP needs all ranks in each forward)
            held_out = _held_out(run.model, data, recipe) if evaluate_now else {}
            if main:
                now = time.perf_counter()
                record = {
                    "step": done,
                    "tokens": tokens,
                    "flops": done * recipe.batch_size * seq_flops,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": window_tokens / max(now - window_t, 1e-9),
                    **held_out,
                }
                _log(run, record)
                bar.set_postfix(loss=f"{loss_value:.4f}")
                window_t, window_tokens = now, 0
        bar.update(1)
        if done % recipe.save_every == 0 or done == last:
            save_checkpoint(
                accelerator,
                run.model,
                run.optimizer,
                run.scheduler,
                data.tokenizer,
                recipe,
                done,
                tokens,
                run.out_dir,
            )
    bar.close()


def _log(run: _Run, record: dict[str, Any]) -> None:
    """One ``metrics.jsonl`` line, and the same through accelerate's trackers."""
    path = run.out_dir / "metrics.jsonl"
    with naming_disk_full(path), open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    run.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def _finish(run: _Run, complete: bool, progress: bool) -> None:
    """Publish the final model when the run is ``complete`` (arithmetic: evaluated too), and end it."""
    accelerator = run.accelerator
    if complete:
        on_main(accelerator, partial(_publish, run.out_dir, run.recipe, progress, accelerator.device))
    accelerator.wait_for_everyone()
    # DDP's reducer must not outlive the process group: as its last owner it would destroy the gloo group
    # holding the GIL, while a gloo thread waits for the GIL to free the barrier's work (a hang at exit,
    # pytorch/pytorch#56297). Released first, the group is freed by end_training without the GIL.
    run.model, run.optimizer, run.scheduler = accelerator.free_memory(run.model, run.optimizer, run.scheduler)
    # Under mixed precision accelerate sets an autocast wrapper of forward on the model itself, a cycle that
    # would keep its weights on the device until the cyclic collector runs (a study trains run after run).
    gc.collect()
    accelerator.end_training()


def _publish(out_dir: Path, recipe: Recipe, progress: bool, device: torch.device) -> None:
    """Main process: the last checkpoint's model published into ``out_dir``, evaluated (arithmetic task)
    and described in its model card."""
    publish_final(out_dir, checkpoints(out_dir)[-1])
    if recipe.task == "arithmetic":  # from the published files: sharded or not, one whole model
        evaluate_arithmetic(out_dir, progress=progress, device=device)
    write_model_card(out_dir)


def _held_out(model, data: TrainingData, recipe: Recipe) -> dict[str, float]:
    """``val_loss`` (mean token NLL of the held-out rows) and ``val_perplexity`` (its exp)."""
    assert data.eval_input_ids is not None and data.eval_labels is not None  # `has_eval`
    total, count = token_nll(model, data.eval_input_ids, data.eval_labels, recipe.micro_batch_size)
    return {"val_loss": total / count, "val_perplexity": math.exp(total / count)}


def second_epoch_starts(step: int, batch_size: int, n_rows: int) -> bool:
    """Whether global batch ``step`` is the first to reach past one pass over ``n_rows`` rows."""
    return step * batch_size <= n_rows < (step + 1) * batch_size


def warn_second_epoch(step: int, recipe: Recipe, n_rows: int) -> None:
    planned = f" (the recipe asks for {recipe.epochs} epochs)" if recipe.steps is None else ""
    warnings.warn(
        f"step {step + 1} starts a second epoch over the {n_rows} training sequences{planned}: from here "
        "on the run sees data again (give it more data, or set one_pass=true to read one pass)",
        SecondEpochWarning,
        stacklevel=3,
    )


class SecondEpochWarning(UserWarning):
    """Training has started to repeat its data."""


def evaluate_arithmetic(
    run_dir: str | os.PathLike, progress: bool = False, device: str | torch.device = "cpu"
) -> dict[int, float]:
    """Evaluate a finished arithmetic run on its (regenerated) test set; (re)writes arithmetic_eval.json.

    The run's files, ``device`` and the output are checked before the model is loaded."""
    run_dir = Path(run_dir)
    if not (run_dir / "recipe.json").is_file() or not (run_dir / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a finished lime-model run (needs recipe.json and model.safetensors)"
        )
    recipe = load_recipe(json.loads((run_dir / "recipe.json").read_text()))
    if recipe.task != "arithmetic":
        raise ValueError(f"{run_dir} was trained on task {recipe.task!r}, not arithmetic")
    check_weights(run_dir)
    check_device(device)
    check_writable(run_dir / "arithmetic_eval.json", option="--ckpt")
    model = AutoModelForCausalLM.from_pretrained(run_dir).to(device)  # type: ignore[arg-type]  # transformers' wrapper of `to` hides its signature
    _, test = arithmetic.recipe_splits(recipe, with_train=False)
    acc = arithmetic.evaluate(
        model,
        load_tokenizer(str(run_dir)),
        test,
        batch_size=recipe.arithmetic.eval_batch_size,
        progress=progress,
    )
    report = {
        "accuracy": {str(n): a for n, a in acc.items()},
        "n_test_per_tier": recipe.arithmetic.test_per_tier,
        "routing": recipe.routing,
    }
    atomic_write(run_dir / "arithmetic_eval.json", json.dumps(report, indent=1))
    return acc
