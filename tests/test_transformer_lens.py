"""``attn_pattern`` and ``module:`` sites against TransformerLens, a second library reading the same tiny
checkpoints through its own hooks (TransformerBridge). A test-only dependency (the ``dev`` extra); the package
does not depend on it."""

import pytest
import torch
from helpers import save_tiny_checkpoint

TEXTS = ["The cat is on the mat and the dogs are in the garden.", "It was", "A model is a function."]
DOWN = {
    "gpt2": "h.{i}.mlp.c_proj",
    "llama": "layers.{i}.mlp.down_proj",
    "gpt_neox": "layers.{i}.mlp.dense_4h_to_h",
}
MLP = {"gpt2": "h.{i}.mlp", "llama": "layers.{i}.mlp", "gpt_neox": "layers.{i}.mlp"}


@pytest.fixture(autouse=True)
def keep_transformers_verbosity():
    """Importing TransformerLens turns transformers' logging to errors only, for the whole process: the
    tests after these read transformers' warnings."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    yield
    logging.set_verbosity(level)


@pytest.mark.parametrize("arch", list(DOWN))
def test_sites_equal_transformer_lens_hooks(tmp_path, monkeypatch, arch):
    """``blocks.{i}.attn.hook_pattern`` = attn_pattern, ``blocks.{i}.hook_mlp_out`` = the MLP module's output,
    ``blocks.{i}.mlp.out.hook_in`` = the input of the MLP's output projection, each text alone."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    from lime_probe import extract, load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = save_tiny_checkpoint(tmp_path / arch, arch)
    bridge = TransformerBridge.boot_transformers(
        str(path), tokenizer=AutoTokenizer.from_pretrained(path), device="cpu"
    )
    model, tok = load(path)
    sites = ["attn_pattern", f"module:{MLP[arch]}", f"module:{DOWN[arch]}:input"]
    acts = extract(model, tok, TEXTS, sites=sites, batch_size=3, progress=False)
    for s, text in enumerate(TEXTS):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids)
        rows = slice(int(acts.offsets[s]), int(acts.offsets[s + 1]))
        for i in range(2):
            torch.testing.assert_close(acts.pattern(i, s), cache[f"blocks.{i}.attn.hook_pattern"][0])
            torch.testing.assert_close(acts[sites[1]][i][rows], cache[f"blocks.{i}.hook_mlp_out"][0])
            torch.testing.assert_close(acts[sites[2]][i][rows], cache[f"blocks.{i}.mlp.out.hook_in"][0])
