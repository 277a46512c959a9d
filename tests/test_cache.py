"""The on-disk cache: reuse without a forward pass, resume after an interruption, keys, atomicity."""

import json
import os
import stat

import pytest
import torch
from helpers import save_tiny_checkpoint, tiny_model, tiny_tokenizer

import lime_probe.extraction.tracing as ex
from lime_probe.extraction.cache import ShardCache, checkpoint_identity
from lime_probe.extraction.loading import load
from lime_probe.extraction.tracing import extract

TEXTS = [f"The cat {i} is on the mat and the dogs were in garden {i}." for i in range(7)]
SITES = ["hidden", "values"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def count_forwards(model):
    """A list that grows by one on every forward pass of `model`'s first block."""
    calls = []
    model.base_model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    return calls


def assert_same(a, b):
    assert a.sites == b.sites
    torch.testing.assert_close(a.offsets, b.offsets)
    torch.testing.assert_close(a.token_ids, b.token_ids)
    for site in a:
        for layer in a.layers(site):
            torch.testing.assert_close(a[site][layer], b[site][layer])


def test_second_run_reuses_the_cache_without_forward(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "SHARD_BYTES", 1)  # a shard per batch
    model = tiny_model("llama", tok)
    calls = count_forwards(model)
    memory = extract(model, tok, TEXTS, sites=SITES, batch_size=2, progress=False)
    first = extract(model, tok, TEXTS, sites=SITES, batch_size=2, cache_dir=tmp_path, progress=False)
    n = len(calls)
    assert n == 2 * 4  # two runs of ceil(7 / 2) batches
    assert len(first.shards) == 4
    second = extract(model, tok, TEXTS, sites=SITES, batch_size=2, cache_dir=tmp_path, progress=False)
    assert len(calls) == n
    assert_same(first, memory)
    assert_same(second, memory)
    manifest = json.loads((first.shards[0].parent / "manifest.json").read_text())
    assert manifest["complete"] and sum(s["n_sequences"] for s in manifest["shards"]) == len(TEXTS)
    assert set(manifest["key"]) == {"checkpoint", "model_type", "data", "settings", "versions"}
    assert not list(tmp_path.rglob(".*tmp*"))
    umask = os.umask(0)
    os.umask(umask)  # readable by the group like any file the user writes, not mkstemp's 0o600
    for f in [*first.shards, first.shards[0].parent / "manifest.json"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask


def test_interrupted_run_resumes_from_last_complete_shard(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "SHARD_BYTES", 1)  # a shard per batch
    model = tiny_model("gpt2", tok)
    reference = extract(model, tok, TEXTS, sites=SITES, batch_size=2, progress=False)
    calls = []

    def interrupt(*args):
        calls.append(1)
        if len(calls) == 3:  # during the 3rd batch: shards of batches 1 and 2 are written
            raise KeyboardInterrupt

    handle = model.transformer.h[0].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        extract(model, tok, TEXTS, sites=SITES, batch_size=2, cache_dir=tmp_path, progress=False)
    handle.remove()
    (folder,) = tmp_path.iterdir()
    assert json.loads((folder / "manifest.json").read_text())["complete"] is False
    calls.clear()
    model.transformer.h[0].register_forward_hook(lambda *a: calls.append(1))
    resumed = extract(model, tok, TEXTS, sites=SITES, batch_size=2, cache_dir=tmp_path, progress=False)
    assert len(calls) == 2  # only the batches of sequences 4-5 and 6 run again
    assert_same(resumed, reference)


def test_key_changes_with_settings_data_and_weights(tok, tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "llama")
    model, tok = load(ckpt)
    cache = tmp_path / "cache"
    extract(model, tok, TEXTS, cache_dir=cache, progress=False)
    extract(model, tok, TEXTS, pool="mean", cache_dir=cache, progress=False)
    extract(model, tok, TEXTS[:3], cache_dir=cache, progress=False)
    assert len(list(cache.iterdir())) == 3
    before = checkpoint_identity(model._module)
    save_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=1)  # new weights at the same path
    assert checkpoint_identity(load(ckpt)[0]._module) != before


def test_in_memory_model_identity_is_a_parameter_hash(tok):
    a, b = tiny_model("llama", tok, seed=0), tiny_model("llama", tok, seed=1)
    assert checkpoint_identity(a) == checkpoint_identity(tiny_model("llama", tok, seed=0))
    assert checkpoint_identity(a) != checkpoint_identity(b)


def test_corrupt_manifest_or_missing_shard_starts_over(tmp_path):
    key = {"x": 1}
    cache = ShardCache(tmp_path, key)
    cache.add_shard(
        {"offsets": torch.tensor([0, 2]), "token_ids": torch.tensor([4, 5]), "n_tokens": torch.tensor([2])}
    )
    assert ShardCache(tmp_path, key).done_sequences == 1
    cache.shards[0].unlink()
    assert ShardCache(tmp_path, key).done_sequences == 0
    (cache.directory / "manifest.json").write_text("{not json")
    assert ShardCache(tmp_path, key).done_sequences == 0
    assert ShardCache(tmp_path, {"x": 2}).directory != cache.directory


def test_resume_respects_the_token_limit(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "SHARD_BYTES", 1)  # a shard per batch
    model = tiny_model("llama", tok)
    budget = 3 * len(tok(TEXTS[0])["input_ids"]) + 2  # ends 2 tokens into the 4th text
    reference = extract(model, tok, TEXTS, batch_size=2, max_tokens=budget, progress=False)
    assert len(reference.token_ids) == budget and reference.offsets.diff().tolist()[-1] == 2
    calls = count_forwards(model)

    def interrupt(*args):  # before the 2nd batch: the 1st batch's shard is written
        if len(calls) == 1:
            raise KeyboardInterrupt

    handle = model.model.layers[0].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        extract(model, tok, TEXTS, batch_size=2, max_tokens=budget, cache_dir=tmp_path, progress=False)
    handle.remove()
    calls.clear()
    resumed = extract(model, tok, TEXTS, batch_size=2, max_tokens=budget, cache_dir=tmp_path, progress=False)
    assert len(calls) == 1  # only the batch of texts 2-3 (text 3 cut to 2 tokens) runs again
    assert_same(resumed, reference)
