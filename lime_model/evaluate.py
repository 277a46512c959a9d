"""Held-out loss and perplexity: during training (``eval_every``) and of any checkpoint (``lime-model eval``).

Text is cut into fixed windows exactly as training packs it (``lime_model.data.pack``): the
documents, each followed by eos, are concatenated and split into non-overlapping windows of
``window`` tokens, the incomplete tail dropped. Every token of a window but the first is predicted
from the tokens before it in the same window, so the windows, and with them the perplexity, are the
same for every checkpoint that shares a tokenizer. Perplexity is ``exp`` of the mean token NLL.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from . import data as data_mod
from .checks import check_causal_lm, check_device, check_model_dir, check_window, quiet_library
from .files import atomic_write, check_writable
from .tokenization import check_embedding, load_tokenizer


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) of logits (B, T, V) against labels (B, T), -100 ignored."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 8) -> tuple[float, int]:
    """Summed next-token NLL (fp32) over rows and the number of predicted tokens.

    ``input_ids`` and ``labels`` are ``(N, T)``; label ``-100`` marks positions without a target. The
    model runs in eval mode on its own device; its previous mode is restored.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for start in range(0, len(input_ids), batch_size):
            ids = input_ids[start : start + batch_size].to(device, torch.long)
            lab = labels[start : start + batch_size].to(device, torch.long)
            logits = model(input_ids=ids, use_cache=False).logits
            total += float(token_loss_sum(logits, lab))
            count += int((lab[:, 1:] != -100).sum())
    finally:
        model.train(was_training)
    return total, count


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$LIME_MODEL_CACHE``, else ``~/.cache/lime_model``."""
    return Path(cache_dir or os.environ.get("LIME_MODEL_CACHE") or Path.home() / ".cache" / "lime_model")


def perplexity(
    ckpt: str | os.PathLike,
    data: str,
    window: int | None = None,
    *,
    split: str | None = None,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    out: str | os.PathLike | None = None,
) -> dict:
    """Perplexity of the model in ``ckpt`` (an HF directory with its tokenizer) on the text ``data``.

    Args:
        ckpt: a finished run directory or one of its ``checkpoints/step-N``.
        data: a data spec (see ``lime_model.data``).
        window: tokens per window, 2 to the model's ``max_position_embeddings``; default that (the
            training ``seq_len`` of a ``lime-model`` run).
        device: where the model runs (``cpu``, ``cuda``, ``cuda:1``, ``mps``).
        out: also write the result there as JSON.

    Returns:
        ``{"checkpoint", "data", "window", "windows", "tokens", "loss", "perplexity"}`` with ``tokens``
        the number of predicted tokens and ``loss`` their mean NLL (nats).

    The checkpoint's files, the data source, ``device``, ``out`` and ``window`` are checked before the
    weights are loaded, the tokenizer against the model's embedding after (ValueError, FileNotFoundError or
    PermissionError naming the problem).
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # any of lime_model's registered archs

    ckpt = Path(ckpt)
    check_model_dir(ckpt)
    device = check_device(device)
    if out is not None:
        check_writable(out)
    source = data_mod.TextSource(data, split)
    source.key()  # a missing or unreadable data source fails here, before the model is loaded
    with quiet_library():  # transformers' load report would bury the one line that matters
        config = AutoConfig.from_pretrained(ckpt)
        check_causal_lm(config, str(ckpt))  # first: a BERT loads "fine" with its weights MISSING
        check_window(window, config, str(ckpt), minimum=2)  # a window predicts from its first token on
        # read straight onto the device: no copy of the weights in host memory on the way to a GPU
        model = AutoModelForCausalLM.from_pretrained(ckpt, config=config, device_map=str(device))
    tokenizer = load_tokenizer(str(ckpt))
    check_embedding(tokenizer, model, str(ckpt))
    if window is None:
        window = model.config.max_position_embeddings
    rows = torch.from_numpy(data_mod.packed_sequences(source, tokenizer, window, default_cache_dir()))
    total, count = token_nll(model, rows, rows, batch_size)
    result = {
        "checkpoint": str(ckpt),
        "data": data,
        "window": window,
        "windows": len(rows),
        "tokens": count,
        "loss": total / count,
        "perplexity": math.exp(total / count),
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(out), json.dumps(result, indent=1))
    return result
