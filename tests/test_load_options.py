"""`load` options for big and versioned checkpoints: a device map with CPU and disk offload, a dtype loaded as
such, hub revisions (read from a hub cache built here, offline), and their command-line options."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from helpers import CORPUS, save_tiny_checkpoint

from lime_probe import cli
from lime_probe.extraction.loading import input_device, load, revisions_for
from lime_probe.extraction.tracing import extract

TEXTS = ["The cat is on the mat.", "A dog ran far away from home today, and then it came back."]
SITES = ["hidden", "keys", "values"]
WINDOWS = ["--window", 16, "--num-windows", 4]  # entropy over 4 windows of 16 tokens: the tiny data fits


def offload_map(arch: str) -> dict[str, str]:
    """Every module of a 2-layer tiny model placed on the CPU or on disk, the embedding on disk (so its
    weights are on ``meta`` and only accelerate's hook knows where it runs)."""
    return {
        "model.embed_tokens": "disk",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "disk",
    }


def hidden_states(ckpt: Path, text: str, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    """Hugging Face's own hidden states (one sequence, batch dim dropped) from an independent plain load."""
    tok = tf.AutoTokenizer.from_pretrained(ckpt)
    model = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    with torch.no_grad():
        out = model(**tok(text, return_tensors="pt"), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


@pytest.mark.parametrize("arch", ["llama", "lime"])
def test_a_model_offloaded_to_cpu_and_disk_gives_the_plain_activations(tmp_path, arch):
    ckpt = save_tiny_checkpoint(tmp_path / arch, arch)
    plain, tok = load(ckpt)
    want = extract(plain, tok, TEXTS, sites=SITES, logprobs=True, progress=False)
    offload = tmp_path / "offload"
    model, tok = load(ckpt, device_map=offload_map(arch), offload_folder=offload)
    hf = model._module
    assert hf.hf_device_map == offload_map(arch)
    # the disk-mapped weights are not in memory: meta tensors, brought in for each forward pass
    assert hf.get_input_embeddings().weight.device.type == "meta"
    assert hf.model.layers[1].self_attn.v_proj.weight.device.type == "meta"
    assert hf.model.layers[0].self_attn.v_proj.weight.device.type == "cpu"
    assert input_device(hf) == torch.device("cpu")  # where the embedding runs, not its meta weights
    got = extract(model, tok, TEXTS, sites=SITES, logprobs=True, progress=False)
    for site in SITES:
        for layer in want.layers(site):
            torch.testing.assert_close(got[site][layer], want[site][layer], rtol=0, atol=0)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    # and both are Hugging Face's own forward pass (hidden: X_0 embeddings, X_1 after block 0)
    reference = hidden_states(ckpt, TEXTS[0])
    n = len(reference[0])
    torch.testing.assert_close(got["hidden"][1][:n], reference[1])


def test_device_map_auto_and_the_temporary_offload_folder(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    plain, tok = load(ckpt)
    want = extract(plain, tok, TEXTS, sites=["hidden"], progress=False)
    model, tok = load(ckpt, device_map="auto")  # this machine: all of it on the CPU
    assert {p.device.type for p in model._module.parameters()} == {"cpu"}
    got = extract(model, tok, TEXTS, sites=["hidden"], progress=False)
    for layer in want.layers("hidden"):
        torch.testing.assert_close(got["hidden"][layer], want["hidden"][layer], rtol=0, atol=0)
    # a disk map without an offload folder: a temporary one, removed with the model
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("lime-probe-offload-*"))
    model, tok = load(ckpt, device_map=offload_map("llama"))
    made = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("lime-probe-offload-*")) - before
    assert len(made) == 1
    del model
    gc.collect()
    assert not any(p.exists() for p in made)


def test_bfloat16_is_loaded_as_such_and_close_to_float32(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    model, tok = load(ckpt, dtype="bfloat16")
    hf = model._module
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    got = extract(model, tok, TEXTS, sites=["hidden"], progress=False)
    reference = hidden_states(ckpt, TEXTS[1])  # float32, Hugging Face's forward
    n = len(reference[0])
    for layer, want in enumerate(reference[:-1]):  # the last entry is normalised: site "final"
        x = got["hidden"][layer][-n:]  # sequences come back in order, the second one last
        error = (x - want).norm() / want.norm()
        # bfloat16 keeps 8 significant bits (2^-8 = 0.4 % per rounding); two blocks of them stay within 2 %
        assert 0 < error < 2e-2, (layer, error)
    # "auto" reads the dtype the checkpoint names; a float16 load is float16
    tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    assert load(tmp_path / "bf16")[0]._module.dtype == torch.bfloat16
    assert load(tmp_path / "bf16", dtype="float32")[0]._module.dtype == torch.float32
    assert load(ckpt, dtype="float16")[0]._module.dtype == torch.float16


def test_bad_load_options_are_value_errors(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="dtype must be a torch.dtype or one of auto, float32"):
        load(ckpt, dtype="float8")
    with pytest.raises(ValueError, match="a device or a device map, not both"):
        load(ckpt, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="device map 'everywhere' is none of auto, balanced"):
        load(ckpt, device_map="everywhere")
    with pytest.raises(ValueError, match="revision 'step1' names a hub branch.*is a local folder"):
        load(ckpt, revision="step1")
    # a catch-all beside entries for other devices: transformers left those modules on meta
    with pytest.raises(
        ValueError, match="places the whole model on 'cpu', so 'model.layers.1' cannot go to 'disk'"
    ):
        load(ckpt, device_map={"": "cpu", "model.layers.1": "disk"})
    same = load(ckpt, device_map={"": "cpu", "lm_head": "cpu"})[0]._module  # one device: still taken
    assert {p.device.type for p in same.parameters()} == {"cpu"}


def test_revisions_for_hub_ids_only(tmp_path):
    (tmp_path / "run").mkdir()
    local = str(tmp_path / "run")
    assert revisions_for([local, "org/a", "org/b"], None) == [None, None, None]
    assert revisions_for([local, "org/a", "org/b"], ["s1"]) == [None, "s1", "s1"]
    assert revisions_for(["org/a", local, "org/b"], ["s1", "s2"]) == ["s1", None, "s2"]
    with pytest.raises(ValueError, match="got 2 --revision for 3 hub --ckpt"):
        revisions_for(["org/a", "org/b", "org/c"], ["s1", "s2"])
    with pytest.raises(ValueError, match="no --ckpt is a hub id"):
        revisions_for([local], ["s1"])


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (saving the checkpoint) is not the command's
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["--device-map", "everywhere"], "device map 'everywhere' is none of auto"),
        (["--device-map", '{"model.embed_tokens": "gpu7"}'], "device map entry 'model.embed_tokens': 'gpu7'"),
        (["--device-map", "{'model': 0}"], "is not valid JSON"),
        (["--device-map", "nowhere.json"], "device map file not found: nowhere.json"),
        (["--device-map", "auto", "--device", "meta"], "give --device or --device-map, not both"),
        (["--revision", "step1"], "--revision names a hub branch, tag or commit, and no --ckpt is a hub id"),
        (["--device-map", '{"nonexistent.module": "cpu"}'], "entry 'nonexistent.module' names no module of"),
        (["--device-map", '{"model.embed_tokens": "cpu"}'], "places no device for model.layers, model.norm"),
        (["--device-map", '{"": "disk", "lm_head": "cpu"}'], "so 'lm_head' cannot go to 'cpu': give every"),
    ],
)
def test_bad_options_exit_2_in_one_line(capsys, tmp_path, options, match):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    data = tmp_path / "texts.txt"
    data.write_text("\n\n".join(CORPUS))
    argv = ["entropy", "--ckpt", ckpt, "--data", data, "--out", tmp_path / "out", "--no-cache", *options]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and match in err, err


def test_offloaded_bfloat16_from_the_command_line(capsys, tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    data = tmp_path / "texts.txt"
    data.write_text("\n\n".join(CORPUS))
    device_map = tmp_path / "map.json"
    device_map.write_text(json.dumps(offload_map("llama")))

    def entropy(*options) -> dict:
        out = tmp_path / "out"
        argv = ["entropy", "--ckpt", ckpt, "--data", data, "--out", out, "--no-cache", *WINDOWS, *options]
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        return json.loads((out / "entropy_values.json").read_text())

    offloaded = entropy("--dtype", "bfloat16", "--device-map", device_map)
    assert offloaded["meta"]["settings"]["dtype"] == "bfloat16"
    assert offloaded["meta"]["settings"]["device_map"] == str(device_map)
    # the device map moves no number; the dtype does
    means = [r["entropy_mean"] for r in offloaded["rows"]]
    assert [r["entropy_mean"] for r in entropy("--dtype", "bfloat16")["rows"]] == means
    assert [r["entropy_mean"] for r in entropy("--dtype", "float32")["rows"]] != means


def _save_snapshot(cache: Path, repo: str, ref: str, commit: str, seed: int) -> Path:
    """A hub cache entry as ``huggingface_hub`` lays it out: refs/REF names COMMIT, whose files are in
    snapshots/COMMIT (here real files, where a download makes links into blobs/)."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / ref).write_text(commit)
    return save_tiny_checkpoint(entry / "snapshots" / commit, "llama", seed=seed)


@pytest.mark.slow
def test_revisions_are_read_from_the_hub_cache_and_recorded(tmp_path):
    """Two revisions of one hub model (a hub cache built here, read offline) load their own weights and
    tokenizer; the results record each checkpoint's revision. In a subprocess: the hub's cache folder and
    offline switch are read when huggingface_hub is imported."""
    cache = tmp_path / "hub"
    first = _save_snapshot(cache, "org/tiny", "step1", "1" * 40, seed=1)
    last = _save_snapshot(cache, "org/tiny", "step143000", "2" * 40, seed=2)
    _save_snapshot(cache, "org/tiny", "main", "3" * 40, seed=3)
    data = tmp_path / "texts.txt"
    data.write_text("\n\n".join(CORPUS))
    script = textwrap.dedent(
        f"""
        import json, sys, torch
        from lime_probe.cli import main
        from lime_probe.extraction.cache import checkpoint_identity
        from lime_probe.extraction.loading import load
        from lime_probe.extraction.tracing import extract
        out, commits = {{}}, {{}}
        for rev in ("step1", "step143000", None):
            model, tok = load("org/tiny", revision=rev)
            out[str(rev)] = extract(model, tok, ["The cat is on the mat."], sites=["hidden"],
                                    progress=False)["hidden"][1].tolist()
            commits[str(rev)] = checkpoint_identity(model._module)["revision"]
        code = main(["entropy", "--ckpt", "org/tiny", "--ckpt", "org/tiny", "--label", "early", "--label",
                     "late", "--revision", "step1", "--revision", "step143000", "--data", {str(data)!r},
                     "--out", {str(tmp_path / "out")!r}, "--no-cache", "--window", "16", "--num-windows", "4"])
        print(json.dumps({{"code": code, "hidden": out, "commits": commits}}))
        """
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr[-3000:]
    for rev, snapshot in (("step1", first), ("step143000", last)):
        want = hidden_states(snapshot, "The cat is on the mat.")[1]
        torch.testing.assert_close(torch.tensor(result["hidden"][rev]), want)
    assert result["hidden"]["None"] != result["hidden"]["step1"]  # no revision: main, a third snapshot
    # the activation cache keys each on the commit its files came from
    assert result["commits"] == {"step1": "1" * 40, "step143000": "2" * 40, "None": "3" * 40}
    meta = json.loads((tmp_path / "out" / "entropy_values.json").read_text())["meta"]
    assert meta["checkpoints"]["early"] == {"id": "org/tiny", "source": "hub", "revision": "step1"}
    assert meta["checkpoints"]["late"]["revision"] == "step143000"


def save_trained_looking(directory: Path, arch: str, **overrides) -> Path:
    """A tiny checkpoint whose routers (or mixing weights) are far from their init, so that reading them
    from the wrong place (meta, or a fresh init) cannot pass."""
    from helpers import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_model(arch, tok, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in (".router.", "dwa", "value_mix")):
                p.normal_(std=0.3 if name.endswith(("query", "keys")) else 1.0)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("routing", ["full", "per-dim", "dynamic"])
def test_router_weights_of_offloaded_layers_are_read_from_the_offload_store(tmp_path, routing):
    from lime_probe.probes.router_weights import initial_weights, mix_by_router, router_weights

    ckpt = save_trained_looking(tmp_path / "m", "lime", routing=routing)
    plain, tok = load(ckpt)
    model, _ = load(ckpt, device_map=offload_map("lime"), offload_folder=tmp_path / "offload")
    router = model._module.model.layers[1].self_attn.router
    assert {p.device.type for p in router.parameters()} == {"meta"}  # on disk, not in memory
    hidden = extract(plain, tok, TEXTS, sites=["hidden"], progress=False)["hidden"]
    want, got = router_weights(plain, hidden), router_weights(model, hidden)
    np.testing.assert_array_equal(got.per_layer, want.per_layer)
    np.testing.assert_array_equal(got.per_head, want.per_head)
    np.testing.assert_array_equal(
        initial_weights(model, None, hidden)[0].per_layer, initial_weights(plain, None, hidden)[0].per_layer
    )
    assert {p.device.type for p in router.parameters()} == {"meta"}  # offloaded again after the read
    if routing != "dynamic":
        values = extract(plain, tok, TEXTS, sites=["values"], progress=False)["values"]
        for layer, mixed in mix_by_router(model, values).items():
            torch.testing.assert_close(mixed, mix_by_router(plain, values)[layer], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["lime", "denseformer"])
def test_router_command_on_a_model_offloaded_to_disk(capsys, tmp_path, arch):
    ckpt = save_trained_looking(tmp_path / "m", arch)
    data = tmp_path / "texts.txt"
    data.write_text("\n\n".join(CORPUS))
    device_map = json.dumps(offload_map(arch))

    def rows(*options) -> list:
        out = tmp_path / "out"
        code, _, err = run_cli(capsys, "router", "--ckpt", ckpt, "--data", data, "--out", out, *options)
        assert code == 0 and "Error" not in err, err
        return [json.loads(p.read_text())["rows"] for p in sorted(out.glob("router*.json"))]

    assert rows("--device-map", device_map) == rows()


def test_device_maps_naming_no_module_or_leaving_modules_unplaced_are_refused(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="entry 'model.layer.0' names no module of LlamaForCausalLM"):
        load(ckpt, device_map={**offload_map("llama"), "model.layer.0": "cpu"})
    partial = {k: v for k, v in offload_map("llama").items() if k not in ("model.layers.1", "lm_head")}
    with pytest.raises(ValueError, match=r"places no device for model\.layers\.1, lm_head: give every"):
        load(ckpt, device_map=partial)
    # a module's own weights when only its submodules are named; whole-tensor entries count
    inner = {**partial, "lm_head.weight": "cpu", "model.layers.1.self_attn": "cpu"}
    with pytest.raises(
        ValueError, match="no device for model.layers.1.mlp, model.layers.1.input_layernorm, "
    ):
        load(ckpt, device_map=inner)
    model, _ = load(ckpt, device_map={**partial, "lm_head": "cpu", "model.layers.1": "disk"})
    assert model._module.hf_device_map["model.layers.1"] == "disk"


@pytest.mark.parametrize("arch", ["llama", "lime", "gpt2"])
def test_a_model_all_on_disk_gives_the_plain_activations(tmp_path, arch):
    """A map whose first entry is "disk" (here the whole model): nnsight's pipeline took that for a torch
    device; the model runs on the CPU, its weights read from disk for each forward pass."""
    from lime_probe.extraction.loading import wrap

    ckpt = save_tiny_checkpoint(tmp_path / arch, arch)
    plain, tok = load(ckpt)
    want = extract(plain, tok, TEXTS, sites=["hidden"], logprobs=True, progress=False)
    model, tok = load(ckpt, device_map={"": "disk"})
    assert {p.device.type for p in model._module.parameters()} == {"meta"}
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, device_map={"": "disk"}, offload_folder=tmp_path / "o")
    for wrapped in (model, wrap(hf, tok)):
        got = extract(wrapped, tok, TEXTS, sites=["hidden"], logprobs=True, progress=False)
        for layer in want.layers("hidden"):
            torch.testing.assert_close(got["hidden"][layer], want["hidden"][layer], rtol=0, atol=0)
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)
    assert hf.hf_device_map == {"": "disk"}  # the wrap leaves the map as it found it


def test_a_disk_first_map_from_the_command_line(capsys, tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    data = tmp_path / "texts.txt"
    data.write_text("\n\n".join(CORPUS))

    def entropy(*options) -> list:
        out = tmp_path / "out"
        argv = ["entropy", "--ckpt", ckpt, "--data", data, "--out", out, "--no-cache", *WINDOWS, *options]
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        return json.loads((out / "entropy_values.json").read_text())["rows"]

    assert entropy("--device-map", '{"": "disk"}') == entropy()


def test_from_pretrained_arguments_pass_through_load(tmp_path, monkeypatch):
    ckpt = save_tiny_checkpoint(tmp_path / "m", "llama")
    assert load(ckpt)[0]._module.config._attn_implementation == "sdpa"
    model, tok = load(ckpt, attn_implementation="eager")
    assert model._module.config._attn_implementation == "eager"
    # the whole model at a tiny max_memory: accelerate puts all of it on disk, and it runs on the CPU
    plain = extract(load(ckpt)[0], TEXTS, sites=["hidden"], progress=False)
    model, _ = load(ckpt, device_map="sequential", max_memory={"cpu": 1})
    assert set(model._module.hf_device_map.values()) == {"disk"}
    got = extract(model, TEXTS, sites=["hidden"], progress=False)
    for layer in plain.layers("hidden"):
        torch.testing.assert_close(got["hidden"][layer], plain["hidden"][layer], rtol=0, atol=0)
    # trust_remote_code and token reach the config and tokenizer as well as the model
    seen = {}
    for auto in (tf.AutoConfig, tf.AutoTokenizer, tf.AutoModelForCausalLM):
        original = auto.from_pretrained.__func__

        def spy(cls, *args, _original=original, **kwargs):
            seen.setdefault(cls.__name__, []).append(
                {k: kwargs.get(k) for k in ("trust_remote_code", "token")}
            )
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(spy))
    load(ckpt, trust_remote_code=False, token="hf_none")
    assert set(seen) == {"AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"}
    assert all(
        call == {"trust_remote_code": False, "token": "hf_none"} for calls in seen.values() for call in calls
    )
    with pytest.raises(ValueError, match="load sets 'config' itself"):
        load(ckpt, config=None)
