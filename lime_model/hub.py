"""A run folder's model card, ``README.md``: what a reader on the Hugging Face Hub needs to know.

The folder itself is hub-ready without it: ``save_pretrained`` writes the model's source files and an
``auto_map`` (see `lime_model.modeling.register_auto`), so stock ``transformers`` loads it with
``trust_remote_code=True``. The card is built from the run's own files only (``recipe.json``,
``config.json``, ``metrics.jsonl``, ``arithmetic_eval.json``), so it can be rewritten for any finished run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .files import atomic_write

CARD = "README.md"
if TYPE_CHECKING:
    from huggingface_hub import ModelCard, ModelCardData

LICENSE = "apache-2.0"  # the card's license: that of the model code saved with the weights (pyproject.toml)


def _final_metrics(run_dir: Path) -> dict[str, Any]:
    """The last logged line of ``metrics.jsonl`` plus the last held-out evaluation, if any."""
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    if not lines:
        return {}
    final = dict(lines[-1])
    evaluated = [ln for ln in lines if "val_loss" in ln]
    if evaluated and "val_loss" not in final:
        final.update(
            {k: evaluated[-1][k] for k in ("val_loss", "val_perplexity")}, val_step=evaluated[-1]["step"]
        )
    return final


def _n_parameters(run_dir: Path) -> int | None:
    """Stored parameters of the final model (a tied head is stored, and counted, once), from the shapes
    in the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    files = sorted(run_dir.glob("model*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with safe_open(path, framework="numpy") as f:  # a shape needs no torch
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118  not iterable
    return total


def _mode_line(run_dir: Path) -> str:
    """The run's reproducible mode (`lime_model.reproducible`) as its last start recorded it; on only
    when every start ran in it."""
    from .reproducible import describe, run_mode

    path = run_dir / "run_info.json"
    starts = json.loads(path.read_text()) if path.is_file() else []
    if not starts or "reproducible" not in starts[-1]:
        return "reproducible mode: off (not recorded: trained before the mode existed)"
    return describe({**starts[-1]["reproducible"], "reproducible": run_mode(run_dir)})


def model_card(run_dir: str | os.PathLike) -> ModelCard:
    """The model card of the finished run in ``run_dir``: Markdown after the Hub's metadata (library,
    pipeline, license, tags, the hub dataset trained on), as ``huggingface_hub`` writes and reads it."""
    from huggingface_hub import ModelCard

    run_dir = Path(run_dir)
    recipe = json.loads((run_dir / "recipe.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    metrics = _final_metrics(run_dir)
    where = run_dir.resolve()  # a path that loads from any folder; the bare name loads only beside it
    data = recipe["data"] or ("generated arithmetic expressions" if recipe["task"] == "arithmetic" else "")
    out = [f"# {where.name}", ""]
    if recipe["description"]:  # written for the recipe's own sizes, which --set may have changed
        out += [
            f"The recipe's description, as written: {recipe['description']} (The sections below "
            "state what was trained.)",
            "",
        ]
    out += _model_lines(run_dir, config)
    out += _training_lines(run_dir, recipe, metrics, data)
    out += _results_lines(run_dir, metrics)
    out += _use_lines(where)
    return ModelCard(f"---\n{_metadata(config, data).to_yaml()}\n---\n\n" + "\n".join(out))


def _metadata(config: dict[str, Any], data: str) -> ModelCardData:
    """The card's Hub metadata: library, pipeline, license, tags, and the hub dataset trained on."""
    from huggingface_hub import ModelCardData

    arch, routing = config["model_type"], config.get("routing", "none")
    return ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=LICENSE,
        tags=["lime-model", arch, "custom_code"] + ([f"routing-{routing}"] if arch == "lime" else []),
        datasets=[data[3:].split(":")[0]] if data.startswith("hf:") else None,
    )


def _model_lines(run_dir: Path, config: dict[str, Any]) -> list[str]:
    """The card's first sentence (the kind of model and its parameter count) and its Model section."""
    arch, routing = config["model_type"], config.get("routing", "none")
    kind = arch if arch != "lime" else "LIMe" if routing != "none" else "LLaMA (LIMe, routing none)"
    n_params = _n_parameters(run_dir)
    return [
        f"A {kind} decoder trained with `lime-model train`"
        + (f" ({n_params:,} parameters)." if n_params is not None else "."),
        "",
        "## Model",
        "",
        f"- architecture: `{arch}`" + (f", routing `{routing}`" if arch == "lime" else ""),
        f"- layers {config['num_hidden_layers']}, hidden size {config['hidden_size']}, MLP size "
        f"{config['intermediate_size']}, attention heads {config['num_attention_heads']} "
        f"(K/V heads {config['num_key_value_heads']}), vocabulary {config['vocab_size']}, "
        f"context {config['max_position_embeddings']}",
        "",
    ]


def _training_lines(run_dir: Path, recipe: dict[str, Any], metrics: dict[str, Any], data: str) -> list[str]:
    """The card's Training section: task and data, tokenizer, steps, optimiser, where the rest is."""
    return [
        "## Training",
        "",
        f"- task `{recipe['task']}`"
        + (f", data `{data}`" if data else "")
        + (f", split `{recipe['split']}`" if recipe["split"] else "")
        + (f", at most {recipe['max_texts']:,} texts" if recipe["max_texts"] else ""),
        "- tokenizer "
        + (
            f"`{recipe['tokenizer']}`" if recipe["tokenizer"] else "trained by the run (saved in this folder)"
        ),
        f"- {metrics.get('step', recipe['steps'])} steps of {recipe['batch_size']} sequences of "
        f"{recipe['seq_len']} tokens"
        + (f", {metrics['tokens']:,} tokens seen" if "tokens" in metrics else ""),
        f"- AdamW, lr {recipe['lr']} ({recipe['schedule']} to {recipe['min_lr']} after "
        f"{recipe['warmup_steps']} warm-up steps), weight decay {recipe['weight_decay']}, seed {recipe['seed']}",
        "- the full recipe: `recipe.json`; every logged step: `metrics.jsonl`",
        f"- {_mode_line(run_dir)}; each start's versions and settings: `run_info.json`",
        "",
    ]


def _results_lines(run_dir: Path, metrics: dict[str, Any]) -> list[str]:
    """The card's Results section: the final training and held-out losses, the arithmetic accuracy."""
    out = ["## Results", ""]
    if metrics:
        out.append(f"- final training loss {metrics['loss']:.4f} (step {metrics['step']})")
        if "val_loss" in metrics:
            at = metrics.get("val_step", metrics["step"])
            out.append(
                f"- held-out loss {metrics['val_loss']:.4f}, perplexity {metrics['val_perplexity']:.2f} (step {at})"
            )
    arithmetic = run_dir / "arithmetic_eval.json"
    if arithmetic.is_file():
        acc = json.loads(arithmetic.read_text())["accuracy"]
        out.append(
            "- arithmetic accuracy by operator count: " + ", ".join(f"{k}: {v:.3f}" for k, v in acc.items())
        )
    if not metrics and not arithmetic.is_file():
        out.append("- no metrics were logged")
    return out


def _use_lines(where: Path) -> list[str]:
    """The card's Use section: loading the folder at `where` with stock ``transformers``, and lm_eval."""
    return [
        "",
        "## Use",
        "",
        "With stock `transformers` (this folder holds the model's code; `lime_model` need not be installed), "
        "from the folder's path where it was written (its hub id once uploaded):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)',
        f'tokenizer = PreTrainedTokenizerFast.from_pretrained("{where}")',
        "```",
        "",
        "The tokenizer runs no code of this folder, so it loads without `trust_remote_code` (`AutoTokenizer` "
        "would read `config.json` to find it and ask about the model's code). With `lime_model` installed, "
        "`import lime_model` registers the architecture and the model loads without `trust_remote_code` too. "
        "Benchmarks with lm-evaluation-harness:",
        "",
        "```",
        f"lm_eval --model hf --model_args pretrained={where},trust_remote_code=True --tasks TASKS",
        "```",
        "",
        f"License: {LICENSE}, the license of the model's code in this folder (`lime-model`'s).",
        "",
    ]


def write_model_card(run_dir: str | os.PathLike) -> Path:
    """Write (atomically) ``run_dir/README.md``, `model_card`; returns its path."""
    path = Path(run_dir) / CARD
    atomic_write(path, str(model_card(run_dir)))
    return path
