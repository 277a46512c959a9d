"""Every architecture transformers ships a config for, built at toy size: each of ``final``, ``attn_out``,
``mlp_out`` and ``attn_pattern`` is either extracted equal to forward hooks on the modules it names (and, for
a model of an unregistered type, ``attn_out``/``mlp_out`` rebuild the residual stream), or refused in one line
naming the model type. A site that cannot be placed with certainty is refused, never guessed."""

from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch
import transformers as tf
from helpers import tiny_model, tiny_tokenizer

from lime_probe.extraction.adapters import ADAPTERS, adapter_for
from lime_probe.extraction.batching import first_position_of
from lime_probe.extraction.tracing import extract

TEXTS = ["The cat is on the mat and the dogs are in the garden.", "It was", "A model is a function."]
CHECKED = ("final", "attn_out", "mlp_out", "attn_pattern")
# A quick subset: registered types and types found without an adapter, residual added inside the block's modules
# (BLOOM), an embedding norm beside the final norm (ModernBERT), parallel blocks (Falcon, Phi, GPT-NeoX).
QUICK = ("bloom", "opt", "modernbert", "gpt2", "llama", "gpt_neox", "falcon", "phi")
# Registered types whose attn_out/mlp_out are documented as the modules' outputs before a norm the block applies
# to them (Gemma 2's, OLMo 2's post-norms) or before the residual add and norm of a post-norm block (BERT's).
# HyperConnections' blocks give the sum of their n residual streams.
NOT_ADDED = {"gemma2", "olmo2", "bert", "roberta", "xlm-roberta", "camembert", "hyperconnections"}
TOY = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_kv_heads=4,
    intermediate_size=64,
    ffn_dim=64,
    ffn_hidden_size=64,
    word_embed_proj_dim=32,
    head_dim=8,
    max_position_embeddings=128,
)
MAX_PARAMETERS = 2_000_000  # a type whose default config keeps a large width somewhere is skipped


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def toy_model(model_type: str, vocab: int) -> torch.nn.Module:
    """A random model of `model_type` built from its default config shrunk to `TOY` (2 layers, hidden 32,
    4 heads), eager attention, float32, eval mode: its causal LM, else its masked LM; skipped with the reason
    where it cannot be built so."""
    try:
        config = tf.CONFIG_MAPPING[model_type]()
    except Exception as error:  # noqa: BLE001  a default config its own validation refuses
        pytest.skip(f"{model_type}: no valid default config ({type(error).__name__})")
    for name, value in {**TOY, "vocab_size": vocab, "pad_token_id": 0}.items():
        with contextlib.suppress(Exception):  # derived, validated or per layer (Falcon's head_dim): kept
            if hasattr(config, name) or name == "pad_token_id":
                setattr(config, name, value)
    kind = type(config)
    auto = (
        tf.AutoModelForCausalLM
        if kind in tf.MODEL_FOR_CAUSAL_LM_MAPPING
        else tf.AutoModelForMaskedLM
        if kind in tf.MODEL_FOR_MASKED_LM_MAPPING
        else None
    )
    if auto is None:
        pytest.skip(f"{model_type}: no causal or masked LM")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):  # sized first, without memory: a default config may keep a 7B width
                size = sum(p.numel() for p in auto.from_config(config).parameters())
            if size > MAX_PARAMETERS:
                pytest.skip(f"{model_type}: not toy-sized from its default config")
            torch.manual_seed(0)
            model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
    except Exception as error:  # noqa: BLE001  many types need more than a default config
        pytest.skip(f"{model_type}: does not build at toy size ({type(error).__name__})")
    return model.eval()


def hooked(
    model: torch.nn.Module, tok, paths: dict[str, str], weights: frozenset[str] = frozenset()
) -> dict[str, list]:
    """Each text run alone with forward hooks on the modules at `paths` (from the base model; "" is the base
    model itself, "head" the model's output embedding, whose input is taken): per name, a list over texts of the
    module's output (its second output for names in `weights`), one row per token."""
    base = model.base_model
    caps: dict[str, list] = {name: [] for name in paths}

    def hook(name):
        def take(module, args, out):
            value = args[0] if name == "head" else out[1] if name in weights else out
            value = value if isinstance(value, torch.Tensor) else value[0]
            # copied now: a block may add to it in place later (Falcon's MLP output); (tokens, ...) where flattened
            caps[name].append((value[0] if len(value) == 1 else value).clone())

        return take

    modules = {
        n: model.get_output_embeddings() if n == "head" else base.get_submodule(p) for n, p in paths.items()
    }
    handles = [module.register_forward_hook(hook(n)) for n, module in modules.items()]
    try:
        with torch.no_grad():
            for text in TEXTS:
                model(input_ids=tok(text, return_tensors="pt").input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return caps


def check_architecture(model_type: str, tok) -> dict[str, bool]:
    """Check every site of `CHECKED` on a toy `model_type` model; which of them it offers."""
    model = toy_model(model_type, len(tok))
    try:
        adapter = adapter_for(model)
    except ValueError as error:
        assert "\n" not in str(error) and repr(model_type) in str(error)
        pytest.skip(f"{model_type}: blocks not found, refused in one line")
    block_sites = adapter.block_sites(model.config)
    offered = {s: s in block_sites for s in CHECKED} | {"final": adapter.has_final}
    for site in (s for s in CHECKED if not offered[s]):
        with pytest.raises(ValueError) as info:
            extract(model, tok, TEXTS[:1], sites=[site], progress=False)
        message = str(info.value)  # naming the model type, or (attn_pattern) the attention it does not use
        assert "\n" not in message and (
            f"model_type {model_type!r}" in message or "attention interface" in message
        )
    sites = [s for s in CHECKED if offered[s]]
    if not sites:
        return offered
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    if "position_ids" in inspect.signature(model.forward).parameters:
        with torch.no_grad():
            own = model(input_ids=ids, output_hidden_states=True).hidden_states[0]
            first = first_position_of(
                model
            )  # what extraction passes: RoBERTa-style models start after padding
            counted = model(
                input_ids=ids,
                position_ids=first + torch.arange(ids.shape[1])[None],
                output_hidden_states=True,
            )
        if not torch.allclose(own, counted.hidden_states[0]):
            pytest.xfail(f"{model_type}: counts positions in a way extraction does not know")
    try:  # a sequence a batch: models that mix over the sequence (FNet, ConvBERT) see no padding
        acts = extract(model, tok, TEXTS, sites=["hidden", *sites], batch_size=1, progress=False)
    except ValueError as error:  # refused for a reason of its own (e.g. attention weights it does not return)
        assert "\n" not in str(error)
        pytest.skip(f"{model_type}: extraction refused: {error}")
    n = len(model.base_model.get_submodule(adapter.layers))
    paths = {"base": "", "head": ""}
    if adapter.final_norm:
        paths["final"] = adapter.final_norm
    for i in range(n):
        paths |= {f"block{i}": f"{adapter.layers}.{i}"}
        paths |= {f"{s}{i}": f"{adapter.layers}.{i}.{block_sites[s][0]}" for s in sites if s in block_sites}
    refs = hooked(model, tok, paths, frozenset(f"attn_pattern{i}" for i in range(n)))
    if offered["final"]:
        module = "final" if adapter.final_norm else f"block{n - 1}"
        torch.testing.assert_close(acts["final"][0], torch.cat(refs[module]))
        # what the head reads (a masked LM's head transforms it first: the base model's output, where it runs)
        reference = "base" if refs["base"] or not refs["head"] else "head"
        torch.testing.assert_close(acts["final"][0], torch.cat(refs[reference]))
    for i in range(n):
        for site in ("attn_out", "mlp_out"):
            if offered[site]:
                torch.testing.assert_close(acts[site][i], torch.cat(refs[f"{site}{i}"]))
        if offered["attn_pattern"]:
            for k, weights in enumerate(refs[f"attn_pattern{i}"]):
                torch.testing.assert_close(acts.pattern(i, k), weights)
        if offered["attn_out"] and (model_type not in ADAPTERS or model_type not in NOT_ADDED):
            rebuilt = acts["hidden"][i] + acts["attn_out"][i] + acts["mlp_out"][i]
            torch.testing.assert_close(rebuilt, acts["hidden"][i + 1], rtol=1e-5, atol=1e-5)
    return offered


@pytest.mark.parametrize("model_type", QUICK)
def test_quick_architectures_extract_what_hooks_see_or_refuse(tok, model_type):
    offered = check_architecture(model_type, tok)
    assert offered["final"]  # each of these has a final norm (or, an encoder, its last block's output)
    if model_type == "bloom":  # its attention and MLP modules add the residual themselves
        assert not offered["attn_out"] and not offered["mlp_out"]


def causal_or_masked_types() -> list[str]:
    return sorted(
        t
        for t, config in tf.CONFIG_MAPPING.items()
        if config in tf.MODEL_FOR_CAUSAL_LM_MAPPING or config in tf.MODEL_FOR_MASKED_LM_MAPPING
    )


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in causal_or_masked_types() if t not in QUICK])
def test_every_architecture_extracts_what_hooks_see_or_refuses(tok, model_type):
    check_architecture(model_type, tok)


def test_bloom_attn_out_is_refused_in_one_line_naming_the_type(tok):
    model = toy_model("bloom", len(tok))
    for site in ("attn_out", "mlp_out"):
        with pytest.raises(ValueError, match=rf"^site '{site}' is not available for model_type 'bloom'; "):
            extract(model, tok, TEXTS[:1], sites=[site], progress=False)


def test_opt_fc1_and_fc2_are_read_per_block(tok):
    """OPT flattens its tokens before fc1: the rows come back one per token, equal to hooks."""
    model = tiny_model("opt", tok)
    acts = extract(
        model, tok, TEXTS, sites=["module:layers.{i}.fc1", "module:layers.{i}.fc2"], progress=False
    )
    refs = hooked(model, tok, {"fc1": "decoder.layers.1.fc1", "fc2": "decoder.layers.1.fc2"})
    torch.testing.assert_close(acts["module:layers.{i}.fc1"][1], torch.cat(refs["fc1"]))
    torch.testing.assert_close(acts["module:layers.{i}.fc2"][1], torch.cat(refs["fc2"]))
    assert acts["module:layers.{i}.fc1"][1].shape == (len(acts.token_ids), 64)


def test_logit_lens_refuses_rows_selected_by_token_ids(tok):
    from lime_probe.probes.logit_lens import logit_lens

    model = tiny_model("llama", tok)
    ids = tok(" is").input_ids
    acts = extract(model, tok, TEXTS, sites="hidden", token_ids=ids, progress=False)
    with pytest.raises(ValueError, match=r"^the logit lens needs every token's row: .*no token_ids$"):
        logit_lens(model, acts, progress=False)
