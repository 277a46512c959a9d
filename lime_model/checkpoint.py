"""A run's checkpoints and its directory: writing them whole, finding the one to continue from, loading it
back; opening the run directory (new or continued) for one writer.

A checkpoint directory ``checkpoints/step-N`` holds the HF model and tokenizer, ``trainer_state.json``
(step, tokens seen, optimizer hyperparameters, scheduler) and ``optimizer.safetensors`` (Adam moments by
parameter name, RNG); nothing in it needs unpickling. It is written under a dot-name, fsynced and renamed
into place when complete, so any ``step-N`` directory is whole (an old one is renamed away before it is
deleted). Sharded (FSDP) runs gather the whole model and optimizer state on the main process, so a
checkpoint has one format whatever the number of processes.

``trainer_state.json`` records the sha256 of every other file of its checkpoint; a continued run takes
the newest checkpoint whose files still match (``resume_point``), and holds the run directory's lock
(``RunLock``) while it writes there, so a second run into the same folder is refused.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import socket
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from . import reproducible
from .checks import one_line, weight_files
from .distributed import on_main, sharded
from .files import atomic_dir, atomic_write, check_writable, naming_disk_full, umask
from .recipes import Recipe, identity

CHECKPOINTS = "checkpoints"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "optimizer.safetensors"
DIGESTS = "sha256"  # trainer_state.json's record of every other file's digest, checked on resume
LOCK = ".lock"  # in the run directory, held by the process that writes it


def checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    return sorted(root.glob("step-*"), key=lambda p: int(p.name[5:])) if root.is_dir() else []


def _full_state_options():
    """Whole tensors, gathered on the CPU of the main process (the others get none): what it saves."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _full_state_dict(accelerator, model) -> dict:
    """The whole model's state dict on the main process (a collective when sharded). The names of a
    tied parameter share one tensor, as in an unsharded model's, so ``save_pretrained`` stores it once."""
    if not sharded(model):
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
    if not sharded(model):
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
    if sharded(model):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer.optimizer, options=_full_state_options())
    state = optimizer.state_dict()
    order = _param_order(accelerator, model, optimizer)
    return {
        "state": {order[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _load_named_optimizer_state(accelerator, model, optimizer, named: dict) -> None:
    if sharded(model):  # every process holds the whole state (it read the files): each keeps its shard
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


def save_checkpoint(
    accelerator, model, optimizer, scheduler, tokenizer, recipe, step: int, tokens: int, out_dir: Path
) -> None:
    """Write ``checkpoints/step-N`` atomically: HF model + tokenizer, optimizer/RNG tensors, JSON state."""
    state_dict = _full_state_dict(accelerator, model)  # collectives under FSDP: every rank calls them
    opt_state = _named_optimizer_state(accelerator, model, optimizer)  # gathered on the main process only

    def write() -> None:
        state = {
            "step": step,
            "tokens": tokens,
            "world_size": accelerator.num_processes,
            "recipe": recipe.identity(),
            "param_groups": opt_state["param_groups"],
            "scheduler": scheduler.state_dict(),
        }
        _write_checkpoint(out_dir, _savable(accelerator, model), state_dict, opt_state, tokenizer, state)
        for old in checkpoints(out_dir)[: -recipe.keep_last]:  # renamed first: never a half-deleted step-N
            gone = old.with_name(f".{old.name}.deleted")
            os.replace(old, gone)
            shutil.rmtree(gone)

    on_main(accelerator, write)


def _write_checkpoint(
    out_dir: Path, savable, state_dict: dict, opt_state: dict, tokenizer, state: dict
) -> None:
    """Main process: ``checkpoints/step-N`` written whole, ``state`` completed by the files' digests."""
    root = out_dir / CHECKPOINTS
    root.mkdir(exist_ok=True)
    for stale in root.glob(".step-*"):  # left by a process killed while writing or deleting one
        shutil.rmtree(stale, ignore_errors=True)
    # the same step saved again (a resumed run) is swapped out whole
    with atomic_dir(root / f"step-{state['step']:08d}") as tmp:
        with _quiet_hf_progress():
            savable.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
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
        digests = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
        (tmp / STATE_JSON).write_text(json.dumps({**state, DIGESTS: digests}, indent=1))


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


def load_weights(ckpt: Path, model, absent: frozenset[str] = frozenset()) -> None:
    """The weights of the checkpoint or model folder ``ckpt`` (``model.safetensors``, or the shards its
    index lists) into the (unwrapped) model; the parameters named in ``absent`` keep their values."""
    state = {name: t for path in weight_files(ckpt) for name, t in load_file(path).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight", *absent}:  # a tied head is stored once
        raise ValueError(f"{ckpt} does not match the model: missing {missing}, unexpected {unexpected}")


def load_training_state(ckpt: Path, accelerator, model, optimizer, scheduler) -> tuple[int, int]:
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


def publish_final(out_dir: Path, ckpt: Path) -> None:
    """Copy the last checkpoint's HF files into ``out_dir`` (each file replaced atomically), the weights
    last: a folder with weights holds the whole final model (see ``_finished``)."""
    for f in sorted(ckpt.iterdir(), key=lambda f: ("safetensors" in f.name, f.suffix == ".json", f.name)):
        if f.name in (STATE_JSON, STATE_TENSORS):
            continue
        with open(f, "rb") as src:
            atomic_write(out_dir / f.name, partial(shutil.copyfileobj, src))


def check_out_dir(out_dir: Path, recipe: Recipe, resume: bool) -> bool:
    """Validate ``out_dir`` before anything is written: whether the run in it is continued.

    An absent or empty folder starts a new run. A folder holding an unfinished run of the same recipe
    (stopped by Ctrl-C, a crash or ``stop_after``) is continued, with or without ``resume``: from its
    last intact checkpoint (``resume_point``), or from the start when it has none. A finished run is
    continued (republished) only with ``resume``; another recipe, another length or a folder of other
    files is refused.
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
        return False
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
    return True


def _finished(out_dir: Path, recipe: Recipe) -> bool:
    """Whether ``out_dir`` holds its run's final model (published weights; the arithmetic task's
    evaluation too), as opposed to a run that stopped before the end."""
    weights = any((out_dir / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    return weights and (recipe.task != "arithmetic" or (out_dir / "arithmetic_eval.json").is_file())


# ---------------------------------------------------------------------------------------------
# integrity: digests checked on resume, one writer per run directory


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(partial(f.read, 1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def damage(ckpt: Path) -> str | None:
    """What makes checkpoint ``ckpt`` unusable, in words that name the file; None when it is intact: its
    ``trainer_state.json`` reads, and every file matches the sha256 recorded there when it was written
    (a checkpoint from before digests were recorded: its safetensors headers match the files' sizes)."""
    state_file = ckpt / STATE_JSON
    try:
        state = json.loads(state_file.read_text())
        missing = {"step", "tokens", "param_groups", "scheduler"} - set(state)
        if missing:
            raise ValueError(f"no {', '.join(sorted(missing))}")
        if not isinstance(state.get(DIGESTS, {}), dict):
            raise ValueError(f"{DIGESTS} is not a table of file names")
    except (OSError, ValueError, TypeError) as e:  # TypeError: JSON that is not an object
        return f"{state_file} is corrupt ({one_line(e)})"
    if DIGESTS not in state:
        for path in (ckpt / "model.safetensors", ckpt / STATE_TENSORS):
            try:
                with safe_open(path, framework="pt"):
                    pass
            except Exception as e:  # noqa: BLE001  safetensors raises its own error types, and OSError
                return f"{path} is corrupt ({one_line(e)})"
        return None
    for name, expected in state[DIGESTS].items():
        path = ckpt / name
        if not path.is_file():
            return f"{path} is missing"
        if _sha256(path) != expected:
            return f"{path} is corrupt (its sha256 differs from the one recorded when it was written)"
    return None


def resume_point(out_dir: Path) -> Path | None:
    """The newest intact checkpoint of ``out_dir`` (``damage``); None when it has none (the run starts
    from step 0). Each newer, damaged one is set aside as ``checkpoints/corrupt-step-N`` with a one-line
    notice that names the damaged file.

    Raises:
        ValueError: checkpoints exist and none is intact (naming the newest's damaged file, and how to
            go on); nothing is moved then.
    """
    found = checkpoints(out_dir)
    damaged: list[tuple[Path, str]] = []
    for ckpt in reversed(found):
        problem = damage(ckpt)
        if problem is None:
            break
        damaged.append((ckpt, problem))
    else:
        if found:
            raise ValueError(
                f"{damaged[0][1]}, and no earlier checkpoint is intact: delete {out_dir / CHECKPOINTS} "
                f"to train {out_dir} again from step 0, or train into a new --out"
            )
        return None
    for bad, problem in damaged:
        aside = bad.with_name(f"corrupt-{bad.name}")
        if aside.exists():  # set aside by an earlier start: the newer copy replaces it
            shutil.rmtree(aside)
        os.replace(bad, aside)
        print(
            f"lime-model: {problem}: continuing from {ckpt.name}, the last intact checkpoint "
            f"({bad.name} set aside as {aside.name})",
            file=sys.stderr,
        )
    return ckpt


class RunLock:
    """This process's hold on a run directory, so that two runs never write one folder: ``fcntl.flock``
    on its lock file, which names the holder (pid and host). The kernel drops the lock when the process
    ends however it ends (killed too), so a lock file left behind never blocks a later run."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def take(self, folder: Path, out_dir: Path) -> None:
        """Lock ``folder``: the run directory ``out_dir``, or the staging folder that becomes it.

        Raises:
            ValueError: another process holds it (naming the holder).
        """
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise in_use(out_dir) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def in_use(out_dir: Path) -> ValueError:
    """The refusal of a second run into ``out_dir``, naming the process that holds it."""
    try:
        holder = (out_dir / LOCK).read_text().strip()
    except (OSError, ValueError):  # gone, or not text
        holder = ""
    return ValueError(
        f"--out {out_dir} is in use by another lime-model train ({holder or 'holder unknown'}): "
        "wait for it to end, or train into another --out"
    )


# ---------------------------------------------------------------------------------------------
# the run directory


def claim(lock: RunLock, out_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to continue from, with the run directory locked (a new run's folder is locked as it
    is made: ``open_run_dir``)."""
    if not resume:
        return None
    lock.take(out_dir, out_dir)
    return resume_point(out_dir)


def open_run_dir(
    lock: RunLock, out_dir: Path, recipe: Recipe, tokenizer, accelerator, ckpt: Path | None
) -> None:
    """Main process: a continued run's (its folder locked by ``claim``) recipe, tokenizer (when it
    has none) and run info; a new run's folder made whole at once, locked, and only where no other run has
    appeared meanwhile."""
    if lock.held:
        where = f"step {int(ckpt.name[5:])}" if ckpt is not None else "the start (no checkpoint yet)"
        print(f"lime-model: continuing the run in {out_dir} from {where}", file=sys.stderr)
        atomic_write(out_dir / "recipe.json", json.dumps(recipe.to_dict(), indent=1))
        if not (out_dir / "tokenizer_config.json").exists():
            with naming_disk_full(out_dir):
                tokenizer.save_pretrained(out_dir)
        record_run_info(out_dir, accelerator)
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        # the recipe, tokenizer (read back on resume) and run info, only where no other run came first
        with atomic_dir(out_dir, replace=False) as tmp:
            lock.take(tmp, out_dir)
            atomic_write(tmp / "recipe.json", json.dumps(recipe.to_dict(), indent=1))
            tokenizer.save_pretrained(tmp)
            record_run_info(tmp, accelerator)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise in_use(out_dir) from None  # another run published its folder there first


def trim_metrics(out_dir: Path, step: int) -> None:
    """Drop the ``metrics.jsonl`` lines logged after ``step`` (by a run stopped after its last checkpoint)."""
    path = out_dir / "metrics.jsonl"
    if path.exists():
        lines = path.read_text().splitlines()
        atomic_write(path, "".join(f"{ln}\n" for ln in lines if _logged_step(ln) <= step))


def _logged_step(line: str) -> float:
    """The step of a ``metrics.jsonl`` line; infinity for a line a killed process cut short."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


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


def record_run_info(out_dir: Path, accelerator) -> None:
    """Append this invocation's ``run_info`` to ``run_info.json`` (a list: one entry per start)."""
    path = out_dir / "run_info.json"
    runs = json.loads(path.read_text()) if path.is_file() else []
    atomic_write(path, json.dumps([*runs, run_info(accelerator)], indent=1))
