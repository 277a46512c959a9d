"""Downstream benchmarks of any checkpoint through lm-evaluation-harness (``lime-model eval-downstream``).

The scoring is lm-eval's own: its Hugging Face wrapper (``HFLM``) loads the checkpoint through the
Auto classes (importing this package registers ours first) and its tasks compute the metrics.
This module only resolves task names, checks its inputs before the model is loaded, and writes
lm-eval's results with our run information next to the run, all or nothing.

lm-eval is an optional dependency: ``pip install 'lime-probe[eval]'``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .checks import check_device, check_model_dir, one_line
from .files import atomic_write, check_writable


@dataclass(frozen=True)
class Preset:
    """A named task list for ``--tasks``: lm-eval task names, few-shot count, and where it comes from."""

    tasks: tuple[str, ...]
    num_fewshot: int | None  # None: each task's lm-eval default
    source: str


# BIG-bench tasks as lm-eval's multiple-choice variants (ours: the paper names no variant; its Table 9
# gives random baselines, 50 % for KV and Induction, which a choice among given answers has and free
# generation has not). lm-eval's BIG-bench data have no training split: it draws the 3 shots from the
# test split, never the document itself.
_BIGBENCH = "bigbench_{}_multiple_choice"
_TABLE1 = ("multirc", "wic", "qnli", "arc_easy", "arc_challenge") + tuple(
    _BIGBENCH.format(t) for t in ("key_value_maps", "mathematical_induction")
)
PRESETS: dict[str, Preset] = {
    "paper": Preset(
        _TABLE1,
        3,
        "the paper's Table 1 (Sec. 5.1): MultiRC, WiC, QNLI, ARC-E, ARC-C, BIG-bench Key-Value Maps and "
        "Mathematical Induction, 3-shot",
    ),
    "paper-appendix": Preset(
        ("copa", "multirc", "wic", "qnli", "wnli", "arc_easy", "arc_challenge", "hellaswag", "openbookqa")
        + _TABLE1[5:]
        + tuple(_BIGBENCH.format(t) for t in ("implicit_relations", "reasoning_about_colored_objects")),
        3,
        "the paper's App. C, Tables 7-9 (Table 1's tasks plus COPA, WNLI, HellaSwag, OpenBookQA, BIG-bench "
        "Implicit Relations and Reasoning About Colored Objects), 3-shot",
    ),
    "official-readme": Preset(
        ("arc_easy", "arc_challenge", "winogrande", "copa", "multirc", "rte", "hellaswag", "piqa"),
        None,
        "the 1.2B table of one version of the official README (no shot count stated: each task's "
        "lm-eval default, 0); this command's default before the paper preset",
    ),
}
DEFAULT_PRESET = "paper"

_OFFLINE_HINT = (
    "without network, lm-eval's hub tasks cannot download their data: "
    "use --include-path DIR with local task YAMLs (dataset_path: json)"
)


def _lm_eval():
    try:
        import lm_eval
    except ImportError as e:
        raise ValueError(
            f"lm-eval is not installed ({e}): pip install 'lime-probe[eval]' or 'lm-eval>=0.4,<0.5'"
        ) from None
    return lm_eval


# Our own local tasks (``agreement_demo``: runs offline), always indexed besides lm-eval's.
TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")


@cache
def _task_manager(include_path: tuple[str, ...], include_defaults: bool):
    """lm-eval's task index, built once per process (its ~15,000 built-in YAML files take seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_path), include_defaults=include_defaults)


def resolve_tasks(tasks: list[str], include_path: str | os.PathLike | None = None):
    """The lm-eval ``TaskManager`` that knows every name in ``tasks``.

    Searched: ``include_path``, our `TASKS_DIR`, then lm-eval's built-in tasks, which are
    indexed only when a name is not found in the first two (lm-eval, too, lets included folders
    take precedence). Raises ``ValueError`` naming the unknown tasks.
    """
    _lm_eval()
    folders = [str(TASKS_DIR)]
    if include_path is not None:
        include_path = Path(include_path).resolve()
        if not include_path.is_dir():
            raise FileNotFoundError(f"--include-path {include_path} is not a folder")
        folders.append(str(include_path))
    local = _task_manager(tuple(folders), False)
    if all(t in local.all_tasks for t in tasks):
        return local
    manager = _task_manager(tuple(folders), True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else " (local task YAMLs: --include-path DIR)"
        raise ValueError(f"unknown lm-eval task(s) {', '.join(unknown)}: not among lm-eval's tasks{where}")
    return manager


def build_tasks(tasks: list[str], manager) -> list:
    """lm-eval's Task and Group objects for ``tasks``, their data loaded (downloaded for hub tasks).

    Raises ``ValueError`` naming the first task whose data could not be loaded (offline, most often).
    """
    built = []
    for name in tasks:
        try:
            loaded = manager.load([name])
        except Exception as e:
            raise ValueError(
                f"could not load the data of task {name} ({one_line(e)}); {_OFFLINE_HINT}"
            ) from None
        # a group is passed whole (lm-eval aggregates it); a tag stands for its tasks
        built += [loaded["groups"][name]] if name in loaded["groups"] else list(loaded["tasks"].values())
    return built


def expand_tasks(tasks: str | list[str] | tuple[str, ...]) -> tuple[list[str], str | None]:
    """Task names and the name of the preset they came from (or None): a preset name (`PRESETS`) stands for its tasks;
    a comma-separated string or a list gives task names as they are.

    Raises ``ValueError`` for an empty list or a preset name mixed with other names.
    """
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    names = [t for t in names if t]
    if not names:
        raise ValueError("no tasks given")
    if len(names) == 1 and names[0] in PRESETS:
        return list(PRESETS[names[0]].tasks), names[0]
    mixed = [t for t in names if t in PRESETS]
    if mixed:
        raise ValueError(f"preset {mixed[0]} cannot be combined with other tasks: give it alone")
    return names, None


def output_path(
    folder: str | os.PathLike, tasks: list[str] | str, num_fewshot: int | None, limit: int | None
) -> Path:
    """``FOLDER/<preset or task+task...>[.Nshot][.limitN].json``: runs with other settings keep their
    files."""
    name = tasks if isinstance(tasks, str) else "+".join(tasks)
    if num_fewshot is not None:
        name += f".{num_fewshot}shot"
    if limit is not None:
        name += f".limit{limit}"
    return Path(folder) / f"{name}.json"


def evaluate_downstream(
    ckpt: str | os.PathLike,
    tasks: str | list[str] | tuple[str, ...] = DEFAULT_PRESET,
    *,
    num_fewshot: int | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    include_path: str | os.PathLike | None = None,
    seed: int | None = None,
    out: str | os.PathLike | None = None,
) -> tuple[dict, Path]:
    """Run lm-eval's ``tasks`` on the model in ``ckpt`` and write the results as JSON.

    Args:
        ckpt: a model directory with its tokenizer (a run directory or one of its
            ``checkpoints/step-N``), of any architecture the Auto classes load.
        tasks: a preset name (`PRESETS`; default ``paper``, Table 1's tasks at 3 shots), or
            lm-eval task, group or tag names (or ours in `TASKS_DIR`), as a list or one
            comma-separated string.
        num_fewshot: few-shot examples per prompt; default the preset's, else each task's own.
        limit: score only the first ``limit`` documents of each task (for quick checks).
        batch_size: requests per forward pass.
        device: torch device of the model (``cpu``, ``cuda``, ``cuda:1``, ``mps``).
        include_path: a folder of extra task YAMLs (local data: ``dataset_path: json``).
        seed: lm-eval's Python, numpy, torch and few-shot sampling seeds; default lm-eval's (0/1234).
        out: the folder of the JSON file (`output_path`); default ``CKPT/downstream``.

    Returns:
        ``(report, path)``: ``report`` is lm-eval's results dict (``results``, ``versions``,
        ``n-shot``, ``n-samples``, ``config``, ...) plus ``run_info``; ``path`` where it was written.
    """
    lm_eval = _lm_eval()
    tasks, preset = expand_tasks(tasks)
    if preset is not None and num_fewshot is None:
        num_fewshot = PRESETS[preset].num_fewshot
    ckpt = Path(ckpt)
    _check_settings(ckpt, limit, batch_size, num_fewshot, device)
    path = output_path(ckpt / "downstream" if out is None else out, preset or tasks, num_fewshot, limit)
    check_writable(path, option="--out")  # before hours of evaluation

    manager = resolve_tasks(tasks, include_path)
    built = build_tasks(tasks, manager)
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(ckpt), backend="causal", device=device, batch_size=batch_size, dtype="auto")
    seeds = {}
    if seed is not None:
        seeds = dict.fromkeys(
            ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seed
        )
    report = lm_eval.simple_evaluate(
        model=model,
        tasks=built,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
        **seeds,
    )
    report["run_info"] = {
        "checkpoint": str(ckpt),
        "preset": preset,
        "tasks": tasks,
        "include_path": None if include_path is None else str(include_path),
        **_run_settings(report, lm_eval.__version__, device, batch_size, num_fewshot, limit),
    }
    _write_report(report, path)
    return report, path


def _check_settings(
    ckpt: Path, limit: int | None, batch_size: int, num_fewshot: int | None, device: str
) -> None:
    """ValueError (or the model directory's error) naming the first setting lm-eval would fail on."""
    check_model_dir(ckpt)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    check_device(device)


def _run_settings(
    report: dict,
    lm_eval_version: str,
    device: str,
    batch_size: int,
    num_fewshot: int | None,
    limit: int | None,
) -> dict:
    """The versions, threads, settings and seeds (as lm-eval's ``config`` records them) of a finished run."""
    import torch

    config = report.get("config", {})
    return {
        "lm_eval_version": lm_eval_version,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device,
        "batch_size": batch_size,
        "num_fewshot": num_fewshot,
        "limit": limit,
        "seed": {k: config.get(k) for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")},
    }


def _write_report(report: dict, path: Path) -> None:
    """``report`` as JSON at ``path``, written whole or not at all (lm-eval's objects as it serialises them)."""
    from lm_eval.utils import handle_non_serializable

    text = json.dumps(report, indent=1, default=handle_non_serializable)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
