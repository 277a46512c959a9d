"""`load`: local checkpoints of every supported architecture, and clear errors for bad ones."""

import pytest
import torch
import transformers as tf
from helpers import save_tiny_checkpoint

from lime_probe.extraction import extract
from lime_probe.loading import _is_hub_id, load


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


def test_corrupt_weights(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot load the weights of checkpoint"):
        load(ckpt)


def test_missing_weights(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "gpt2")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="cannot load the weights of checkpoint"):
        load(ckpt)


def test_unsupported_architecture(tmp_path):
    config = tf.OPTConfig(
        hidden_size=16,
        num_hidden_layers=1,
        ffn_dim=32,
        num_attention_heads=2,
        vocab_size=50,
        word_embed_proj_dim=16,
    )
    tf.OPTForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no extraction adapter for model_type 'opt'; supported: .*gpt2"):
        load(tmp_path)


def test_hub_ids_versus_paths(tmp_path):
    assert _is_hub_id("EleutherAI/pythia-70m") and _is_hub_id("gpt2")
    assert not _is_hub_id("./runs/lime") and not _is_hub_id("/abs/path") and not _is_hub_id("a/b/c")
    assert not _is_hub_id(str(tmp_path))


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
    assert message.startswith("no local folder 'runs/nope' and no hub model 'runs/nope' could be reached (")
    assert "\n" not in message
    assert ("HF_HUB_OFFLINE is set" in message) == offline
