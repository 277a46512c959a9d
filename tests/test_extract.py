"""Batching, padding, selection, limits, early stop and bad input of `extract`."""

import importlib.abc
import sys

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from lime_probe.extraction.batching import pad_batch, plan_batches
from lime_probe.extraction.tracing import extract

TEXTS = [
    "The cat is on the mat and the dogs are in the garden.",
    "It was",
    "She was happy because the results were good.",
    "There was a time when the rivers were clean.",
    "Layers are functions.",
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.filterwarnings("ignore:attn_pattern:UserWarning")  # the models run SDPA: eager for the pattern
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "bert", "lime"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("batching", [dict(batch_size=3), dict(batch_tokens=40)])
def test_batched_equals_one_at_a_time(tok, arch, side, batching):
    if arch == "lime":
        pytest.importorskip("lime_model")
    model = tiny_model(arch, tok)
    tok.padding_side = side
    # the pattern's keys are counted from each sequence's first token, so padding on either side must not move them
    sites = ["hidden", "final", "values", "keys", "attn_pattern"] + (
        ["routed_values"] if arch == "lime" else []
    )
    batched = extract(model, tok, TEXTS, sites=sites, progress=False, **batching)  # sorted, order restored
    alone = extract(model, tok, TEXTS, sites=sites, batch_size=1, progress=False)  # no padding at all
    lengths = [len(tok(t)["input_ids"]) for t in TEXTS]
    assert batched.offsets.diff().tolist() == lengths
    assert batched.token_ids.tolist() == sum((tok(t)["input_ids"] for t in TEXTS), [])
    for site in sites:
        for layer in batched.layers(site):
            torch.testing.assert_close(batched[site][layer], alone[site][layer], atol=1e-5, rtol=1e-5)
            assert batched[site][layer].dtype == torch.float32


def test_pad_batch_positions_count_each_sequence_from_zero():
    left = pad_batch([[5, 6, 7], [8]], pad_id=0, side="left")
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert left["position_ids"][1, 2].item() == 0
    right = pad_batch([[5, 6, 7], [8]], pad_id=0, side="right")
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert right["position_ids"][0].tolist() == [0, 1, 2]


def test_mean_pool_is_mean_of_each_sequence(tok):
    model = tiny_model("llama", tok)
    rows = extract(model, tok, TEXTS, sites=["hidden"], batch_size=2, progress=False)
    pooled = extract(model, tok, TEXTS, sites=["hidden"], pool="mean", batch_size=2, progress=False)
    assert pooled.offsets.tolist() == list(range(len(TEXTS) + 1))
    assert (pooled.token_ids == -1).all()
    for layer in rows.layers("hidden"):
        expected = torch.stack([s.mean(0) for s in rows.sequences("hidden", layer)])
        torch.testing.assert_close(pooled["hidden"][layer], expected)


def test_token_ids_select_positions(tok):
    model = tiny_model("gpt2", tok)
    wanted = tok.convert_tokens_to_ids(["Ġis", "Ġwas", "Ġwere"])
    full = extract(model, tok, TEXTS, sites=["values"], batch_size=2, progress=False)
    some = extract(model, tok, TEXTS, sites=["values"], token_ids=wanted, batch_size=2, progress=False)
    mask = torch.isin(full.token_ids, torch.tensor(wanted))
    assert mask.sum() >= 4
    assert some.token_ids.tolist() == full.token_ids[mask].tolist()
    torch.testing.assert_close(some["values"][1], full["values"][1][mask])
    per_seq = [sum(t in wanted for t in tok(x)["input_ids"]) for x in TEXTS]
    assert some.offsets.diff().tolist() == per_seq


def test_layers_selection_and_early_stop(tok):
    """Asking for block 0 only runs block 0: later blocks and the LM head never run."""
    model = tiny_model("llama", tok)
    calls = {"block1": 0, "lm_head": 0}
    model.model.layers[1].register_forward_hook(lambda *a: calls.__setitem__("block1", calls["block1"] + 1))
    model.lm_head.register_forward_hook(lambda *a: calls.__setitem__("lm_head", calls["lm_head"] + 1))
    acts = extract(model, tok, TEXTS, sites=["values", "hidden"], layers=[0, 1], progress=False)
    assert acts.layers("values") == [0, 1] and acts.layers("hidden") == [0, 1]
    assert calls == {"block1": 0, "lm_head": 0}
    last = extract(model, tok, TEXTS, sites=["hidden", "values"], layers=-1, progress=False)
    assert last.layers("hidden") == [2] and last.layers("values") == [1]
    assert extract(model, tok, TEXTS, sites="keys", layers=0, progress=False).layers("keys") == [0]
    assert calls["lm_head"] == 0


def test_token_budget_cuts_the_last_sequence(tok):
    model = tiny_model("llama", tok)
    lengths = [len(tok(t)["input_ids"]) for t in TEXTS]
    budget = lengths[0] + 1
    cut = extract(model, tok, TEXTS, max_tokens=budget, progress=False)
    assert cut.offsets.diff().tolist() == [lengths[0], 1]
    full = extract(model, tok, TEXTS[:2], progress=False)
    torch.testing.assert_close(
        cut["hidden"][2][:budget], full["hidden"][2][:budget]
    )  # causal: prefix unchanged


class NoLimeProbe(importlib.abc.MetaPathFinder):
    """Makes `lime_probe` unimportable, like on an NDIF server (nnsight's local simulation hides the
    loaded modules, but the editable install could bring them back)."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "lime_probe":
            raise ModuleNotFoundError(name)


def test_remote_local_path_gives_the_same_result(tok, monkeypatch):
    model = tiny_model("llama", tok)
    local = extract(model, tok, TEXTS[:3], sites=["hidden", "values"], progress=False)
    monkeypatch.setattr(sys, "meta_path", [NoLimeProbe(), *sys.meta_path])
    simulated = extract(model, tok, TEXTS[:3], sites=["hidden", "values"], progress=False, remote="local")
    for site in local:
        for layer in local.layers(site):
            torch.testing.assert_close(simulated[site][layer], local[site][layer])


def test_activations_views(tok):
    model = tiny_model("llama", tok)
    acts = extract(model, tok, TEXTS, sites=["hidden", "values"], progress=False)
    assert acts.sites == ("hidden", "values") and set(acts) == {"hidden", "values"}
    seqs = acts.sequences("values", 0)
    assert [len(s) for s in seqs] == acts.offsets.diff().tolist()
    with pytest.raises(KeyError, match="site 'keys' was not extracted"):
        acts["keys"]
    with pytest.raises(KeyError, match="layer 7 of site 'hidden' was not extracted"):
        acts["hidden"][7]
    with pytest.raises(ValueError, match="site 'hidden' has no heads"):
        acts.per_head("hidden", 0)


@pytest.mark.parametrize("cached", [False, True])
def test_iter_sequences_streams_the_same_sequences(tok, tmp_path, monkeypatch, cached):
    import lime_probe.extraction.tracing as ex

    monkeypatch.setattr(ex, "SHARD_BYTES", 1)  # a cache shard per batch
    model = tiny_model("llama", tok)
    acts = extract(
        model,
        tok,
        TEXTS,
        sites=["values"],
        batch_size=2,
        progress=False,
        cache_dir=tmp_path if cached else None,
    )
    assert len(acts.shards) == (3 if cached else 0)
    chunks = list(acts.iter_sequences("values", 1, chunk=3))
    assert [len(c) for c in chunks] == [3, 2]  # across shard boundaries: the same chunks either way
    want = torch.split(acts["values"][1], acts.offsets.diff().tolist())  # the whole layer at once
    assert len(want) == len(TEXTS)
    for got, w in zip((s for c in chunks for s in c), want, strict=True):
        assert torch.equal(got, w)
    with pytest.raises(KeyError, match="layer 5 of site 'values' was not extracted"):
        next(acts.iter_sequences("values", 5))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(texts=[]), "texts is empty"),
        (dict(texts="a string"), "texts must be a list of strings"),
        (dict(sites=[]), "sites must be a non-empty list"),
        (dict(layers=[0.5]), "layers must be integers"),
        (
            dict(sites=["attention"]),
            r"unknown site 'attention'; sites are hidden, .*attn_pattern or module:PATH",
        ),
        (
            dict(sites=["module:layers.{i}.mlp:inputs"]),
            r"malformed site 'module:layers.\{i\}.mlp:inputs': write",
        ),
        (
            dict(sites=["module:layers.{i}.mlp.down"]),
            r"names no module of LlamaForCausalLM; nearest: layers.\{i\}.mlp.down_proj",
        ),
        (dict(sites=["routed_values"]), "site 'routed_values' is not available for model_type 'llama'"),
        (dict(layers=[3], sites=["values"]), "layer 3 out of range for site 'values', which has 2 entries"),
        (dict(pool="max"), "pool must be one of"),
        (dict(pool="mean", token_ids=[5]), "cannot be combined"),
        (dict(batch_size=0), "batch_size must be a positive integer"),
        (dict(max_tokens=-1), "max_tokens must be a positive integer"),
        (dict(texts=["fine", ""]), "text 1 tokenizes to no tokens"),
    ],
)
def test_bad_input_is_a_clear_error(tok, kwargs, message):
    model = tiny_model("llama", tok)
    args = dict(texts=TEXTS, progress=False) | kwargs
    with pytest.raises(ValueError, match=message):
        extract(model, tok, **args)


def test_nan_activations_name_site_and_layer(tok):
    model = tiny_model("llama", tok)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    ok = extract(model, tok, TEXTS, sites=["values"], progress=False)  # values of block 1 come before its MLP
    assert torch.isfinite(ok["values"][1]).all()
    with pytest.raises(ValueError, match=r"non-finite activations \(NaN/Inf\) at site 'hidden' layer 2"):
        extract(model, tok, TEXTS, sites=["hidden"], progress=False)


@pytest.mark.slow
def test_works_from_python_dash_c(tmp_path):
    """nnsight traces need their source in a file; extract's trace is in the library, so a caller
    without one (python -c, stdin, exec) works."""
    import subprocess
    from pathlib import Path

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from helpers import tiny_tokenizer, tiny_model; "
        "from lime_probe.extraction.tracing import extract; tok = tiny_tokenizer(); "
        "acts = extract(tiny_model('gpt2', tok), tok, ['The cat is here'], sites=['values'], progress=False); "
        "print(tuple(acts['values'][1].shape))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert (
        out.stdout.strip().splitlines()[-1]
        == f"({len(tiny_tokenizer()('The cat is here')['input_ids'])}, 32)"
    )


# --------------------------------------------------------------------------- token-budget batches


def test_plan_batches_sorts_by_length_and_keeps_each_padded_batch_within_the_budget():
    lengths = [3, 9, 1, 9, 4, 4, 20, 2]
    batches = plan_batches(lengths, None, 18)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each sequence once
    flat = [i for b in batches for i in b]
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # longest first
    assert flat[1:3] == [1, 3]  # ties keep the input order
    assert batches[0] == [6]  # over the budget alone: a batch of its own
    for b in batches[1:]:
        assert len(b) * max(lengths[i] for i in b) <= 18
    assert [len(b) for b in batches] == [1, 2, 4, 1]  # greedy: 9+9, then 4,4,3,2 (4x4=16), then 1
    assert [len(b) for b in plan_batches(lengths, 3, 18)] == [3, 3, 2]  # batch_size counts sequences


def test_token_budget_restores_the_input_order_across_blocks(tok, monkeypatch):
    import lime_probe.extraction.tracing as ex

    monkeypatch.setattr(ex, "SHARD_BYTES", 1)  # blocks of one batch: order restored block by block too
    model = tiny_model("llama", tok)
    texts = TEXTS * 3
    got = extract(model, tok, texts, sites=["hidden"], batch_tokens=30, progress=False)
    alone = [extract(model, tok, [t], sites=["hidden"], progress=False) for t in texts]
    assert got.offsets.diff().tolist() == [len(a.token_ids) for a in alone]
    for k, a in enumerate(alone):
        for layer in got.layers("hidden"):
            torch.testing.assert_close(
                got.sequences("hidden", layer)[k], a["hidden"][layer], atol=1e-5, rtol=1e-5
            )


# --------------------------------------------------------------------------- log-probabilities


def plain_logprob(model, ids: list[int]) -> float:
    """sum_{i>=1} log p(t_i | t_<i) of one unpadded sequence from a plain Hugging Face forward."""
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return float(sum(logp[i - 1, ids[i]] for i in range(1, len(ids))))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "lime"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_logprobs_equal_a_plain_forward(tok, arch, side, tmp_path):
    if arch == "lime":
        pytest.importorskip("lime_model")
    model = tiny_model(arch, tok)
    tok.padding_side = side
    texts = TEXTS * 2
    acts = extract(
        model, tok, texts, sites=["hidden"], pool="mean", batch_tokens=40, logprobs=True, progress=False
    )
    want = [plain_logprob(model, tok(t)["input_ids"]) for t in texts]
    assert acts.logprobs.dtype == torch.float64 and acts.logprobs.shape == (len(texts),)
    torch.testing.assert_close(acts.logprobs, torch.tensor(want, dtype=torch.float64), atol=1e-4, rtol=1e-6)
    # the second call reads the first one's cache
    cached, again = (
        extract(
            model,
            tok,
            texts,
            sites=["hidden"],
            pool="mean",
            batch_tokens=40,
            logprobs=True,
            progress=False,
            cache_dir=tmp_path,
        )
        for _ in range(2)
    )
    assert again.shards and torch.equal(again.logprobs, cached.logprobs)
    assert extract(model, tok, texts, sites=["hidden"], progress=False).logprobs is None


def test_the_batch_size_help_names_the_default_token_budget():
    from lime_probe.cli import build_parser
    from lime_probe.extraction.batching import DEFAULT_BATCH_TOKENS

    entropy = build_parser()._subparsers._group_actions[0].choices["entropy"]
    (action,) = [a for a in entropy._actions if a.dest == "batch_size"]
    assert action.default is None and f"fit {DEFAULT_BATCH_TOKENS} tokens" in action.help


def test_the_models_own_tokenizer_and_a_stacked_site(tmp_path):
    from helpers import save_tiny_checkpoint

    from lime_probe.extraction.loading import load

    model, tok = load(save_tiny_checkpoint(tmp_path / "m", "llama"))
    texts = ["The cat is on the mat.", "A dog ran far away."]
    named = extract(model, tok, texts, sites=["hidden", "values"], progress=False)
    own = extract(model, texts, sites=["hidden", "values"], progress=False)  # the model carries its tokenizer
    assert own.layers("hidden") == named.layers("hidden")
    for layer in named.layers("hidden"):
        assert torch.equal(own["hidden"][layer], named["hidden"][layer])
    stacked = own.stack("hidden")  # (layers, rows, dim)
    assert stacked.shape == (3, len(own.token_ids), 32)
    assert torch.equal(stacked[2], own["hidden"][2])
    assert torch.equal(own.stack("values", [1, 0]), torch.stack([own["values"][1], own["values"][0]]))
    with pytest.raises(ValueError, match="carries no tokenizer: extract\\(model, tokenizer, texts\\)"):
        extract(model._module, texts, progress=False)
