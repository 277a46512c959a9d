"""`load`: local checkpoints of every supported architecture, and clear errors for bad ones."""

import re
from pathlib import Path

import pytest
import torch
import transformers as tf
from helpers import save_tiny_checkpoint, tiny_config, tiny_tokenizer

from lime_model.checks import check_device
from lime_probe.extraction.loading import hub_dataset, load
from lime_probe.extraction.sources import is_hub_id
from lime_probe.extraction.tracing import extract


@pytest.mark.parametrize("arch", ["llama", "lime", "gpt2", "gpt_neox", "bert"])
def test_load_local_checkpoint_and_extract(tmp_path, arch):
    if arch == "lime":
        pytest.importorskip("lime_model")
    ckpt = save_tiny_checkpoint(tmp_path / arch, arch)
    model, tok = load(ckpt)
    from nnsight.modeling.transformers import TransformersModel

    assert isinstance(model, TransformersModel)
    assert model._module.config.model_type == arch and not model._module.training
    assert tok.pad_token_id is not None
    auto = tf.AutoModelForMaskedLM if arch == "bert" else tf.AutoModelForCausalLM
    plain = auto.from_pretrained(ckpt).eval()  # an independent load of the same files
    text = "The cat is on the mat."
    with torch.no_grad():
        hidden = plain(**tok(text, return_tensors="pt"), output_hidden_states=True).hidden_states
    acts = extract(model, tok, [text], sites=["hidden"], layers=[0, 1], progress=False)
    torch.testing.assert_close(acts["hidden"][1], hidden[1][0])


def test_load_dtype(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    model, _ = load(ckpt, dtype="bfloat16")
    assert next(model._module.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be a torch.dtype or one of"):
        load(ckpt, dtype="float8")


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found: .*nowhere"):
        load(tmp_path / "nowhere")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        load(tmp_path / "file.txt")


def test_corrupt_weights_are_named_before_loading(tmp_path, monkeypatch):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    opened = []
    monkeypatch.setattr(tf.AutoConfig, "from_pretrained", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match=f"cannot read the weights file {re.escape(str(weights))}: "):
        load(ckpt)
    assert opened == []  # named from its header, before the config or the model is read


def test_missing_weights(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "gpt2")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="cannot load the weights of checkpoint"):
        load(ckpt)


def test_missing_tokenizer_says_how_to_save_one(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "lime")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink()
    assert not [p for p in ckpt.iterdir() if "token" in p.name]  # no other tokenizer file was saved
    with pytest.raises(ValueError) as info:
        load(ckpt)
    message = str(info.value)
    assert message.startswith(f"checkpoint {ckpt} has no tokenizer (none of tokenizer.json, ")
    assert f"tokenizer.save_pretrained('{ckpt}')" in message and "\n" not in message


def test_an_architecture_without_an_adapter_loads_and_gives_its_residual_stream(tmp_path):
    """OPT has no registered adapter: it loads, and its blocks (``decoder.layers``) give ``hidden``."""
    model, tok = load(save_tiny_checkpoint(tmp_path, "opt"))
    acts = extract(model, tok, ["The cat is on the mat."], sites="hidden", progress=False)
    ids = tok("The cat is on the mat.", return_tensors="pt")
    with torch.no_grad():
        want = model._module(**ids, output_hidden_states=True).hidden_states[0][0]
    torch.testing.assert_close(acts["hidden"][0], want)


def test_hub_ids_versus_paths(tmp_path):
    assert is_hub_id("EleutherAI/pythia-70m") and is_hub_id("gpt2")
    assert not is_hub_id("./runs/lime") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")
    assert not is_hub_id(str(tmp_path))
    assert not is_hub_id("~/runs/lime") and not is_hub_id(".hidden")


@pytest.mark.parametrize("spec", ["./nope", "~/lime-probe-no-such-run", "runs/nope", "runs/deeper/nope"])
def test_missing_local_path_says_not_found_without_asking_the_hub(tmp_path, monkeypatch, spec):
    import lime_probe.extraction.loading as loading

    def no_hub(repo_id):
        raise AssertionError(f"asked the hub for {repo_id!r}")

    monkeypatch.setattr(loading, "_hub_offline", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # "runs/nope" next to an existing runs/ is a path, not owner/name
    with pytest.raises(FileNotFoundError) as info:
        load(spec)
    assert str(info.value) == f"checkpoint not found: {Path(spec).expanduser()}"


@pytest.mark.parametrize("offline", [False, True])
def test_unreachable_hub_id_fails_at_once_naming_both_readings(tmp_path, monkeypatch, offline):
    import time

    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)  # read by huggingface_hub.is_offline_mode()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as info:
        load("runs/nope")
    assert time.monotonic() - start < 10  # one request, no retries (this machine has no network)
    message = str(info.value)
    assert message.startswith(
        "checkpoint not found: runs/nope (no such local folder, and no hub model 'runs/nope' "
    )
    assert "\n" not in message
    assert ("HF_HUB_OFFLINE is set" in message) == offline


@pytest.mark.parametrize(
    "device, match",
    [
        ("gpu0", "--device 'gpu0' is not a torch device"),
        ("cuda:x", "--device 'cuda:x' is not a torch device"),
        ("cuda", "--device cuda: this machine has no CUDA device"),
        ("mps", "--device mps: this machine has no MPS device"),
    ],
)
def test_a_device_the_machine_lacks_fails_before_loading(tmp_path, monkeypatch, device, match):
    if (
        device == "cuda"
        and torch.cuda.is_available()
        or device == "mps"
        and torch.backends.mps.is_available()
    ):
        pytest.skip(f"this machine has {device}")
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=match):
        check_device(device)
    opened = []
    monkeypatch.setattr(tf.AutoConfig, "from_pretrained", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match=match):
        load(tmp_path / "not-even-read", device=device)
    assert opened == []


def test_an_unreachable_hub_dataset_fails_at_once_in_one_line(monkeypatch):
    import time

    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    ran = []
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as info, hub_dataset("org/data", "the data", "pass a local file"):
        ran.append(1)
    assert time.monotonic() - start < 10 and ran == []  # one request, the block never runs
    message = str(info.value)
    assert (
        message.startswith("the data not found locally and the hub is unreachable (") and "\n" not in message
    )
    assert message.endswith("): pass a local file")


def _save_bert_base(directory: Path) -> Path:
    """A tiny bare ``BertModel`` checkpoint (as sentence-transformers ships MiniLM: no LM head)."""
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    tf.BertModel(tiny_config("bert", len(tok))).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _chatter(caplog) -> list[str]:
    """Library log lines at WARNING or above (pytest routes the transformers logger here)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= 30 and r.name.startswith(("transformers", "huggingface"))
    ]


def test_encoder_loads_as_its_base_model_and_quietly(tmp_path, capfd, caplog, recwarn):
    ckpt = _save_bert_base(tmp_path / "minilm")
    capfd.readouterr()
    caplog.clear()
    model, tok = load(ckpt)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")  # no progress bar
    assert _chatter(caplog) == []  # no load report, no "add is_decoder=True"
    assert not [w for w in recwarn if "transformers" in w.filename or "nnsight" in w.filename]
    assert type(model._module) is tf.BertModel  # not BertLMHeadModel with a random head
    plain = tf.BertModel.from_pretrained(ckpt).eval()  # an independent load: every weight from the file
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(model._module.state_dict()[name], tensor, msg=name)
    text = "The cat is on the mat."
    with torch.no_grad():
        hidden = plain(**tok(text, return_tensors="pt"), output_hidden_states=True).hidden_states
    acts = extract(model, tok, [text], sites=["hidden"], layers=[2], progress=False)
    torch.testing.assert_close(acts["hidden"][2], hidden[2][0])


def test_masked_lm_checkpoint_loads_as_encoder_and_verbose_shows_the_load_report(tmp_path, capfd, caplog):
    ckpt = save_tiny_checkpoint(tmp_path / "bert", "bert")  # a BertForMaskedLM: its head goes unused
    capfd.readouterr()
    caplog.clear()
    model, _ = load(ckpt)
    assert type(model._module) is tf.BertModel
    assert capfd.readouterr().err == "" and _chatter(caplog) == []
    load(ckpt, verbose=True)
    assert "Loading weights" in capfd.readouterr().err
    assert any("LOAD REPORT" in line for line in _chatter(caplog))  # the unused cls.* head weights
    import transformers

    assert (
        transformers.logging.get_verbosity() == transformers.logging.WARNING
    )  # restored after the quiet load
    assert transformers.utils.logging.is_progress_bar_enabled()


def test_decoder_configured_bert_is_a_causal_lm(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "bert", "bert", is_decoder=True)
    model, _ = load(ckpt)
    assert type(model._module) is tf.BertLMHeadModel
