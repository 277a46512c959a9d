"""``attn_pattern``, ``module:PATH`` and fused keys/values against values computed in the test: attention
weights recomputed from the hooked q/k projections (the model's rotary table, a causal mask and a softmax
written here), or from ``output_attentions=True`` under eager attention; module values captured by plain
forward hooks."""

import warnings

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from lime_probe.extraction.adapters import ADAPTERS
from lime_probe.extraction.tracing import extract

# unequal lengths: batches are padded, so the pattern's key positions must be realigned per sequence
TEXTS = ["The cat is on the mat and the dogs are in the garden.", "It was", "A model is a function."]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def build(arch: str, tok, **overrides):
    """A tiny random model of `arch`: the helpers' ones, or Qwen2 (biased projections), Mistral (a sliding
    window of 4 tokens) and Phi-3 (a fused qkv_proj with grouped key/value heads), built from a config."""
    import transformers as tf

    if arch not in ("qwen2", "mistral", "phi3"):
        return tiny_model(arch, tok, **overrides)
    kw = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = {
        "qwen2": tf.Qwen2Config,
        "mistral": lambda **k: tf.MistralConfig(sliding_window=4, **k),
        "phi3": tf.Phi3Config,
    }[arch](**{**kw, **overrides})
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def captured(model, tok, texts, paths: dict[str, str]) -> dict[str, list[torch.Tensor]]:
    """Per name, the value at its ``"module.path:input"`` (first positional argument, by a pre-hook) or
    ``"module.path"`` (the output, the first of a tuple, by a hook), one (t, ...) tensor per text run alone."""
    caps: dict[str, list[torch.Tensor]] = {name: [] for name in paths}
    handles = []
    for name, spec in paths.items():
        path, _, what = spec.partition(":")
        module = model.get_submodule(path)
        if what == "input":
            handles.append(
                module.register_forward_pre_hook(lambda m, a, name=name: caps[name].append(a[0][0]))
            )
        else:
            handles.append(
                module.register_forward_hook(
                    lambda m, a, o, name=name: caps[name].append((o[0] if isinstance(o, tuple) else o)[0])
                )
            )
    try:
        with torch.no_grad():
            for text in texts:
                model(**tok(text, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    return caps


def rotate(x, cos, sin):
    """RoPE written out: x (heads, t, hd), cos/sin (t, hd); the halves rotated as LLaMA's rotate_half."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def softmax_pattern(q, k, heads, kv_heads, rope=None):
    """Causal attention weights (heads, t, t) from q (t, heads*hd) and k (t, kv_heads*hd): RoPE (the model's
    cos/sin) when given, each key head shared by heads/kv_heads query heads, softmax(q k^T / sqrt(hd))."""
    t, hd = q.shape[0], q.shape[1] // heads
    q, k = q.view(t, heads, hd).transpose(0, 1), k.view(t, kv_heads, hd).transpose(0, 1)
    if rope is not None:
        q, k = rotate(q, *rope), rotate(k, *rope)
    k = k.repeat_interleave(heads // kv_heads, 0)
    scores = q @ k.transpose(1, 2) / hd**0.5
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "lime"])
def test_attn_pattern_is_the_softmax_of_the_hooked_queries_and_keys(tok, arch):
    """Each head's weights recomputed from its q/k projections (GPT-2: thirds of c_attn; LIMe: the router's
    routed keys, what its heads attend to, not the W_K output) with RoPE, a causal mask and a softmax."""
    if arch == "lime":
        pytest.importorskip("lime_model")
    model = build(arch, tok, **({"num_hidden_layers": 3} if arch == "lime" else {}))
    tok.padding_side = "left"
    n = model.config.num_hidden_layers
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
    paths = {}
    for i in range(n):
        if arch == "gpt2":
            paths[f"qkv{i}"] = f"transformer.h.{i}.attn.c_attn"
            continue
        attn = model.model.layers[i].self_attn
        paths[f"q{i}"] = f"model.layers.{i}.self_attn.q_proj"
        routed = arch == "lime" and attn.router is not None
        paths[f"k{i}"] = f"model.layers.{i}.self_attn.{'router' if routed else 'k_proj'}"
    caps = captured(model, tok, TEXTS, paths)
    acts = extract(model, tok, TEXTS, sites=["attn_pattern"], batch_size=3, progress=False)
    if arch == "lime":  # the later layers route: their keys are mixtures, not their own W_K output
        assert paths["k2"].endswith("router")
    for s, text in enumerate(TEXTS):
        t = len(tok(text)["input_ids"])
        for i in range(n):
            if arch == "gpt2":
                q, k, _ = caps[f"qkv{i}"][s].chunk(3, -1)
                want = softmax_pattern(q, k, heads, heads)
            else:
                k = caps[f"k{i}"][s]
                k = k if k.dim() == 2 else k.transpose(0, 1).flatten(1)  # router: (kv, t, hd) -> (t, kv*hd)
                x = torch.zeros(1, t, model.config.hidden_size)
                cos, sin = model.model.rotary_emb(x, torch.arange(t)[None])
                want = softmax_pattern(caps[f"q{i}"][s], k, heads, kv_heads, (cos[0], sin[0]))
            torch.testing.assert_close(acts.pattern(i, s), want)


@pytest.mark.parametrize("arch", ["gpt_neox", "mistral", "phi3", "bert", "gpt2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_attn_pattern_equals_eager_output_attentions(tok, arch, side):
    """The weights transformers returns with ``output_attentions=True`` under eager attention, each text run
    alone: GPT-NeoX's partial rotary, Mistral's sliding window, Phi-3, BERT's bidirectional attention. The
    model runs SDPA: the extraction switches to eager, says so once, and switches back."""
    model = build(arch, tok)
    tok.padding_side = side
    assert model.config._attn_implementation == "sdpa"
    texts = [*TEXTS, "The quick brown fox jumps over the lazy dog again and again."]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acts = extract(
            model, tok, texts, sites=["attn_pattern", "hidden"], batch_size=2, max_length=64, progress=False
        )
    notes = [str(w.message) for w in caught if "attn_pattern" in str(w.message)]
    assert len(notes) == 1 and "'sdpa' attention" in notes[0] and "eager" in notes[0] and "\n" not in notes[0]
    assert model.config._attn_implementation == "sdpa" and acts.attn_implementation == "eager"
    heads = model.config.num_attention_heads
    assert acts.per_head("attn_pattern", 0).shape == (len(acts.token_ids), heads, 64)  # W = max_length
    model.set_attn_implementation("eager")
    for s, text in enumerate(texts):
        with torch.no_grad():
            want = model(**tok(text, return_tensors="pt"), output_attentions=True).attentions
        for i in range(2):
            got = acts.pattern(i, s)
            torch.testing.assert_close(got, want[i][0])
            rows = acts.sequences("attn_pattern", i)[s].unflatten(-1, (heads, 64))
            assert not rows[..., got.shape[-1] :].any()  # nothing past the sequence's own tokens
    if arch == "mistral":  # the window is visible: the last token gives no weight to tokens 4 or more back
        assert not acts.pattern(0, 3)[:, -1, :-4].any() and acts.pattern(0, 3)[:, -1, -4:].all()


def test_attn_pattern_of_an_eager_model_warns_nothing_and_pooled_rows_have_no_square(tok):
    model = build("llama", tok)
    model.set_attn_implementation("eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acts = extract(model, tok, TEXTS, sites="attn_pattern", pool="mean", progress=False)
    assert acts.attn_implementation == "eager"
    with pytest.raises(ValueError, match="pattern needs a row per token"):
        acts.pattern(0, 0)


def test_cached_activations_of_two_attention_implementations_do_not_mix(tok, tmp_path):
    """The same weights and texts under SDPA and under eager attention are two cache entries."""
    model = build("llama", tok)
    first = extract(model, tok, TEXTS, sites="hidden", cache_dir=tmp_path, progress=False)
    model.set_attn_implementation("eager")
    second = extract(model, tok, TEXTS, sites="hidden", cache_dir=tmp_path, progress=False)
    assert (first.attn_implementation, second.attn_implementation) == ("sdpa", "eager")
    assert first.shards[0].parent != second.shards[0].parent


MODULES = {  # arch -> (an MLP's down projection, a norm inside each block, a module outside the blocks)
    "gpt2": ("h.{i}.mlp.c_proj", "h.{i}.ln_2", "lm_head"),
    "gpt_neox": ("layers.{i}.mlp.dense_4h_to_h", "layers.{i}.post_attention_layernorm", "lm_head"),
    "qwen2": ("layers.{i}.mlp.down_proj", "layers.{i}.post_attention_layernorm", "lm_head"),
    "mistral": ("layers.{i}.mlp.down_proj", "layers.{i}.input_layernorm", "norm"),
    "phi3": ("layers.{i}.mlp.down_proj", "layers.{i}.post_attention_layernorm", "lm_head"),
    "lime": ("layers.{i}.mlp.down_proj", "layers.{i}.input_layernorm", "lm_head"),
}


@pytest.mark.parametrize("arch", list(MODULES))
def test_module_sites_equal_forward_hooks(tok, arch):
    """Outputs and inputs of modules inside each block ({i}) and outside them, relative to the base model or the
    root, asked for out of execution order: each equals what a hook on that module captured."""
    if arch == "lime":
        pytest.importorskip("lime_model")
    model = build(arch, tok)
    tok.padding_side = "right"
    down, norm, outside = MODULES[arch]
    prefix = model.base_model_prefix + "."
    root = outside if outside == "lm_head" else prefix + outside
    sites = [f"module:{outside}", f"module:{down}", f"module:{norm}", f"module:{down}:input", "mlp_out"]
    acts = extract(model, tok, TEXTS, sites=sites, batch_size=3, progress=False)
    paths = {"outside": root}
    for i in range(2):
        paths |= {f"down{i}": prefix + down.format(i=i), f"in{i}": prefix + down.format(i=i) + ":input"}
        paths |= {f"norm{i}": prefix + norm.format(i=i)}
    caps = {name: torch.cat(v) for name, v in captured(model, tok, TEXTS, paths).items()}
    assert acts.layers(f"module:{outside}") == [0]  # no {i}: one entry
    torch.testing.assert_close(acts[f"module:{outside}"][0], caps["outside"])
    for i in range(2):
        torch.testing.assert_close(acts[f"module:{down}"][i], caps[f"down{i}"])
        torch.testing.assert_close(acts[f"module:{down}:input"][i], caps[f"in{i}"])
        torch.testing.assert_close(acts[f"module:{norm}"][i], caps[f"norm{i}"])
    inner = 128 if arch == "gpt2" else 64  # the MLP's inner width (GPT-2's: 4 x hidden), not hidden_size
    assert acts[f"module:{down}:input"][0].shape[1] == inner


def test_module_site_paths_may_start_at_the_root_and_layers_select_blocks(tok):
    model = build("llama", tok)
    acts = extract(
        model, tok, TEXTS, sites=["module:model.layers.{i}.mlp", "mlp_out"], layers=[-1], progress=False
    )
    assert acts.layers("module:model.layers.{i}.mlp") == [1]
    hooked = captured(model, tok, TEXTS, {"mlp": "model.layers.1.mlp"})["mlp"]
    torch.testing.assert_close(acts["module:model.layers.{i}.mlp"][1], torch.cat(hooked))


@pytest.mark.parametrize(
    ("site", "message"),
    [
        ("module:layers.{i}.mlp.dwn_proj", r"^site 'module:layers.\{i\}.mlp.dwn_proj' names no module of "
         r"LlamaForCausalLM; nearest: layers.\{i\}.mlp.down_proj"),
        ("module:blocks.{i}", r"names no module of LlamaForCausalLM; nearest: layers.\{i\}"),
        ("module:layers.{i}.self_attn.rotary", r"names no module"),
        ("module:layers.{i}.mlp:inputs", r"malformed site 'module:layers.\{i\}.mlp:inputs': write module:PATH"),
        ("module:layers.{j}.mlp", r"malformed site"),
    ],
)  # fmt: skip
def test_bad_module_sites_are_refused_in_one_line(tok, site, message):
    with pytest.raises(ValueError, match=message) as info:
        extract(build("llama", tok), tok, TEXTS[:2], sites=site, progress=False)
    assert "\n" not in str(info.value)


def test_phi3_keys_and_values_are_read_from_its_fused_projection(tok):
    """Phi-3's qkv_proj is [q | k | v] with 4 query heads and 2 key/value heads: keys are columns 32..47 and
    values 48..63 (equal thirds would be wrong)."""
    model = build("phi3", tok)
    acts = extract(model, tok, TEXTS, sites=["keys", "values"], batch_size=3, progress=False)
    qkv = {i: torch.cat(v) for i, v in enumerate(
        captured(model, tok, TEXTS, {i: f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)}).values()
    )}  # fmt: skip
    for i in range(2):
        torch.testing.assert_close(acts["keys"][i], qkv[i][:, 32:48])
        torch.testing.assert_close(acts["values"][i], qkv[i][:, 48:64])
    assert acts.per_head("keys", 0).shape[1:] == (2, 8)


def test_an_unregistered_fused_projection_offers_no_keys(tok):
    """Falcon fuses its projections in a layout of its own and has no adapter: its keys are refused in one line;
    its attention predates transformers' attention interface (its second output is not always the softmax
    weights), so attn_pattern is refused too, while attn_out, found by name, equals a hook's capture."""
    import transformers as tf

    assert "falcon" not in ADAPTERS
    config = tf.FalconConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(
        ValueError, match=r"^site 'keys' is not available for model_type 'falcon'; available: \["
    ):
        extract(model, tok, TEXTS, sites="keys", progress=False)
    with pytest.raises(
        ValueError, match=r"^attn_pattern reads the weights .* FalconForCausalLM does not use it"
    ):
        extract(model, tok, TEXTS, sites="attn_pattern", progress=False)
    acts = extract(model, tok, TEXTS, sites="attn_out", progress=False)
    hooked = captured(model, tok, TEXTS, {"attn": "transformer.h.1.self_attention"})["attn"]
    torch.testing.assert_close(acts["attn_out"][1], torch.cat(hooked))


def test_a_module_value_that_is_not_one_row_per_token_is_refused_in_one_line(tok):
    """LIMe's router gives (batch, kv_heads, seq, head_dim): not (batch, seq, ...), so it is named, not misread."""
    pytest.importorskip("lime_model")
    with pytest.raises(ValueError, match=r"^site 'module:layers.\{i\}.self_attn.router' layer 0 gives a "
                       r"\(2, 2, \d+, 8\) tensor, not \(batch, seq, ...\) = \(2, \d+\)$"):  # fmt: skip
        extract(
            build("lime", tok), tok, TEXTS[:2], sites="module:layers.{i}.self_attn.router", progress=False
        )
