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

from lime_probe.extraction.adapters import get_adapter

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# the files a Hugging Face tokenizer is saved as (fast, slow BPE, WordPiece, SentencePiece)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


def _one(error: BaseException) -> str:
    from lime_model.checks import one_line  # imported where used: `import lime_model` registers the models

    return f"{type(error).__name__}: {one_line(error)}"


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}, not {dtype!r}")
    return _DTYPES[dtype]


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _is_hub_id(ckpt: str) -> bool:
    """Whether `ckpt` reads as a hub id ("name" or "owner/name") and is no existing local path.

    "owner/name" whose "owner" is an existing local folder reads as a path (``runs/lime`` where
    ``runs/`` exists): a hub owner never shadows a folder the user has.
    """
    if not HUB_ID.match(ckpt) or Path(ckpt).exists():
        return False
    return "/" not in ckpt or not Path(ckpt.split("/")[0]).is_dir()


@contextmanager
def quiet_library(verbose: bool = False) -> Iterator[None]:
    """Keep transformers/huggingface_hub load chatter off the console inside the block.

    Their loggers report errors only, their progress bars ("Loading weights") are off and Python
    warnings are ignored; everything is restored afterwards. With `verbose` the block changes nothing.
    """
    if verbose:
        yield
        return
    import transformers
    from huggingface_hub.utils import logging as hub_logging

    before = hub_logging.get_verbosity(), transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    hub_logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hub_logging.set_verbosity(before[0])
        transformers.logging.set_verbosity(before[1])
        if bars:
            transformers.utils.logging.enable_progress_bar()


def hub_problem(url: str) -> str | None:
    """Why the hub cannot give `url` ("HF_HUB_OFFLINE is set", or the error of one HEAD request without
    retries, so an offline machine answers at once), or None when it can."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    with quiet_library():
        try:
            response = get_session().head(
                url, headers=build_hf_headers(), follow_redirects=True, timeout=constants.HF_HUB_ETAG_TIMEOUT
            )
            hf_raise_for_status(response)
            return None
        except Exception as error:  # noqa: BLE001  network and hub errors come in many types
            return _one(error)


@contextmanager
def hub_dataset(name: str, what: str, fix: str) -> Iterator[None]:
    """Read hub dataset `name` inside the block, or fail at once in one line (FileNotFoundError: "`what`
    not found locally and the hub is unreachable (why): `fix`") instead of after ``datasets``' retries.

    The hub is asked once first; with HF_HUB_OFFLINE set the block runs (``datasets`` reads its cache) and a
    dataset missing from the cache fails the same way.
    """
    from huggingface_hub import constants

    problem = (
        None if constants.is_offline_mode() else hub_problem(f"{constants.ENDPOINT}/api/datasets/{name}")
    )
    if problem is None:
        try:
            yield
            return
        except ConnectionError as error:  # datasets: "Couldn't reach NAME on the Hub (...)"
            from lime_model.checks import one_line

            problem = one_line(error)
    raise FileNotFoundError(f"{what} not found locally and the hub is unreachable ({problem}): {fix}")


def _hub_offline(repo_id: str) -> bool:
    """Whether hub model `repo_id` must be read from the local hub cache (True) or can be downloaded (False).

    The hub is asked once, without retries, so an offline machine fails at once; FileNotFoundError
    naming both readings of `repo_id` when it is neither reachable nor cached.
    """
    from huggingface_hub import hf_hub_download, hf_hub_url

    problem = hub_problem(hf_hub_url(repo_id, "config.json"))
    if problem is None:
        return False
    with quiet_library():
        try:
            hf_hub_download(repo_id, "config.json", local_files_only=True)
            return True
        except Exception:  # noqa: BLE001  not in the cache either
            raise FileNotFoundError(
                f"checkpoint not found: {repo_id} (no such local folder, and no hub model {repo_id!r} "
                f"is cached or could be reached: {problem})"
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


def is_encoder(config: Any) -> bool:
    """Whether `config` is a BERT-style encoder: a masked-LM architecture not configured as a decoder.

    Its attention is bidirectional, so it has no next-token head to score text with; the probes read
    only its representations, and `load` gives it as the bare base model.
    """
    import transformers as tf

    return type(config) in tf.MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)


def load(
    ckpt: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    *,
    verbose: bool = False,
) -> tuple[Any, Any]:
    """Load a checkpoint for extraction: ``(nnsight model, tokenizer)``.

    Args:
        ckpt: a local checkpoint directory (config.json, weights, tokenizer files), e.g. a run of
            ``lime-model train``, or a Hugging Face hub id such as "EleutherAI/pythia-70m" (needs a
            network). LIMe checkpoints resolve through `lime_model`, imported here.
        device: where the model runs ("cpu", "cuda", "cuda:1", ...).
        dtype: weights dtype (torch.dtype or "float32"/"float16"/"bfloat16"); None keeps the
            checkpoint's default.
        verbose: let transformers' load messages (load reports, warnings, progress bars) through;
            by default they are kept off the console.

    Returns:
        The model wrapped as an nnsight ``TransformersModel`` (the Hugging Face model is its
        ``._module``), in eval mode on `device`, and its tokenizer (pad token defaulting to eos).
        A causal LM comes with its LM head (BLiMP scoring needs it); an encoder (`is_encoder`:
        BERT, RoBERTa, ...) as its base model (``BertModel``), since no probe uses a masked-LM head.

    Raises:
        FileNotFoundError: "checkpoint not found: PATH" when `ckpt` is a path that does not exist
            (including "owner/name" whose "owner" is a local folder), or reads as a hub id but is
            neither a local folder nor a hub model that is cached or reachable (asked once, no retries).
        ValueError: not a checkpoint, unreadable or corrupt weights (a local safetensors file named by
            `lime_model.checks.check_weights`), no tokenizer, an architecture without an extraction
            adapter, or a device this machine lacks (`lime_model.checks.check_device`).
    """
    import transformers as tf

    import lime_model
    from lime_model.checks import check_device, check_weights

    lime_model.register_models()  # the "lime" model types with the Auto classes (a no-op once done)
    ckpt = os.fspath(ckpt)
    dtype = _resolve_dtype(dtype)
    device = check_device(device)
    hub = _is_hub_id(ckpt)
    # an unreachable hub model that is in the local hub cache is read from there, with no network retries
    cached = {"local_files_only": True} if hub and _hub_offline(ckpt) else {}
    if not hub:
        ckpt = str(Path(ckpt).expanduser())
        _check_local(Path(ckpt))
        check_weights(ckpt)  # a corrupt weights file named in milliseconds, not after the config and model
    where = f"hub checkpoint {ckpt!r}" if hub else f"checkpoint {ckpt}"
    with quiet_library(verbose):
        try:
            config = tf.AutoConfig.from_pretrained(ckpt, **cached)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"cannot read the config of {where}: {_one(error)}") from None
        get_adapter(config)  # fail early, naming the supported architectures

        if is_encoder(config):
            auto = tf.AutoModel
        elif type(config) in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
            auto = tf.AutoModelForCausalLM
        else:
            raise ValueError(f"{where} ({config.model_type}) is neither a causal LM nor a BERT-style encoder")
        try:
            model = auto.from_pretrained(ckpt, **cached, **({"dtype": dtype} if dtype is not None else {}))
        except Exception as error:  # noqa: BLE001  corrupt/missing weights surface as many error types
            raise ValueError(f"cannot load the weights of {where}: {_one(error)}") from None
        try:
            tokenizer = tf.AutoTokenizer.from_pretrained(ckpt, **cached)
        except Exception as error:  # noqa: BLE001
            if not hub and not any((Path(ckpt) / name).is_file() for name in TOKENIZER_FILES):
                # transformers' own message here is a multi-line list of backends tried
                raise ValueError(
                    f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                    f"model's tokenizer next to its weights, tokenizer.save_pretrained({ckpt!r})"
                ) from None
            raise ValueError(f"cannot load the tokenizer of {where}: {_one(error)}") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(device).eval()
    return wrap(model, tokenizer), tokenizer
