"""Extracted sites equal values captured by hand-written forward hooks / output_hidden_states."""

import types

import pytest
import torch
import torch.nn.functional as F
from helpers import routed_specs, tiny_config, tiny_model, tiny_tokenizer
from transformers import AutoModel

from lime_probe.extraction.adapters import ADAPTERS, Adapter, get_adapter, proj_sites, register_adapter
from lime_probe.extraction.tracing import extract

TEXTS = ["The cat is on the mat and the dogs are in the garden.", "It was", "A model is a function."]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def reference(model, tok, texts, hook_fns):
    """Run each text alone through `model` with forward hooks; per hook name, the concatenated
    (tokens, dim) captures over texts, plus the `output_hidden_states` tuple per layer."""
    caps = {name: [] for name in hook_fns}
    handles = []
    for name, (path, fn) in hook_fns.items():
        handles.append(
            model.get_submodule(path).register_forward_hook(
                lambda m, args, out, name=name, fn=fn: caps[name].append(fn(args, out)[0])
            )
        )
    hidden = []
    try:
        with torch.no_grad():
            for text in texts:
                ids = tok(text, return_tensors="pt")
                hidden.append(model(**ids, output_hidden_states=True).hidden_states)
    finally:
        for h in handles:
            h.remove()
    refs = {name: torch.cat(v) for name, v in caps.items()}
    refs["hf_hidden"] = [torch.cat([h[i][0] for h in hidden]) for i in range(len(hidden[0]))]
    return refs


def out_of(args, out):
    return out[0] if isinstance(out, tuple) else out


def check(acts, refs, n_layers, final_is_last_block=False):
    for i in range(n_layers):  # X_0..X_{L-1}: identical to HF's hidden states
        torch.testing.assert_close(acts["hidden"][i], refs["hf_hidden"][i])
    torch.testing.assert_close(acts["hidden"][n_layers], refs["last_block"])  # before the final norm
    torch.testing.assert_close(acts["final"][0], refs["hf_hidden"][n_layers])  # HF's last = normalised
    if not final_is_last_block:
        assert not torch.allclose(acts["final"][0], acts["hidden"][n_layers])
    for i in range(n_layers):
        torch.testing.assert_close(acts["keys"][i], refs[f"keys{i}"])
        torch.testing.assert_close(acts["values"][i], refs[f"values{i}"])


SITES = ["hidden", "final", "keys", "values"]


def test_llama_gqa_matches_hooks(tok):
    model = tiny_model("llama", tok)
    hooks = {"last_block": ("model.layers.1", out_of)}
    for i in range(2):
        hooks[f"keys{i}"] = (f"model.layers.{i}.self_attn.k_proj", out_of)
        hooks[f"values{i}"] = (f"model.layers.{i}.self_attn.v_proj", out_of)
    refs = reference(model, tok, TEXTS, hooks)
    acts = extract(model, tok, TEXTS, sites=SITES, batch_size=3, progress=False)
    check(acts, refs, 2)
    assert acts["values"][0].shape[1] == 2 * 8  # 2 kv heads (GQA, 4 query heads) x head_dim 8
    per_head = acts.per_head("values", 1)
    assert per_head.shape == (len(acts.token_ids), 2, 8)
    torch.testing.assert_close(per_head[:, 1], refs["values1"][:, 8:])


def test_gpt2_fused_c_attn_matches_hooks(tok):
    model = tiny_model("gpt2", tok)
    d = model.config.n_embd
    hooks = {"last_block": ("transformer.h.1", out_of)}
    for i in range(2):  # c_attn is [q | k | v] along the last dim
        hooks[f"keys{i}"] = (f"transformer.h.{i}.attn.c_attn", lambda a, o: o[..., d : 2 * d])
        hooks[f"values{i}"] = (f"transformer.h.{i}.attn.c_attn", lambda a, o: o[..., 2 * d :])
    refs = reference(model, tok, TEXTS, hooks)
    check(acts=extract(model, tok, TEXTS, sites=SITES, batch_size=3, progress=False), refs=refs, n_layers=2)


def test_gpt_neox_interleaved_qkv_matches_weights(tok):
    """query_key_value rows are laid out per head as [q_h, k_h, v_h]; the reference recomputes
    keys/values from the weight rows of each head, applied to the hooked input."""
    model = tiny_model("gpt_neox", tok)
    heads, hd = 4, 8

    def rows_of(layer, part):
        lin = model.gpt_neox.layers[layer].attention.query_key_value
        idx = torch.cat(
            [torch.arange(h * 3 * hd + part * hd, h * 3 * hd + (part + 1) * hd) for h in range(heads)]
        )
        return lambda args, out: F.linear(args[0], lin.weight[idx], lin.bias[idx])

    hooks = {"last_block": ("gpt_neox.layers.1", out_of)}
    for i in range(2):
        hooks[f"keys{i}"] = (f"gpt_neox.layers.{i}.attention.query_key_value", rows_of(i, 1))
        hooks[f"values{i}"] = (f"gpt_neox.layers.{i}.attention.query_key_value", rows_of(i, 2))
    refs = reference(model, tok, TEXTS, hooks)
    check(extract(model, tok, TEXTS, sites=SITES, batch_size=3, progress=False), refs, 2)


def test_bert_matches_hooks(tok):
    model = tiny_model("bert", tok)
    hooks = {"last_block": ("bert.encoder.layer.1", out_of)}
    for i in range(2):
        hooks[f"keys{i}"] = (f"bert.encoder.layer.{i}.attention.self.key", out_of)
        hooks[f"values{i}"] = (f"bert.encoder.layer.{i}.attention.self.value", out_of)
    refs = reference(model, tok, TEXTS, hooks)
    acts = extract(model, tok, TEXTS, sites=SITES, batch_size=3, progress=False)
    check(acts, refs, 2, final_is_last_block=True)  # no final norm: "final" is the last block's output


@pytest.mark.parametrize("routing", routed_specs())
def test_lime_routed_sites_match_router_hooks(tok, routing):
    pytest.importorskip("lime_model")
    model = tiny_model("lime", tok, routing=routing, num_hidden_layers=3)
    if routing == "dynamic":  # starts as LLaMA (zero keys): give it keys so that it mixes
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.self_attn.router.keys.normal_()
    hooks = {"last_block": ("model.layers.2", out_of)}
    for i in range(3):
        hooks[f"keys{i}"] = (f"model.layers.{i}.self_attn.k_proj", out_of)
        hooks[f"values{i}"] = (f"model.layers.{i}.self_attn.v_proj", out_of)
        # router output: (keys, values), each (batch, kv_heads, seq, head_dim) -> rows of kv*hd
        hooks[f"rkeys{i}"] = (
            f"model.layers.{i}.self_attn.router",
            lambda a, o: o[0].permute(0, 2, 1, 3).flatten(2),
        )
        hooks[f"rvalues{i}"] = (
            f"model.layers.{i}.self_attn.router",
            lambda a, o: o[1].permute(0, 2, 1, 3).flatten(2),
        )
    refs = reference(model, tok, TEXTS, hooks)
    acts = extract(
        model, tok, TEXTS, sites=SITES + ["routed_keys", "routed_values"], batch_size=2, progress=False
    )
    check(acts, refs, 3)
    for i in range(3):
        torch.testing.assert_close(acts["routed_keys"][i], refs[f"rkeys{i}"])
        torch.testing.assert_close(acts["routed_values"][i], refs[f"rvalues{i}"])
    # a router with several sources mixes earlier layers: not the layer's own W_V output
    if len(model.model.layers[2].self_attn.router.sources) > 1:
        assert not torch.allclose(acts["routed_values"][2], acts["values"][2])


def test_lime_without_routing_has_no_routed_sites(tok):
    pytest.importorskip("lime_model")
    model = tiny_model("lime", tok, routing="none")
    with pytest.raises(ValueError, match="site 'routed_values' is not available for model_type 'lime'"):
        extract(model, tok, TEXTS, sites=["routed_values"], progress=False)


def test_unsupported_model_type_names_supported_and_how_to_register():
    with pytest.raises(
        ValueError, match=r"no extraction adapter for model_type 't5'.*gpt2.*llama.*register_adapter"
    ):
        get_adapter(types.SimpleNamespace(model_type="t5"))


def test_register_adapter_in_a_few_lines(tok, monkeypatch):
    model = tiny_model("llama", tok)
    monkeypatch.setattr(model.config, "model_type", "my_llama")
    monkeypatch.setitem(ADAPTERS, "my_llama", None)  # restored (removed) after the test
    register_adapter(
        "my_llama",
        Adapter(layers="layers", final_norm="norm", sites=proj_sites("self_attn.k_proj", "self_attn.v_proj")),
    )
    acts = extract(model, tok, TEXTS[:1], sites=["values"], layers=[1], progress=False)
    captured = []
    handle = model.model.layers[1].self_attn.v_proj.register_forward_hook(
        lambda m, a, o: captured.append(o[0])
    )
    with torch.no_grad():
        model(**tok(TEXTS[0], return_tensors="pt"))
    handle.remove()
    torch.testing.assert_close(acts["values"][1], captured[0])


@pytest.mark.parametrize(
    ("arch", "value_path"),
    [("llama", "layers.1.self_attn.v_proj"), ("bert", "encoder.layer.1.attention.self.value")],
)
def test_bare_base_models_without_a_head(tok, arch, value_path):
    """Paths are relative to the base model, so AutoModel (no LM head) works as well."""
    model = AutoModel.from_config(tiny_config(arch, len(tok))).eval()
    refs = reference(model, tok, TEXTS, {"values1": (value_path, out_of)})
    acts = extract(model, tok, TEXTS, sites=["hidden", "values"], batch_size=3, progress=False)
    torch.testing.assert_close(acts["hidden"][1], refs["hf_hidden"][1])
    torch.testing.assert_close(acts["values"][1], refs["values1"])


# ---- architectures without a registered adapter: blocks, final norm and projections found generically ----


@pytest.mark.parametrize("arch", ["phi", "mistral", "opt"])
def test_unregistered_causal_lms_give_hidden_final_keys_values(tok, arch, monkeypatch):
    """No adapter registered: X_0..X_{L-1} and ``final`` equal ``output_hidden_states``, X_L the last block's
    output, keys/values the projections' outputs captured by hooks."""
    monkeypatch.delitem(ADAPTERS, "mistral")  # a Mistral-like model of a type nobody registered
    model = tiny_model(arch, tok)
    assert model.config.model_type not in ADAPTERS
    blocks = model.base_model.get_submodule("decoder.layers" if arch == "opt" else "layers")
    prefix = model.base_model_prefix + (".decoder" if arch == "opt" else "")
    hooks = {"last_block": (f"{prefix}.layers.1", out_of)}
    for i in range(2):
        hooks[f"keys{i}"] = (f"{prefix}.layers.{i}.self_attn.k_proj", out_of)
        hooks[f"values{i}"] = (f"{prefix}.layers.{i}.self_attn.v_proj", out_of)
    assert len(blocks) == 2
    refs = reference(model, tok, TEXTS, hooks)
    acts = extract(model, tok, TEXTS, sites=SITES, batch_size=3, progress=False)
    check(acts, refs, 2)


def test_discovered_adapter_without_a_final_norm_offers_no_final(tok):
    """A causal LM whose final representation no module gives (here its final norm is an identity and a hook
    rescales the base model's output): ``hidden`` works, ``final`` is refused in one line, never guessed."""
    model = tiny_model("phi", tok)
    model.model.final_layernorm = torch.nn.Identity()
    model.model.register_forward_hook(lambda m, a, out: out.__class__(last_hidden_state=2 * out[0]))
    from lime_probe.extraction.adapters import adapter_for

    adapter = adapter_for(model)
    assert (adapter.layers, adapter.final_norm, adapter.has_final) == ("layers", None, False)
    with pytest.raises(
        ValueError, match=r"^site 'final' is not available for model_type 'phi'; available: \["
    ):
        extract(model, tok, TEXTS[:1], sites=["final"], progress=False)


def test_blocks_that_cannot_be_found_are_refused_in_one_line(tok):
    from lime_probe.extraction.adapters import discover_adapter

    model = tiny_model("phi", tok)
    model.config.num_hidden_layers = 5  # no ModuleList of 5 blocks
    with pytest.raises(ValueError) as info:
        discover_adapter(model)
    message = str(info.value)
    assert "\n" not in message and message.startswith("no extraction adapter for model_type 'phi', and its")
    assert "num_hidden_layers=5" in message and "register_adapter" in message


@pytest.mark.parametrize(
    ("arch", "blocks", "attn", "mlp"),
    [
        ("gpt2", "transformer.h", "attn", "mlp"),  # TransformerLens: blocks.{i}.hook_attn_out, hook_mlp_out
        ("qwen2", "model.layers", "self_attn", "mlp"),
        ("gpt_neox", "gpt_neox.layers", "attention", "mlp"),
        ("lime", "model.layers", "self_attn", "mlp"),
        ("bert", "bert.encoder.layer", "attention.output.dense", "output.dense"),
        ("phi", "model.layers", "self_attn", "mlp"),  # no adapter: found by name
    ],
)
def test_attn_out_and_mlp_out_match_hooks(tok, arch, blocks, attn, mlp):
    """What each block's attention and MLP add to the residual stream: their modules' outputs, captured by hooks;
    with the residual stream they rebuild each block's output (GPT-2: X_{l+1} = X_l + attn_out + mlp_out)."""
    if arch == "lime":
        pytest.importorskip("lime_model")
    model = tiny_model(arch, tok)
    hooks = {}
    for i in range(2):
        hooks[f"attn{i}"] = (f"{blocks}.{i}.{attn}", out_of)
        hooks[f"mlp{i}"] = (f"{blocks}.{i}.{mlp}", out_of)
    refs = reference(model, tok, TEXTS, hooks)
    acts = extract(model, tok, TEXTS, sites=["hidden", "attn_out", "mlp_out"], batch_size=3, progress=False)
    for i in range(2):
        torch.testing.assert_close(acts["attn_out"][i], refs[f"attn{i}"])
        torch.testing.assert_close(acts["mlp_out"][i], refs[f"mlp{i}"])
        assert acts["mlp_out"][i].shape[1] == 32  # hidden_size wide, not heads
    if arch == "gpt2":
        for i in range(2):
            rebuilt = acts["hidden"][i] + acts["attn_out"][i] + acts["mlp_out"][i]
            torch.testing.assert_close(rebuilt, acts["hidden"][i + 1])
    with pytest.raises(ValueError, match="has no heads"):
        acts.per_head("mlp_out", 0)
