"""Load any supported checkpoint (local directory or hub id) as an nnsight model plus its tokenizer."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .adapters import get_adapter

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def one_line(error: BaseException) -> str:
    """``error`` as one line: its first line of text (a KeyError's key unquoted), or its type name."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    lines = text.strip().splitlines()
    return " ".join(lines[0].split()) if lines else type(error).__name__


def _one(error: BaseException) -> str:
    return f"{type(error).__name__}: {one_line(error)}"


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}, not {dtype!r}")
    return _DTYPES[dtype]


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _is_hub_id(ckpt: str) -> bool:
    """Whether `ckpt` reads as a hub id ("name" or "owner/name") and is no existing local path."""
    return bool(HUB_ID.match(ckpt)) and not Path(ckpt).expanduser().exists()


@contextmanager
def _quiet_hub() -> Iterator[None]:
    """huggingface_hub and transformers log errors only (no retry chatter) inside the block."""
    import transformers
    from huggingface_hub.utils import logging as hub_logging

    before = hub_logging.get_verbosity(), transformers.logging.get_verbosity()
    hub_logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        hub_logging.set_verbosity(before[0])
        transformers.logging.set_verbosity(before[1])


def _hub_offline(repo_id: str) -> bool:
    """Whether hub model `repo_id` must be read from the local hub cache (True) or can be downloaded (False).

    The hub is asked once, without retries, so an offline machine fails at once; FileNotFoundError
    naming both readings of `repo_id` when it is neither reachable nor cached.
    """
    from huggingface_hub import constants, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    with _quiet_hub():
        problem = "HF_HUB_OFFLINE is set"
        if not constants.is_offline_mode():
            try:
                response = get_session().head(
                    hf_hub_url(repo_id, "config.json"),
                    headers=build_hf_headers(),
                    follow_redirects=True,
                    timeout=constants.HF_HUB_ETAG_TIMEOUT,
                )
                hf_raise_for_status(response)
                return False
            except Exception as error:  # noqa: BLE001  network and hub errors come in many types
                problem = _one(error)
        try:
            hf_hub_download(repo_id, "config.json", local_files_only=True)
            return True
        except Exception:  # noqa: BLE001  not in the cache either
            raise FileNotFoundError(
                f"no local folder {repo_id!r} and no hub model {repo_id!r} could be reached ({problem})"
            ) from None


def _check_local(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise ValueError(f"not a checkpoint directory: {path} (expected a folder with config.json)")
    if not (path / "config.json").is_file():
        raise ValueError(f"not a checkpoint: {path} has no config.json")


def wrap(model: torch.nn.Module, tokenizer: Any) -> Any:
    """Wrap a loaded Hugging Face `model` for nnsight (a `TransformersModel` sharing `tokenizer`).

    nnsight sets a causal model's tokenizer to left padding; the tokenizer's own padding side is
    kept, since `lime_probe.extract` pads batches itself and is correct for either side.
    """
    from nnsight.modeling.transformers import TransformersModel

    side = tokenizer.padding_side
    with warnings.catch_warnings():  # BERT's `.output` submodules: nnsight renames them, harmlessly
        warnings.filterwarnings("ignore", message=".*has a submodule named 'output'.*")
        # a bare base model (LlamaModel, BertModel) has no task nnsight can infer from a head
        task = "feature-extraction" if model.base_model is model else None
        wrapped = TransformersModel(model, tokenizer=tokenizer, task=task)
    tokenizer.padding_side = side
    return wrapped


def load(
    ckpt: str | os.PathLike, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None
) -> tuple[Any, Any]:
    """Load a checkpoint for extraction: ``(nnsight model, tokenizer)``.

    Args:
        ckpt: a local checkpoint directory (config.json, weights, tokenizer files), e.g. a run of
            ``lime-model train``, or a Hugging Face hub id such as "EleutherAI/pythia-70m" (needs a
            network). LIMe checkpoints resolve through `lime_model`, imported here.
        device: where the model runs ("cpu", "cuda", "cuda:1", ...).
        dtype: weights dtype (torch.dtype or "float32"/"float16"/"bfloat16"); None keeps the
            checkpoint's default.

    Returns:
        The model wrapped as an nnsight ``TransformersModel`` (the Hugging Face model is its
        ``._module``), in eval mode on `device`, and its tokenizer (pad token defaulting to eos).

    Raises:
        FileNotFoundError: `ckpt` is a path that does not exist, or reads as a hub id but is neither a
            local folder nor a hub model that is cached or reachable (asked once, without retries).
        ValueError: not a checkpoint, unreadable or corrupt weights, no tokenizer, or an
            architecture without an extraction adapter.
    """
    import transformers as tf

    import lime_model  # noqa: F401  (registers the "lime" model type with the Auto classes)

    ckpt = os.fspath(ckpt)
    dtype = _resolve_dtype(dtype)
    hub = _is_hub_id(ckpt)
    # an unreachable hub model that is in the local hub cache is read from there, with no network retries
    cached = {"local_files_only": True} if hub and _hub_offline(ckpt) else {}
    if not hub:
        ckpt = str(Path(ckpt).expanduser())
        _check_local(Path(ckpt))
    where = f"hub checkpoint {ckpt!r}" if hub else f"checkpoint {ckpt}"
    try:
        config = tf.AutoConfig.from_pretrained(ckpt, **cached)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"cannot read the config of {where}: {_one(error)}") from None
    get_adapter(config)  # fail early, naming the supported architectures

    causal = type(config) in tf.MODEL_FOR_CAUSAL_LM_MAPPING
    auto = tf.AutoModelForCausalLM if causal else tf.AutoModelForMaskedLM
    if not causal and type(config) not in tf.MODEL_FOR_MASKED_LM_MAPPING:
        raise ValueError(f"{where} ({config.model_type}) is neither a causal nor a masked language model")
    try:
        model = auto.from_pretrained(ckpt, **cached, **({"dtype": dtype} if dtype is not None else {}))
    except Exception as error:  # noqa: BLE001  corrupt/missing weights surface as many error types
        raise ValueError(f"cannot load the weights of {where}: {_one(error)}") from None
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(ckpt, **cached)
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"cannot load the tokenizer of {where}: {_one(error)}") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device).eval()
    return wrap(model, tokenizer), tokenizer
