"""``lime-model upcycle`` and ``train --init``: a pretrained LLaMA-style model as a LIMe at self-only routing.

The upcycled model is compared with the source model as transformers runs it (its own classes), on every
routing kind the routing table lists; the refusals are one line, exit 2, nothing written."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import TINY_TRAIN, save_tiny_checkpoint, tiny_model, train_args
from safetensors.torch import load_file

from lime_model import cli
from lime_model.recipes import load_recipe, parse_set
from lime_model.routing import ROUTINGS, parse_routing
from lime_model.tokenization import load_tokenizer
from lime_model.train import model_config
from lime_model.upcycle import init_config, load_init

LAYERS = 4  # enough for first-2, last-2 and the dilated kinds to differ from full
SPECS = [f"{kind}-2" if k.parametric else kind for kind, k in ROUTINGS.items()]
FIXED = {"average"}  # kinds whose routers have fixed weights, which cannot start at self-only routing
TOKENS = torch.tensor([[5, 17, 42, 7, 99, 3, 250, 11, 64, 8], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100]])


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Tiny source checkpoints (model + tokenizer), 4 layers: LLaMA (GQA, untied head) and Mistral without
    a sliding window."""
    root = tmp_path_factory.mktemp("sources")
    return {
        "llama": save_tiny_checkpoint(root / "llama", "llama", num_hidden_layers=LAYERS),
        "mistral": save_tiny_checkpoint(
            root / "mistral", "mistral", num_hidden_layers=LAYERS, sliding_window=None
        ),
    }


def load(path: Path):
    import lime_model  # noqa: F401  registers model_type "lime"

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def upcycled(source: Path, out: Path, routing: str, capsys) -> int:
    code = cli.main(["upcycle", "--ckpt", str(source), "--out", str(out), "--routing", routing])
    capsys.readouterr()
    return code


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_logits_and_generation_equal_the_source_on_every_routing_kind(spec, arch, sources, tmp_path, capsys):
    out = tmp_path / "lime"
    code = cli.main(["upcycle", "--ckpt", str(sources[arch]), "--out", str(out), "--routing", spec])
    err = capsys.readouterr().err.strip()
    if parse_routing(spec).kind in FIXED:
        assert code == 2 and "cannot start at self-only routing" in err and len(err.splitlines()) == 1
        assert not out.exists()
        return
    assert code == 0, err
    source, lime = load(sources[arch]), load(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "lime" and config["routing"] == spec
    assert config["upcycled_from"]["checkpoint"] == str(sources[arch])
    assert config["upcycled_from"]["model_type"] == arch
    routers = [layer.self_attn.router for layer in lime.model.layers]
    if parse_routing(spec).enabled:
        # the routers exist and mix several layers: the equality below is routing at self-only weights
        assert any(len(r.sources) > 1 and any(True for _ in r.parameters()) for r in routers)
    with torch.no_grad():
        expected, got = source(TOKENS).logits, lime(TOKENS).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(lime.generate(TOKENS, **kw), source.generate(TOKENS, **kw))
    assert (out / "tokenizer.json").is_file()
    assert transformers.AutoTokenizer.from_pretrained(out)("the cat").input_ids == (
        transformers.AutoTokenizer.from_pretrained(sources[arch])("the cat").input_ids
    )


def test_a_llama_run_upcycles_and_its_routers_train_from_identity(tmp_path, text, capsys):
    """The study's path: a lime-model LLaMA run (routing none) -> upcycled (exact) -> one step of
    ``train --init`` moves the routers off self-only routing."""
    llama = tmp_path / "llama"
    tiny = ["--set", f"model.num_hidden_layers={LAYERS}"]
    assert cli.main(train_args(llama, text, "--routing", "none", *tiny, steps=2)) == 0
    out = tmp_path / "lime"
    assert upcycled(llama, out, "full", capsys) == 0
    with torch.no_grad():
        torch.testing.assert_close(load(out)(TOKENS).logits, load(llama)(TOKENS).logits, rtol=0, atol=1e-5)
    start = load_file(out / "model.safetensors")
    routers = sorted(k for k in start if ".router." in k)
    assert len(routers) == LAYERS - 1  # layer 0 reads only itself: no parameters
    for key in routers:
        w = start[key]  # [kv, S * kv]: the own (last) block the identity, the rest 0
        kv = w.shape[0]
        assert torch.equal(w[:, -kv:], torch.eye(kv)) and not w[:, :-kv].any()

    # train's own upcycling (a routed recipe from the LLaMA run) builds the same model
    sets = [*(v for flag, v in itertools.pairwise(TINY_TRAIN) if flag == "--set"), tiny[1]]
    recipe = load_recipe("cpu-tiny", {**parse_set(sets), "data": str(text), "init": str(llama)})
    config = init_config(recipe, model_config(recipe, load_tokenizer(str(llama))))
    assert config.routing == "full" and config.upcycled_from["checkpoint"] == str(llama)
    in_memory = transformers.AutoModelForCausalLM.from_config(config).eval()
    load_init(llama, in_memory)
    assert in_memory.state_dict().keys() == load(out).state_dict().keys()
    for key, value in load(out).state_dict().items():
        assert torch.equal(in_memory.state_dict()[key], value), key

    run = tmp_path / "run"
    assert cli.main(train_args(run, text, "--init", str(out), *tiny, steps=1)) == 0
    trained = load_file(run / "model.safetensors")
    for key in routers:
        kv = trained[key].shape[0]
        assert trained[key][:, :-kv].abs().max() > 0, key  # other layers' K/V now read
    recipe = json.loads((run / "recipe.json").read_text())
    assert recipe["init"] == str(out)
    # the embeddings started from the LLaMA's, not a fresh init: one small step away from them
    diff = trained["model.embed_tokens.weight"] - start["model.embed_tokens.weight"]
    assert 0 < diff.abs().max() < 0.1

    # the router analysis's step 0 of this run is where it started (self-only), not a seed's fresh init
    from lime_probe.probes.router_weights import initial_weights

    initial, words = initial_weights(load(run), run)
    assert words == f"step 0, the weights of its --init {out.name}"
    self_only = torch.where(torch.ones(LAYERS, LAYERS).tril().bool(), 0.0, float("nan")).double()
    self_only.fill_diagonal_(1.0)  # reader i's share of buffered layer j: 1 at j = i, 0 before, NaN after
    torch.testing.assert_close(
        torch.from_numpy(initial.per_layer), self_only, rtol=0, atol=1e-12, equal_nan=True
    )
    (out / "config.json").rename(out / "gone.json")
    with pytest.raises(ValueError, match="which is not here"):
        initial_weights(load(run), run)


def test_a_source_without_a_tokenizer_converts_and_says_so(tmp_path, capsys):
    source = tmp_path / "src"
    tiny_model("llama").save_pretrained(source)
    out = tmp_path / "lime"
    assert cli.main(["upcycle", "--ckpt", str(source), "--out", str(out)]) == 0
    assert f"{source} has no tokenizer: none copied" in capsys.readouterr().err
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer_config.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(load(out)(TOKENS).logits, load(source)(TOKENS).logits, rtol=0, atol=1e-5)


def test_train_init_refuses_a_shape_the_recipe_does_not_have(tmp_path, text, capsys):
    init = tmp_path / "lime"
    assert upcycled(save_tiny_checkpoint(tmp_path / "src", "llama"), init, "full", capsys) == 0
    run = tmp_path / "run"
    code = cli.main(train_args(run, text, "--init", str(init), "--set", "model.hidden_size=64", steps=1))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "hidden_size 32, the recipe's model 64" in err and "model.hidden_size=32" in err
    assert not run.exists()
    code = cli.main(train_args(run, text, "--init", str(tmp_path / "src" / "nope"), steps=1))
    assert code == 2 and "is not a model directory" in capsys.readouterr().err
    assert not run.exists()


def _write(tmp_path: Path, arch: str, **overrides) -> Path:
    return save_tiny_checkpoint(tmp_path / arch, arch, **overrides)


# (id, how to make --ckpt in tmp_path, message fragments)
BAD = [
    ("not a causal LM", lambda t: _write(t, "bert"), ["(bert) is not a causal LM"]),
    ("missing folder", lambda t: t / "missing", ["missing: no such folder"]),
    ("Qwen2 biases", lambda t: _write(t, "qwen2"), ["Qwen2", "q/k/v projection biases"]),
    ("sliding window", lambda t: _write(t, "mistral", sliding_window=16), ["sliding-window", "sliding_window=16"]),
    ("attention bias", lambda t: _write(t, "llama", attention_bias=True), ["attention biases"]),
    ("another model type", lambda t: _write(t, "gpt2"), ["'gpt2' model", "LLaMA-style"]),
    ("a LIMe that routes", lambda t: _write(t, "lime"), ["already routes (routing 'full')"]),
]  # fmt: skip


@pytest.mark.parametrize(("make", "needles"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(make, needles, tmp_path, monkeypatch, capsys):
    ckpt = make(tmp_path)
    capsys.readouterr()  # saving the source shows a progress bar

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)
    before = sorted(tmp_path.rglob("*"))
    assert cli.main(["upcycle", "--ckpt", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lime-model: error: "), err
    for needle in needles:
        assert needle in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_an_out_folder_that_is_not_empty_is_refused(sources, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["upcycle", "--ckpt", str(sources["llama"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out" in err and "not an empty folder" in err and len(err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left beside it


def test_the_upcycling_study_plan_is_well_formed(tmp_path, monkeypatch, capsys):
    """``lime-probe reproduce --study upcycling``'s plan, without training: per seed the LLaMA base, then
    the two runs that start from that seed's base run; the claims as figures/upcycling/PROTOCOL.md fixes them."""
    import lime_model.train
    from lime_probe.studies import STUDIES, runner
    from lime_probe.studies.lm_cpu import PERPLEXITY, entropy
    from lime_probe.studies.upcycling import BASE, CONTINUE_STEPS, CONTINUED, UPCYCLED

    study = STUDIES["upcycling"]
    protocol = (Path(__file__).parents[1] / study.protocol).read_text()
    assert study.protocol == "figures/upcycling/PROTOCOL.md" and f"N = {CONTINUE_STEPS}" in protocol
    assert (study.recipe, study.seeds, study.reproducible) == ("wikitext-cpu", tuple(range(10)), True)
    assert study.models[BASE] == STUDIES["lm-cpu-fair"].models["LLaMA"]  # the lm-cpu-fair LLaMA arm
    primary = [c for c in study.claims if c.role == "primary"]
    secondary = [c for c in study.claims if c.role == "secondary"]
    assert [(c.model, c.reference, c.endpoint, c.sign) for c in primary] == [
        (UPCYCLED, CONTINUED, PERPLEXITY, None)
    ]
    assert [(c.model, c.reference, c.endpoint, c.sign) for c in secondary] == [
        (UPCYCLED, BASE, PERPLEXITY, None),
        (CONTINUED, BASE, PERPLEXITY, None),
        (UPCYCLED, CONTINUED, entropy(), +1),
    ]
    assert len(protocol.split("## Secondary endpoints (Holm over these three")) == 2

    calls: list[tuple[Path, dict]] = []
    monkeypatch.setattr(lime_model.train, "train", lambda recipe, run, **kw: calls.append((run, kw)))
    for size in ("full", "tiny"):
        sized = study.sized(size)
        for seed in (0, 7):
            calls.clear()
            runs = runner.train_seed(sized, tmp_path / size, seed, None, runner.Progress(3))
            assert [run for run, _ in calls] == [runs[m] for m in (BASE, CONTINUED, UPCYCLED)]
            base, continued, upcycled = ({k: v for k, v in kw.items() if k != "resume"} for _, kw in calls)
            assert base["seed"] == continued["seed"] == upcycled["seed"] == seed
            assert "init" not in base and continued["init"] == upcycled["init"] == str(runs[BASE])
            assert (continued["routing"], upcycled["routing"]) == ("none", "full")
            steps = CONTINUE_STEPS if size == "full" else sized.overrides["steps"]
            assert continued["steps"] == upcycled["steps"] == steps
            # every run's recipe loads; the two continued runs differ in routing only (the router at 10 x)
            recipes = [
                load_recipe(sized.recipe, {"data": "x.txt", **kw}).to_dict() for kw in (continued, upcycled)
            ]
            assert {k for k in recipes[0] if recipes[0][k] != recipes[1][k]} == {"routing"}
            assert recipes[1]["router_lr_mult"] == 10
    capsys.readouterr()
