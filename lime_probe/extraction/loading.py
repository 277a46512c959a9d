"""Load any supported checkpoint (local directory or hub id) as an nnsight model plus its tokenizer."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lime_model.checks import quiet_library  # the CLI's quiet loads, shared with lime-model
from lime_probe.extraction.adapters import adapter_for, is_encoder
from lime_probe.extraction.sources import check_local, is_hub_id

if TYPE_CHECKING:  # for the signatures only: nnsight and transformers are imported where used
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
# `from_pretrained` arguments that also reach the config and the tokenizer (a private hub model's token,
# a custom architecture's code, another hub cache); the others reach the model's `from_pretrained` only
SHARED_KWARGS = ("trust_remote_code", "token", "cache_dir")
# arguments `load` sets itself: `config` is read first (the adapter is checked on it), `torch_dtype` is `dtype`
OWN_KWARGS = ("config", "torch_dtype")
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
    # transformers takes a "" entry for the whole model: the modules other entries send elsewhere stay on meta
    elsewhere = [module for module, device in spec.items() if "" in spec and device != spec[""]]
    if elsewhere:
        raise ValueError(
            f'device map entry "" places the whole model on {spec[""]!r}, so {elsewhere[0]!r} cannot go to '
            f"{spec[elsewhere[0]]!r}: give every module its own entry instead of a catch-all"
        )
    return spec


def _unplaced(module: torch.nn.Module, device_map: dict, prefix: str = "") -> list[str]:
    """The paths under `module` (named `prefix`) that `device_map` gives no device: a module with weights
    that no entry names, contains or lies inside, or a weight of a module of which only submodules are
    named. Weights are what ``state_dict`` saves (what accelerate places)."""
    if prefix in device_map:
        return []
    if not any(not prefix or key.startswith(f"{prefix}.") for key in device_map if key):
        return [prefix or "the whole model"] if module.state_dict() else []
    own = [n for n, _ in module.named_parameters(recurse=False)]
    own += [n for n, _ in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    out = [path for n in own if (path := f"{prefix}.{n}" if prefix else n) not in device_map]
    for name, child in module.named_children():
        out += _unplaced(child, device_map, f"{prefix}.{name}" if prefix else name)
    return out


def check_device_map(device_map: dict, skeleton: torch.nn.Module) -> None:
    """ValueError, one line, when the module -> device map `device_map` names something the model
    (`skeleton`: the architecture, weights on ``meta``) does not have, or leaves some of its weights on no
    device; transformers would ignore the first and build a model accelerate never dispatched for the
    second."""
    known = {name for name, _ in skeleton.named_modules()} | set(skeleton.state_dict())
    unknown = [key for key in device_map if key not in known]
    if unknown:
        children = ", ".join(name for name, _ in skeleton.named_children())
        raise ValueError(
            f"device map entry {unknown[0]!r} names no module of {type(skeleton).__name__} (its modules: "
            f"{children}, and theirs, as printed by print(model))"
        )
    unplaced = _unplaced(skeleton, device_map)
    if unplaced:
        shown = ", ".join(unplaced[:4]) + (f" and {len(unplaced) - 4} more" if len(unplaced) > 4 else "")
        raise ValueError(
            f"the device map places no device for {shown}: give every module a device (an entry for it "
            'or a module containing it; {"": "cpu"} places the whole model)'
        )


def revisions_for(ckpts: Sequence[str | os.PathLike], revisions: Sequence[str] | None) -> list[str | None]:
    """One revision per checkpoint (None for local folders): `revisions` holds one per hub id among `ckpts`,
    in order, or one for all of them."""
    hub = [is_hub_id(os.fspath(c)) for c in ckpts]
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


def wrap(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> TransformersModel:
    """Wrap a loaded Hugging Face `model` for nnsight (a `TransformersModel` sharing `tokenizer`).

    nnsight sets a causal model's tokenizer to left padding; the tokenizer's own padding side is
    kept, since `lime_probe.extract` pads batches itself and is correct for either side. A model
    dispatched over a device map (`load`'s, or your own ``from_pretrained(..., device_map=...)``) runs
    where its embedding runs (`input_device`), also when the map offloads all of it to disk.
    """
    from nnsight.modeling.transformers import TransformersModel

    side = tokenizer.padding_side
    placed = getattr(model, "hf_device_map", None)
    if placed is not None:
        # transformers' pipeline, which nnsight builds, takes the device of the map's first entry as its
        # own, and "disk" (the whole model, or its first module, offloaded) is no torch device: while it is
        # built, the map names where the model runs
        # typed Any: torch types a module's attributes as tensors or modules
        running: Any = {"": str(input_device(model))}
        model.hf_device_map = running
    try:
        with warnings.catch_warnings():  # BERT's `.output` submodules: nnsight renames them, harmlessly
            warnings.filterwarnings("ignore", message=".*has a submodule named 'output'.*")
            # a bare base model (LlamaModel, BertModel) has no task nnsight can infer from a head
            task = "feature-extraction" if model.base_model is model else None
            kind = _dispatched() if placed is not None else TransformersModel
            wrapped = kind(model, tokenizer=tokenizer, task=task)
    finally:
        if placed is not None:
            model.hf_device_map = placed
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


@contextmanager
def onloaded(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`module` with every weight accelerate offloaded (to the CPU or disk: ``meta`` in the model) read
    from its offload store onto the module's execution device inside the block, and offloaded again after:
    what reading parameters outside a forward pass needs (during one, accelerate's hooks do this). A module
    without offloaded weights is left as it is."""
    from accelerate.utils import align_module_device, has_offloaded_params

    with ExitStack() as stack:
        for sub in module.modules():  # accelerate hooks each submodule that holds weights of its own
            if has_offloaded_params(sub):
                stack.enter_context(align_module_device(sub))
        yield module


def check_remote(model: TransformersModel, remote: bool | str) -> None:
    """ValueError, one line, when `remote` asks a server (NDIF) to run nnsight `model` and the model came
    from a local folder: the server loads hub models by their id (``model.repo_id``), and nnsight would
    fail on the path with a raw hub validation error."""
    if not remote or remote == "local":
        return
    repo = getattr(model, "repo_id", None) or getattr(model._module.config, "_name_or_path", "")
    if not isinstance(repo, str) or not is_hub_id(repo):
        raise ValueError(
            f"NDIF serves hub ids only, and this model comes from {repo or 'no hub id'!r}: extract locally "
            "(remote=False), or build the model by its hub id, TransformersModel('owner/name', dispatch=False)"
        )


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


def _skeleton(auto: Any, config: Any, trust_remote_code: bool | None) -> torch.nn.Module:
    """The model `auto` builds from `config`, its weights on ``meta`` (no memory, no init): its module
    tree."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def load(
    ckpt: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = "auto",
    *,
    device_map: str | dict | None = None,
    revision: str | None = None,
    offload_folder: str | os.PathLike | None = None,
    verbose: bool = False,
    **from_pretrained_kwargs: Any,
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
        **from_pretrained_kwargs: passed to the model's ``from_pretrained``: ``max_memory`` (with a
            `device_map`), ``quantization_config``, ``attn_implementation`` ("eager", "sdpa"), and so on;
            ``trust_remote_code``, ``token`` and ``cache_dir`` reach the config and tokenizer too
            (`SHARED_KWARGS`). Not ``config`` or ``torch_dtype`` (`dtype`), which `load` sets.

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
            `lime_model.checks.check_weights`), no tokenizer, a tokenizer with more tokens than the model's
            embedding has rows (`lime_model.tokenization.check_embedding`), an architecture whose blocks are
            not found without an extraction adapter (`lime_probe.extraction.adapters.adapter_for`), a
            device this machine lacks (`lime_model.checks.check_device`), a bad `dtype` or `device_map` (a
            module -> device map must name modules of the model and place all of them: `check_device_map`),
            `device` and `device_map` together, or a `revision` for a local folder.
    """
    import lime_model

    lime_model.register_models()  # the "lime" model types with the Auto classes (a no-op once done)
    shared = _shared_kwargs(from_pretrained_kwargs)
    dtype = _resolve_dtype(dtype)
    device, device_map = _placement_of(device, device_map)
    at = _locate(os.fspath(ckpt), revision, shared)
    with quiet_library(verbose):
        config, auto = _read_config(at)
        if isinstance(device_map, dict):
            check_device_map(device_map, _skeleton(auto, config, shared.get("trust_remote_code")))
        model = _read_model(
            at, auto, config, dtype, device, device_map, offload_folder, from_pretrained_kwargs
        )
        adapter_for(model)  # an architecture whose blocks cannot be found: refused before any work
        # the activation cache keys a hub model on its commit, not its weights (`cache.checkpoint_identity`)
        if at.hub:
            model.config._commit_hash = _hub_commit(at.path, at.revision)
        tokenizer = _read_tokenizer(at)
    _check_tokenizer(tokenizer, model, at)
    return wrap(model.eval(), tokenizer), tokenizer


@dataclass(frozen=True)
class _Checkpoint:
    """Where `load` reads a checkpoint from: a local folder (`path`, expanded) or a hub id (`hub`) at
    `revision`, with the ``from_pretrained`` arguments that say so (`source`) and its name in messages
    (`where`)."""

    path: str
    hub: bool
    revision: str | None
    source: dict[str, Any]
    where: str


def _shared_kwargs(from_pretrained_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `SHARED_KWARGS` among `from_pretrained_kwargs` (they reach the config and tokenizer too);
    ValueError for one of `OWN_KWARGS`, which `load` sets itself."""
    own = [k for k in OWN_KWARGS if k in from_pretrained_kwargs]
    if own:
        raise ValueError(f"load sets {own[0]!r} itself (config: read from the checkpoint; dtype: `dtype`)")
    return {k: v for k, v in from_pretrained_kwargs.items() if k in SHARED_KWARGS}


def _placement_of(
    device: str | torch.device | None, device_map: str | dict | None
) -> tuple[torch.device | None, str | dict | None]:
    """The checked device (default the CPU) or device map (`device_map_of`): one of them, the other None."""
    from lime_model.checks import check_device

    device_map = device_map_of(device_map)
    if device_map is not None and device is not None:
        raise ValueError("give a device or a device map, not both: a device map places the model itself")
    return (None if device_map is not None else check_device(device or "cpu")), device_map


def _locate(ckpt: str, revision: str | None, shared: dict[str, Any]) -> _Checkpoint:
    """Where `ckpt` is read from: a hub model not reachable but in the local hub cache is read from there,
    with no network retries; a local folder is checked first (a corrupt weights file named in
    milliseconds, not after the config and model)."""
    hub = is_hub_id(ckpt)
    if revision is not None and not hub:
        raise ValueError(f"revision {revision!r} names a hub branch, tag or commit; {ckpt} is a local folder")
    source: dict[str, Any] = {"revision": revision} if hub else {}
    if hub and _hub_offline(ckpt, revision):
        source["local_files_only"] = True
    source |= shared
    if hub:
        where = f"hub checkpoint {ckpt!r}" + (f" at revision {revision!r}" if revision else "")
        return _Checkpoint(ckpt, hub, revision, source, where)
    ckpt = str(Path(ckpt).expanduser())
    check_local(ckpt)
    return _Checkpoint(ckpt, hub, revision, source, f"checkpoint {ckpt}")


def _read_config(at: _Checkpoint) -> tuple[Any, Any]:
    """The checkpoint's config and the Auto class that builds its model: a causal LM with its LM head,
    an encoder (`is_encoder`) as its base model; anything else: ValueError."""
    import transformers as tf

    try:
        config = tf.AutoConfig.from_pretrained(at.path, **at.source)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"cannot read the config of {at.where}: {_one(error)}") from None
    if is_encoder(config):
        return config, tf.AutoModel
    if type(config) in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        return config, tf.AutoModelForCausalLM
    raise ValueError(f"{at.where} ({config.model_type}) is neither a causal LM nor a BERT-style encoder")


def _read_model(
    at: _Checkpoint,
    auto: Any,
    config: Any,
    dtype: torch.dtype | str,
    device: torch.device | None,
    device_map: str | dict | None,
    offload_folder: str | os.PathLike | None,
    from_pretrained_kwargs: dict[str, Any],
) -> PreTrainedModel:
    """The model's weights read into `dtype`, on `device` or dispatched over `device_map` (its "disk"
    weights under `offload_folder`, else a temporary folder that lives as long as the model)."""
    placement: dict[str, Any] = {}
    if device_map is not None:
        offload = offload_folder or tempfile.mkdtemp(prefix="lime-probe-offload-")
        placement = {"device_map": device_map, "offload_folder": os.fspath(offload)}
    elif device is not None and device.type != "cpu":
        # read straight onto the device: no copy of the weights in host memory
        placement = {"device_map": str(device)}
    temporary = "offload_folder" in placement and offload_folder is None
    try:
        model = auto.from_pretrained(
            at.path, config=config, dtype=dtype, **{**placement, **at.source, **from_pretrained_kwargs}
        )
    except Exception as error:  # noqa: BLE001  corrupt/missing weights surface as many error types
        if temporary:
            shutil.rmtree(placement["offload_folder"], ignore_errors=True)
        raise ValueError(f"cannot load the weights of {at.where}: {_one(error)}") from None
    if temporary:
        weakref.finalize(model, shutil.rmtree, placement["offload_folder"], ignore_errors=True)
    return model


def _read_tokenizer(at: _Checkpoint) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; ValueError in one line when it cannot be read, naming the files a
    local folder lacks."""
    import transformers as tf

    try:
        return tf.AutoTokenizer.from_pretrained(at.path, **at.source)
    except Exception as error:  # noqa: BLE001
        if not at.hub and not any((Path(at.path) / name).is_file() for name in TOKENIZER_FILES):
            # transformers' own message here is a multi-line list of backends tried
            raise ValueError(
                f"{at.where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                f"model's tokenizer next to its weights, tokenizer.save_pretrained({at.path!r})"
            ) from None
        raise ValueError(f"cannot load the tokenizer of {at.where}: {_one(error)}") from None


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, at: _Checkpoint) -> None:
    """Refuse a tokenizer that does not fit the model (no vocabulary: every text would pack into 0 tokens;
    more tokens than the embedding has rows); give it the eos token as its pad token where it has none."""
    from lime_model.tokenization import check_embedding, check_vocabulary

    check_vocabulary(tokenizer, at.where, None if at.hub else at.path)
    check_embedding(tokenizer, model, at.where)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
