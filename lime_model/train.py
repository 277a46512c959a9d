"""The training loop: data, model, AdamW with warmup + decay, metrics, atomic checkpoints, resume.

Distributed runs go through `accelerate` (``torchrun`` or ``accelerate launch``): DDP, or, when the
recipe sets ``fsdp``, PyTorch's FSDP2 (``fully_shard``, applied here on CPUs and GPUs alike:
:func:`shard`). Every process sees the same global batch order (a seeded permutation per epoch) and
takes its own slice; each micro-batch's loss is the summed token loss over the number of target
tokens in the *global* batch, so 1 process with accumulation and N processes give the same gradients.
Several processes never tokenise: they read the packed-token cache that ``lime-model prepare`` made
(:func:`prepare_data`).

An output directory holds::

    recipe.json            the recipe (resuming checks it)
    run_info.json          per start of the process: versions, device, threads, determinism flags
    metrics.jsonl          one JSON line every log_every (and eval_every) steps (fields below)
    checkpoints/step-N/    HF model + tokenizer, trainer_state.json (step, optimizer hyperparameters,
                           scheduler), optimizer.safetensors (Adam moments by parameter name, RNG)
    config.json, model.safetensors, tokenizer files     the final model, a self-contained HF dir
    *.py                   the model's code (in checkpoints too): loads with trust_remote_code=True
    README.md              the model card (:mod:`lime_model.hub`), written when the run finishes
    arithmetic_eval.json   accuracy per operator count, the task's tiers (arithmetic task)
    tensorboard/           event files, with ``report_to="tensorboard"``

Metrics: ``step``; ``tokens``, the real input tokens seen so far (padding excluded: the arithmetic
task's right-padded rows count their ``bos prompt solution eos`` only); ``flops`` (3 x forward
FLOPs per sequence, padding included: it is compute spent); ``loss``, the mean token loss of the
step's global batch; ``lr``, the step's learning rate (routers use ``lr * router_lr_mult``);
``grad_norm`` before clipping; ``tokens_per_s``, real tokens per second since the previous line;
on evaluation steps (every ``eval_every`` and the last, when there are held-out rows) also
``val_loss``, the mean token NLL of the held-out rows, and ``val_perplexity``, its exp (see
:mod:`lime_model.evaluate`). Training warns (:class:`SecondEpochWarning`) when it starts a
second pass over its data.

A checkpoint directory is written under a dot-name, fsynced and renamed into place when complete,
so any ``step-N`` directory is whole (an old one is renamed away before it is deleted). Nothing in it
needs unpickling. A new run's folder appears with its recipe, tokenizer and run info at once, and the
final model's weights are published last, so a run stopped at any moment (Ctrl-C, a crash) leaves a
folder that the same command continues: from the last checkpoint, or from the start before the first.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from . import data as data_mod
from . import reproducible
from .architectures import config_for
from .checks import check_device, check_weights
from .config import LimeConfig
from .evaluate import default_cache_dir, token_loss_sum, token_nll
from .files import atomic_dir, atomic_write, check_writable
from .flops import forward_flops
from .hub import write_model_card
from .modeling import LimeDecoderLayer
from .optim import param_groups
from .recipes import Recipe, identity, load_recipe
from .tasks import arithmetic
from .tokenization import char_tokenizer, load_tokenizer, train_bpe

CHECKPOINTS = "checkpoints"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "optimizer.safetensors"


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
    ``build=False`` the caches must hold everything (else :class:`~lime_model.data.NotPrepared`).

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
    """:func:`train_bpe` on ``source``, saved under ``cache_dir`` and loaded from there next time
    (``build=False``: only loaded, :class:`~lime_model.data.NotPrepared` if it is not there)."""
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
# checkpoints


def checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    return sorted(root.glob("step-*"), key=lambda p: int(p.name[5:])) if root.is_dir() else []


def _sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _full_state_options():
    """Whole tensors, gathered on the CPU of the main process (the others get none): what it saves."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _full_state_dict(accelerator, model) -> dict:
    """The whole model's state dict on the main process (a collective when sharded). The names of a
    tied parameter share one tensor, as in an unsharded model's, so ``save_pretrained`` stores it once."""
    if not _sharded(model):
        return accelerator.get_state_dict(model)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_full_state_options())
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        source = first.setdefault(id(param), name)
        if source != name and source in state:  # gathered twice
            state[name] = state[source]
    return state


def _savable(accelerator, model):
    """The model whose ``save_pretrained`` writes a checkpoint's files, given the weights. A sharded
    model's class is FSDP's subclass, whose module would be saved as the model's code and named in
    ``auto_map``: the unsharded class stands in, built on the meta device (no memory)."""
    if not _sharded(model):
        return accelerator.unwrap_model(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.config)


def _param_order(accelerator, model, optimizer) -> list[str]:
    """Parameter names in the optimizer's index order (the order `optimizer.state_dict()` numbers them)."""
    names = {id(p): n for n, p in accelerator.unwrap_model(model).named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _named_optimizer_state(accelerator, model, optimizer) -> dict:
    """The full optimizer state keyed by parameter name (gathered from the shards when sharded: a
    collective; the same format either way)."""
    if _sharded(model):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer.optimizer, options=_full_state_options())
    state = optimizer.state_dict()
    order = _param_order(accelerator, model, optimizer)
    return {
        "state": {order[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _load_named_optimizer_state(accelerator, model, optimizer, named: dict) -> None:
    if _sharded(model):  # every process holds the whole state (it read the files): each keeps its shard
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer.optimizer, named, options=options)
        return
    index = {n: i for i, n in enumerate(_param_order(accelerator, model, optimizer))}
    optimizer.load_state_dict(
        {
            "state": {index[n]: s for n, s in named["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
        }
    )


def _save_checkpoint(
    accelerator, model, optimizer, scheduler, tokenizer, recipe, step: int, tokens: int, out_dir: Path
) -> None:
    """Write ``checkpoints/step-N`` atomically: HF model + tokenizer, optimizer/RNG tensors, JSON state."""
    state_dict = _full_state_dict(accelerator, model)  # collectives under FSDP: every rank calls them
    opt_state = _named_optimizer_state(accelerator, model, optimizer)
    if accelerator.is_main_process:
        root = out_dir / CHECKPOINTS
        root.mkdir(exist_ok=True)
        for stale in root.glob(".step-*"):  # left by a process killed while writing or deleting one
            shutil.rmtree(stale, ignore_errors=True)
        # the same step saved again (a resumed run) is swapped out whole
        with atomic_dir(root / f"step-{step:08d}") as tmp:
            with _quiet_hf_progress():
                _savable(accelerator, model).save_pretrained(
                    tmp, state_dict=state_dict, safe_serialization=True
                )
            tokenizer.save_pretrained(tmp)
            tensors = {
                f"state/{name}/{k}": v.detach().cpu().contiguous()
                for name, s in opt_state["state"].items()
                for k, v in s.items()
            }
            tensors["rng/torch"] = torch.get_rng_state()
            if torch.cuda.is_available():
                tensors["rng/cuda"] = torch.cuda.get_rng_state()
            save_file(tensors, tmp / STATE_TENSORS)
            state = {
                "step": step,
                "tokens": tokens,
                "world_size": accelerator.num_processes,
                "recipe": recipe.identity(),
                "param_groups": opt_state["param_groups"],
                "scheduler": scheduler.state_dict(),
            }
            (tmp / STATE_JSON).write_text(json.dumps(state, indent=1))
        for old in checkpoints(out_dir)[: -recipe.keep_last]:  # renamed first: never a half-deleted step-N
            gone = old.with_name(f".{old.name}.deleted")
            os.replace(old, gone)
            shutil.rmtree(gone)
    accelerator.wait_for_everyone()


@contextmanager
def _quiet_hf_progress():
    """Silence transformers' per-save "Writing model shards" bar (ours is the training bar)."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load_weights(ckpt: Path, model) -> None:
    """The checkpoint's weights into the (unwrapped) model."""
    missing, unexpected = model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is stored once, as the embedding
        raise ValueError(f"{ckpt} does not match the model: missing {missing}, unexpected {unexpected}")


def _load_training_state(ckpt: Path, accelerator, model, optimizer, scheduler) -> tuple[int, int]:
    """Optimizer, scheduler and RNG state of ``ckpt`` into the prepared objects; returns its
    (step, tokens seen)."""
    state = json.loads((ckpt / STATE_JSON).read_text())
    tensors = load_file(ckpt / STATE_TENSORS)
    torch.set_rng_state(tensors.pop("rng/torch"))
    if "rng/cuda" in tensors:
        cuda_rng = tensors.pop("rng/cuda")
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda_rng)
    named: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, name, k = key.split("/")
        named.setdefault(name, {})[k] = value
    _load_named_optimizer_state(
        accelerator, model, optimizer, {"state": named, "param_groups": state["param_groups"]}
    )
    scheduler.load_state_dict(state["scheduler"])
    return state["step"], state["tokens"]


def _publish_final(out_dir: Path, ckpt: Path) -> None:
    """Copy the last checkpoint's HF files into ``out_dir`` (each file replaced atomically), the weights
    last: a folder with weights holds the whole final model (see :func:`_finished`)."""
    for f in sorted(ckpt.iterdir(), key=lambda f: ("safetensors" in f.name, f.suffix == ".json", f.name)):
        if f.name in (STATE_JSON, STATE_TENSORS):
            continue
        with open(f, "rb") as src:
            atomic_write(out_dir / f.name, partial(shutil.copyfileobj, src))


def _check_out_dir(out_dir: Path, recipe: Recipe, resume: bool) -> tuple[bool, Path | None]:
    """Validate ``out_dir`` before anything is written: ``(continuing, checkpoint to resume from)``.

    An absent or empty folder starts a new run. A folder holding an unfinished run of the same recipe
    (stopped by Ctrl-C, a crash or ``stop_after``) is continued, with or without ``resume``: from its
    last checkpoint, or from the start when it has none. A finished run is continued (republished) only
    with ``resume``; another recipe, another length or a folder of other files is refused.
    """
    saved = out_dir / "recipe.json"
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out {out_dir} exists and is not a folder: choose a new --out")
    if not saved.is_file():
        if resume:
            raise FileNotFoundError(f"nothing to resume in {out_dir}: no recipe.json")
        if out_dir.exists() and any(out_dir.iterdir()):
            raise ValueError(f"{out_dir} is not empty and holds no lime-model run: choose a new --out")
        check_writable(out_dir, folder=True)
        return False, None
    old = identity(json.loads(saved.read_text()))
    new = recipe.identity()
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if changed and set(changed) <= {"steps", "epochs"}:
        diff = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in changed)
        raise ValueError(
            f"cannot resume {out_dir} with another length ({diff}): the length sets the learning-rate "
            "schedule, so a run cannot be extended; train into a new --out"
        )
    if changed:
        raise ValueError(
            f"cannot resume {out_dir}: it was trained with another config (differs in: {', '.join(changed)}); "
            "choose a new --out for this one"
        )
    if not resume and _finished(out_dir, recipe):
        raise ValueError(f"{out_dir} already holds this recipe's finished run: train into a new --out")
    check_writable(out_dir, folder=True)
    found = checkpoints(out_dir)
    return True, found[-1] if found else None


def _finished(out_dir: Path, recipe: Recipe) -> bool:
    """Whether ``out_dir`` holds its run's final model (published weights; the arithmetic task's
    evaluation too), as opposed to a run that stopped before the end."""
    weights = any((out_dir / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    return weights and (recipe.task != "arithmetic" or (out_dir / "arithmetic_eval.json").is_file())


# ---------------------------------------------------------------------------------------------
# the loop


def accelerator_for(recipe: Recipe, **tracking: Any):
    """The ``accelerate.Accelerator`` of a recipe: its mixed precision ("auto": bf16 where supported) and
    compile; ``tracking``: the trackers' arguments (:func:`tracker_options`). FSDP is not accelerate's
    (its plugin shards only on GPUs): :func:`shard` applies it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin

    # accelerate keeps one state per process: a second run in it would be refused another mixed precision
    # and would silently keep the first run's compile setting. Each run starts its own (the process
    # group, PartialState's, is kept).
    AcceleratorState._reset_state()
    precision = recipe.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    dynamo = TorchDynamoPlugin(backend="inductor") if recipe.compile else None
    # cpu=True is what makes accelerate join a torchrun/accelerate-launch group over gloo without GPUs
    accelerator = Accelerator(
        mixed_precision=precision,
        dynamo_plugin=dynamo,
        cpu=not torch.cuda.is_available(),
        **tracking,
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise RuntimeError(f"launched {launched} processes but accelerate joined {accelerator.num_processes}")
    return accelerator


def shard(model, mesh):
    """``model`` sharded over ``mesh``'s processes with FSDP2 (``fully_shard``, in place): each
    decoder layer a unit whose parameters are gathered for its forward and again for its backward, the
    rest (embeddings, final norm, head) the root's. LIMe's K/V buffer keeps copies of the router
    weights that earlier layers' backward reads (:func:`lime_model.kv_buffer._own_copy`). ``mesh``: a
    1-D device mesh (``init_device_mesh(device.type, (world,))``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in [m for m in model.modules() if isinstance(m, LimeDecoderLayer)]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _prepare(accelerator, model, optimizer):
    """The model and optimizer through accelerate; a sharded model only gets its mixed precision
    (autocast, as under DDP): accelerate would wrap it in DDP."""
    if not _sharded(model):
        return accelerator.prepare(model, optimizer)
    return accelerator.prepare_model(model, evaluation_mode=True), accelerator.prepare_optimizer(optimizer)


@contextmanager
def _no_sync(accelerator, model):
    """No gradient synchronisation inside (a micro-batch that is not the last): DDP's ``no_sync``, or
    FSDP2's switch, which accelerate's ``no_sync`` sets only on models it sharded itself."""
    if not _sharded(model):
        with accelerator.no_sync(model):
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


REPORT_TO = ("none", "tensorboard", "wandb")
TRACKER_PROJECT = "lime-model"  # the W&B project; TensorBoard's events go to RUN/tensorboard/lime-model/


def tracker_options(report_to: str, out_dir: Path) -> dict[str, Any]:
    """``Accelerator`` arguments that log to ``report_to`` (one of :data:`REPORT_TO`). A tracker whose
    package is missing is refused here: accelerate would silently skip it."""
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to must be one of {', '.join(REPORT_TO)}, got {report_to!r}")
    if report_to == "none":
        return {}
    from accelerate.utils import is_tensorboard_available, is_wandb_available

    if not {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}[report_to]():
        extra = "pip install 'lime-probe[tracking]'" if report_to == "tensorboard" else "pip install wandb"
        raise ValueError(f"--report-to {report_to} needs the {report_to} package: {extra}")
    return {"log_with": report_to, "project_dir": str(out_dir / "tensorboard")}


def _hparams(recipe: Recipe) -> dict[str, Any]:
    """The recipe flattened to dotted keys and scalar values, as trackers take hyperparameters."""

    def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
        return out

    return flat(recipe.to_dict())


def micro_batch_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, n_targets: int) -> torch.Tensor:
    """One micro-batch's share of the step's loss: its summed token loss (``input_ids``/``labels``
    ``(micro, seq_len)``) over the number of target tokens in the global batch (a scalar tensor)."""
    return token_loss_sum(model(input_ids=input_ids, use_cache=False).logits, labels) / n_targets


def build_optimizer(model, recipe: Recipe, foreach: bool | None = None) -> torch.optim.AdamW:
    """The recipe's AdamW over :func:`~lime_model.optim.param_groups` (``foreach``: torch's own choice
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
        with nullcontext() if m + micro >= per_rank else _no_sync(accelerator, model):
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
        recipe: a shipped recipe name, a JSON path, or a dict (see :mod:`lime_model.recipes`).
        out_dir: the run directory: absent or empty for a new run; a folder holding an unfinished run
            of the same recipe is continued from its last checkpoint (see :func:`_check_out_dir`).
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
    out_dir = Path(out_dir)
    accelerator = accelerator_for(recipe, **tracker_options(report_to, out_dir))
    world, main = accelerator.num_processes, accelerator.is_main_process
    if recipe.batch_size % (world * recipe.micro_batch_size):
        raise ValueError(
            f"batch_size {recipe.batch_size} is not a multiple of {world} processes x "
            f"micro_batch_size {recipe.micro_batch_size}"
        )
    resume, ckpt = _check_out_dir(out_dir, recipe, resume)
    if resume:  # half of a run's steps on another code path would be neither mode's result
        reproducible.check_same_mode(out_dir, reproducible.active())
    saved_tokenizer = resume and (out_dir / "tokenizer_config.json").exists()
    tokenizer = load_tokenizer(str(out_dir)) if saved_tokenizer else None
    try:  # several processes only read the caches: rank 0 tokenising behind a barrier times out at scale
        data = prepare_data(recipe, tokenizer, progress=progress and main, build=world == 1)
    except data_mod.NotPrepared as e:
        raise FileNotFoundError(
            f"{e}: a run on {world} processes does not tokenise; run `lime-model prepare` with the same "
            "--recipe, --data, --eval-data, --steps and --set first"
        ) from None
    config = model_config(recipe, data.tokenizer)
    accelerator.wait_for_everyone()  # every rank validated the output dir before rank 0 writes to it

    if main and resume:
        where = f"step {int(ckpt.name[5:])}" if ckpt is not None else "the start (no checkpoint yet)"
        print(f"lime-model: continuing the run in {out_dir} from {where}", file=sys.stderr)
        atomic_write(out_dir / "recipe.json", json.dumps(recipe.to_dict(), indent=1))
        if not saved_tokenizer:
            data.tokenizer.save_pretrained(out_dir)
        _record_run_info(out_dir, accelerator)
    elif main:  # a new run's folder appears whole: recipe, tokenizer (read back on resume), run info
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(out_dir) as tmp:
            atomic_write(tmp / "recipe.json", json.dumps(recipe.to_dict(), indent=1))
            data.tokenizer.save_pretrained(tmp)
            _record_run_info(tmp, accelerator)
    accelerator.init_trackers(  # main process only; after the run folder exists
        TRACKER_PROJECT, _hparams(recipe), init_kwargs={"wandb": {"name": out_dir.name, "dir": str(out_dir)}}
    )
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(config)  # the arch's class (registered by lime_model)
    if ckpt is not None:
        _load_weights(ckpt, model)
    model.train()
    if recipe.fsdp and world > 1:  # before the optimizer: sharding replaces the parameters
        from torch.distributed.device_mesh import init_device_mesh

        model = shard(model, init_device_mesh(accelerator.device.type, (world,)))
    steps = total_steps(recipe, len(data.input_ids))
    optimizer = build_optimizer(model, recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe, steps))
    model, optimizer = _prepare(accelerator, model, optimizer)
    start, tokens = (
        (0, 0) if ckpt is None else _load_training_state(ckpt, accelerator, model, optimizer, scheduler)
    )

    metrics_path = out_dir / "metrics.jsonl"
    if main and resume:  # drop lines logged after the checkpoint by an interrupted run
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        atomic_write(metrics_path, "".join(f"{ln}\n" for ln in lines if _logged_step(ln) <= start))
    seq_flops = 3 * forward_flops(config, recipe.seq_len)
    last = steps if stop_after is None else min(steps, stop_after)
    bar = tqdm(total=last, initial=start, desc="train", disable=not (progress and main), unit="step")
    window_t, window_tokens = time.perf_counter(), 0
    has_eval = data.eval_input_ids is not None and len(data.eval_input_ids) > 0
    for step in range(start, last):
        if main and second_epoch_starts(step, recipe.batch_size, len(data.input_ids)):
            warn_second_epoch(step, recipe, len(data.input_ids))
        loss, grad_norm, lr = train_step(accelerator, model, optimizer, scheduler, data, recipe, step)
        batch_tokens = data.n_tokens(batch_indices(step, recipe.batch_size, len(data.input_ids), recipe.seed))
        tokens += batch_tokens
        window_tokens += batch_tokens
        done = step + 1
        evaluate_now = has_eval and (done == last or (recipe.eval_every and done % recipe.eval_every == 0))
        if done % recipe.log_every == 0 or done == last or evaluate_now:
            loss_value = accelerator.reduce(loss, reduction="sum").item()
            # every process evaluates every held-out row (FSDP needs all ranks in each forward)
            held_out = _held_out(model, data, recipe) if evaluate_now else {}
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
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                accelerator.log({k: v for k, v in record.items() if k != "step"}, step=done)
                bar.set_postfix(loss=f"{loss_value:.4f}")
                window_t, window_tokens = now, 0
        bar.update(1)
        if done % recipe.save_every == 0 or done == last:
            _save_checkpoint(
                accelerator, model, optimizer, scheduler, data.tokenizer, recipe, done, tokens, out_dir
            )
    bar.close()
    if main and last == steps:
        _publish_final(out_dir, checkpoints(out_dir)[-1])
        if recipe.task == "arithmetic":  # from the published files: sharded or not, one whole model
            evaluate_arithmetic(out_dir, progress=progress, device=accelerator.device)
        write_model_card(out_dir)
    accelerator.wait_for_everyone()
    # DDP's reducer must not outlive the process group: as its last owner it would destroy the gloo group
    # holding the GIL, while a gloo thread waits for the GIL to free the barrier's work (a hang at exit,
    # pytorch/pytorch#56297). Released first, the group is freed by end_training without the GIL.
    model, optimizer, scheduler = accelerator.free_memory(model, optimizer, scheduler)
    accelerator.end_training()
    return out_dir


def _logged_step(line: str) -> float:
    """The step of a ``metrics.jsonl`` line; infinity for a line a killed process cut short."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


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


def run_info(accelerator) -> dict[str, Any]:
    """What else decides a run's numbers: versions, device, threads and determinism settings."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(accelerator.device),
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "processes": accelerator.num_processes,
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "mixed_precision": accelerator.mixed_precision,
        "reproducible": reproducible.settings(),
    }


def _record_run_info(out_dir: Path, accelerator) -> None:
    """Append this invocation's :func:`run_info` to ``run_info.json`` (a list: one entry per start)."""
    path = out_dir / "run_info.json"
    runs = json.loads(path.read_text()) if path.is_file() else []
    atomic_write(path, json.dumps([*runs, run_info(accelerator)], indent=1))


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
