"""Load any supported checkpoint (local directory or hub id) as an nnsight model plus its tokenizer."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lime_probe.extraction.adapters import get_adapter

if TYPE_CHECKING:
    from nnsight.modeling.transformers import TransformersModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# "auto": the dtype the checkpoint's config names (torch_dtype), else that of its stored weights
_DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPES = tuple(_DTYPES)
# accelerate's placement strategies (`infer_auto_device_map`): "auto" and "balanced" spread the model
# evenly over the GPUs, "balanced_low_0" keeps GPU 0 light, "sequential" fills them in order; whatever
# does not fit goes to the CPU, then to disk
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
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


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be a torch.dtype or one of {', '.join(DTYPES)}, not {dtype!r}")
    return _DTYPES[dtype]


def device_map_of(spec: str | dict | None) -> str | dict | None:
    """`spec` as a device map for ``from_pretrained``: one of `DEVICE_MAP_STRATEGIES`; a module -> device
    mapping (a dict, or a JSON object given inline or as a ``.json`` file), devices being "cpu", "disk",
    "cuda:1" or a GPU index; or one device for the whole model. ValueError naming what is wrong."""
    from lime_model.checks import check_device

    if spec is None or spec in DEVICE_MAP_STRATEGIES:
        return spec
    if isinstance(spec, str):
        text = spec
        if spec.endswith(".json"):
            path = Path(spec).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"device map file not found: {spec}")
            text = path.read_text()
        if not text.lstrip().startswith("{"):
            try:
                check_device(spec, option="device map")
            except ValueError:
                raise ValueError(
                    f"device map {spec!r} is none of {', '.join(DEVICE_MAP_STRATEGIES)}, a device (cpu, "
                    "cuda:0), or a JSON object of module -> device"
                ) from None
            return spec
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"device map {spec!r} is not valid JSON: {error}") from None
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"a device map is a non-empty module -> device mapping, not {spec!r}")
    for module, device in spec.items():
        if device != "disk":
            check_device(device, option=f"device map entry {module!r}:")
    # "disk" entries last (the order places nothing): transformers' pipeline, which nnsight builds, takes the
    # device of the map's first entry as its own, and "disk" is no torch device
    return dict(sorted(spec.items(), key=lambda entry: entry[1] == "disk"))


def revisions_for(ckpts: Sequence[str | os.PathLike], revisions: Sequence[str] | None) -> list[str | None]:
    """One revision per checkpoint (None for local folders): `revisions` holds one per hub id among `ckpts`,
    in order, or one for all of them."""
    hub = [_is_hub_id(os.fspath(c)) for c in ckpts]
    if not revisions:
        return [None] * len(ckpts)
    if not any(hub):
        raise ValueError("--revision names a hub branch, tag or commit, and no --ckpt is a hub id")
    if len(revisions) == 1:
        revisions = list(revisions) * sum(hub)
    if len(revisions) != sum(hub):
        raise ValueError(
            f"got {len(revisions)} --revision for {sum(hub)} hub --ckpt; give one per hub checkpoint or one"
        )
    given = iter(revisions)
    return [next(given) if h else None for h in hub]


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


def _hub_offline(repo_id: str, revision: str | None = None) -> bool:
    """Whether hub model `repo_id` (at `revision`) must be read from the local hub cache (True) or can be
    downloaded (False).

    The hub is asked once, without retries, so an offline machine fails at once; FileNotFoundError
    naming both readings of `repo_id` when it is neither reachable nor cached.
    """
    from huggingface_hub import hf_hub_download, hf_hub_url

    problem = hub_problem(hf_hub_url(repo_id, "config.json", revision=revision))
    if problem is None:
        return False
    with quiet_library():
        try:
            hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=True)
            return True
        except Exception:  # noqa: BLE001  not in the cache either
            at = f" at revision {revision!r}" if revision else ""
            raise FileNotFoundError(
                f"checkpoint not found: {repo_id} (no such local folder, and no hub model {repo_id!r}{at} "
                f"is cached or could be reached: {problem})"
            ) from None


def _hub_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit of hub model `repo_id` at `revision` (default: main) whose files were just read into the
    local hub cache, or None when the cache does not say."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return Path(path).parent.name if isinstance(path, str) else None


def _check_local(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise ValueError(f"not a checkpoint directory: {path} (expected a folder with config.json)")
    if not (path / "config.json").is_file():
        raise ValueError(f"not a checkpoint: {path} has no config.json")


def wrap(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> TransformersModel:
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
        dispatched = getattr(model, "hf_device_map", None) is not None
        wrapped = (_dispatched() if dispatched else TransformersModel)(model, tokenizer=tokenizer, task=task)
    tokenizer.padding_side = side
    return wrapped


def input_device(hf: PreTrainedModel, remote: bool | str = False) -> torch.device:
    """Where a batch goes: the device the input embedding runs on. For a model dispatched over a device map,
    its module's execution device (accelerate brings an offloaded module's weights there for each pass);
    the CPU for a request to a remote server (`remote` True or a host URL) and for weights on ``meta``
    (a model loaded without them): the inputs travel with the request and the server places them."""
    if remote and remote != "local":
        return torch.device("cpu")
    embedding = hf.get_input_embeddings()
    device = getattr(getattr(embedding, "_hf_hook", None), "execution_device", None)
    weight = cast(torch.Tensor, embedding.weight)  # an embedding's weight (torch types it tensor or module)
    device = torch.device(device) if device is not None else weight.device
    return torch.device("cpu") if device.type == "meta" else device


@functools.cache
def _dispatched() -> type:
    from nnsight.modeling.transformers import TransformersModel

    class DispatchedModel(TransformersModel):
        """An nnsight model over a Hugging Face model dispatched by accelerate: inputs go where its embedding
        runs (`input_device`). nnsight's default, its first parameter's device, is ``meta`` when accelerate
        offloaded that parameter to the CPU or disk."""

        @property
        def device(self) -> torch.device:
            return input_device(self._module)

    return DispatchedModel


def is_encoder(config: Any) -> bool:
    """Whether `config` is a BERT-style encoder: a masked-LM architecture not configured as a decoder.

    Its attention is bidirectional, so it has no next-token head to score text with; the probes read
    only its representations, and `load` gives it as the bare base model.
    """
    import transformers as tf

    return type(config) in tf.MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)


def load(
    ckpt: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = "auto",
    *,
    device_map: str | dict | None = None,
    revision: str | None = None,
    offload_folder: str | os.PathLike | None = None,
    verbose: bool = False,
) -> tuple[TransformersModel, PreTrainedTokenizerBase]:
    """Load a checkpoint for extraction: ``(nnsight model, tokenizer)``.

    The weights are read straight into `dtype` (transformers builds the model without weights and fills
    it tensor by tensor), so a bfloat16 load of a 7B model holds 14 GB, never a 28 GB float32 copy.

    Args:
        ckpt: a local checkpoint directory (config.json, weights, tokenizer files), e.g. a run of
            ``lime-model train``, or a Hugging Face hub id such as "EleutherAI/pythia-70m" (needs a
            network). LIMe checkpoints resolve through `lime_model`, imported here.
        device: where the model runs ("cpu", "cuda", "cuda:1", ...; default "cpu"); not with `device_map`.
        dtype: weights dtype: "auto" (what the checkpoint's config names, else its stored dtype),
            "float32", "bfloat16", "float16" or a torch.dtype; None means "auto".
        device_map: accelerate's big-model dispatch instead of one `device` (`device_map_of`): "auto"
            (spread over the GPUs, then the CPU, then disk), another strategy, or module name -> device
            ("cuda:0", "cpu", "disk"). Offloaded weights stay in CPU memory or on disk and are brought to
            the execution device layer by layer during each forward pass.
        revision: a hub branch, tag or commit (e.g. Pythia's "step143000"), for the weights, config and
            tokenizer alike; hub ids only.
        offload_folder: where a device map's "disk" weights go (default: a temporary folder, removed
            with the model).
        verbose: let transformers' load messages (load reports, warnings, progress bars) through;
            by default they are kept off the console.

    Returns:
        The model wrapped as an nnsight ``TransformersModel`` (the Hugging Face model is its
        ``._module``), in eval mode on `device` or dispatched over `device_map` (then ``hf_device_map``
        says where each module is), and its tokenizer (pad token defaulting to eos). A causal LM comes
        with its LM head (BLiMP scoring needs it); an encoder (`is_encoder`: BERT, RoBERTa, ...) as its
        base model (``BertModel``), since no probe uses a masked-LM head.

    Raises:
        FileNotFoundError: "checkpoint not found: PATH" when `ckpt` is a path that does not exist
            (including "owner/name" whose "owner" is a local folder), or reads as a hub id but is
            neither a local folder nor a hub model (at `revision`) that is cached or reachable (asked
            once, no retries).
        ValueError: not a checkpoint, unreadable or corrupt weights (a local safetensors file named by
            `lime_model.checks.check_weights`), no tokenizer, an architecture without an extraction
            adapter, a device this machine lacks (`lime_model.checks.check_device`), a bad `dtype` or
            `device_map`, `device` and `device_map` together, or a `revision` for a local folder.
    """
    import transformers as tf

    import lime_model
    from lime_model.checks import check_device, check_weights

    lime_model.register_models()  # the "lime" model types with the Auto classes (a no-op once done)
    ckpt = os.fspath(ckpt)
    dtype = _resolve_dtype(dtype)
    device_map = device_map_of(device_map)
    if device_map is not None and device is not None:
        raise ValueError("give a device or a device map, not both: a device map places the model itself")
    device = None if device_map is not None else check_device(device or "cpu")
    hub = _is_hub_id(ckpt)
    if revision is not None and not hub:
        raise ValueError(f"revision {revision!r} names a hub branch, tag or commit; {ckpt} is a local folder")
    # an unreachable hub model that is in the local hub cache is read from there, with no network retries
    source: dict[str, Any] = {"revision": revision} if hub else {}
    if hub and _hub_offline(ckpt, revision):
        source["local_files_only"] = True
    if not hub:
        ckpt = str(Path(ckpt).expanduser())
        _check_local(Path(ckpt))
        check_weights(ckpt)  # a corrupt weights file named in milliseconds, not after the config and model
    where = (
        f"hub checkpoint {ckpt!r}" + (f" at revision {revision!r}" if revision else "")
        if hub
        else f"checkpoint {ckpt}"
    )
    with quiet_library(verbose):
        try:
            config = tf.AutoConfig.from_pretrained(ckpt, **source)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"cannot read the config of {where}: {_one(error)}") from None
        get_adapter(config)  # fail early, naming the supported architectures

        auto: type[tf.AutoModel | tf.AutoModelForCausalLM]
        if is_encoder(config):
            auto = tf.AutoModel
        elif type(config) in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
            auto = tf.AutoModelForCausalLM
        else:
            raise ValueError(f"{where} ({config.model_type}) is neither a causal LM nor a BERT-style encoder")
        placement: dict[str, Any] = {}
        if device_map is not None:
            offload = offload_folder or tempfile.mkdtemp(prefix="lime-probe-offload-")
            placement = {"device_map": device_map, "offload_folder": os.fspath(offload)}
        elif (
            device is not None and device.type != "cpu"
        ):  # read straight onto the device: no copy of the weights in host memory
            placement = {"device_map": str(device)}
        try:
            model = auto.from_pretrained(ckpt, config=config, dtype=dtype, **placement, **source)
        except Exception as error:  # noqa: BLE001  corrupt/missing weights surface as many error types
            if "offload_folder" in placement and offload_folder is None:
                shutil.rmtree(placement["offload_folder"], ignore_errors=True)
            raise ValueError(f"cannot load the weights of {where}: {_one(error)}") from None
        if "offload_folder" in placement and offload_folder is None:  # lives as long as the model
            weakref.finalize(model, shutil.rmtree, placement["offload_folder"], ignore_errors=True)
        if (
            hub
        ):  # the activation cache keys a hub model on it (`cache.checkpoint_identity`), not on its weights
            model.config._commit_hash = _hub_commit(ckpt, revision)
        try:
            tokenizer = tf.AutoTokenizer.from_pretrained(ckpt, **source)
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
    return wrap(model.eval(), tokenizer), tokenizer
