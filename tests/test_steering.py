"""Steering during generation (`generate_with_edits`), checked against Hugging Face ``generate`` itself: run
plainly, with a hand-written forward hook on one block, and on a LIMe whose router weights were set to
self-only by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import save_tiny_checkpoint

import lime_probe
from lime_probe.interventions.edits import Edit, RouteEdit
from lime_probe.interventions.steering import generate_with_edits

PROMPTS = ["The cat is on the", "She was"]
NEW = 6
SCALE = 8.0
# tiny LIMe (routing "full", its own cache path), LLaMA (LIMe with routing "none") and GPT-2
CHECKPOINTS = {
    "lime": ("lime", {"num_hidden_layers": 3}),
    "llama": ("lime", {"routing": "none"}),
    "gpt2": ("gpt2", {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("steering")
    return {
        name: lime_probe.load(save_tiny_checkpoint(root / name, arch, **overrides))
        for name, (arch, overrides) in CHECKPOINTS.items()
    }


def blocks(hf) -> torch.nn.ModuleList:
    return hf.transformer.h if hf.config.model_type == "gpt2" else hf.model.layers


def hf_generate(hf, tok, **kwargs) -> torch.Tensor:
    """Greedy ``generate`` (with `kwargs`) on the tokenizer's own left-padded batch of the prompts."""
    batch = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    return hf.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id, **kwargs)


def steering_vector(hf) -> torch.Tensor:
    return torch.randn(hf.config.hidden_size, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_no_edits_give_generates_own_tokens(models, name):
    model, tok = models[name]
    out = generate_with_edits(model, tok, PROMPTS, max_new_tokens=NEW)
    expected = hf_generate(model._module, tok)
    assert torch.equal(out.sequences, expected)
    width = expected.shape[1] - NEW
    for i, prompt in enumerate(PROMPTS):
        assert out.prompt_ids[i].tolist() == tok(prompt)["input_ids"]
        new = expected[i, width:].tolist()
        eos = new.index(tok.eos_token_id) + 1 if tok.eos_token_id in new else NEW
        assert out.token_ids[i].tolist() == new[:eos]
        assert out.texts[i] == tok.decode(new[:eos], skip_special_tokens=True)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_steering_vector_equals_a_forward_hook_on_its_block(models, name):
    model, tok = models[name]
    hf = model._module
    v = steering_vector(hf)
    steered = generate_with_edits(
        model, tok, PROMPTS, [Edit("hidden", 2, "add", value=v, scale=SCALE)], max_new_tokens=NEW
    )
    # hidden 2 is block 1's output; the hook adds at every token, padding too (which no real token reads)
    handle = blocks(hf)[1].register_forward_hook(lambda module, args, out: out + SCALE * v)
    try:
        expected = hf_generate(hf, tok)
    finally:
        handle.remove()
    assert torch.equal(steered.sequences, expected)
    assert not torch.equal(steered.sequences, hf_generate(hf, tok))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_positions_and_sequences_select_the_prompt_and_the_generated_tokens(models, name):
    model, tok = models[name]
    hf = model._module
    v = steering_vector(hf)
    length = len(tok(PROMPTS[0])["input_ids"])
    edits = [
        Edit("hidden", 1, "add", value=v, scale=SCALE, positions=[-1], sequences=[1]),  # 2nd prompt's last
        Edit(
            "hidden", 1, "add", value=v, scale=SCALE, positions=[length + 1], sequences=[0]
        ),  # 2nd new token
    ]
    steered = generate_with_edits(model, tok, PROMPTS, edits, max_new_tokens=NEW)
    calls = []

    def hook(module, args, out):
        out = out.clone()
        if not calls:  # the prompts' pass (left padded: each prompt's last token is the last column)
            out[1, -1] += SCALE * v
        elif len(calls) == 2:  # the pass computing position length + 1 of the first (longest) prompt
            out[0, -1] += SCALE * v
        calls.append(out.shape[1])
        return out

    handle = blocks(hf)[0].register_forward_hook(hook)
    try:
        expected = hf_generate(hf, tok)
    finally:
        handle.remove()
    assert torch.equal(steered.sequences, expected)
    plain = hf_generate(hf, tok)
    width = plain.shape[1] - NEW
    assert torch.equal(steered.sequences[0, : width + 2], plain[0, : width + 2])  # before the edit
    assert not torch.equal(steered.sequences, plain)


@pytest.mark.parametrize("kwargs", [{"num_beams": 2, "num_return_sequences": 2}, {"use_cache": False}])
def test_steering_one_prompt_with_beams_or_without_a_cache_equals_a_forward_hook(models, kwargs):
    model, tok = models["lime"]
    hf = model._module
    v = steering_vector(hf)
    edit = Edit("hidden", 1, "add", value=v, scale=SCALE, sequences=[1])
    steered = generate_with_edits(model, tok, PROMPTS, [edit], max_new_tokens=NEW, **kwargs)

    def hook(module, args, out):
        out = out.clone()
        out[len(out) // 2 :] += SCALE * v  # the second prompt's rows (each prompt's rows are consecutive)
        return out

    handle = blocks(hf)[0].register_forward_hook(hook)
    try:
        expected = hf_generate(hf, tok, **kwargs)
    finally:
        handle.remove()
    assert torch.equal(steered.sequences, expected)
    rows = len(expected) // len(PROMPTS)
    assert [p.tolist() for p in steered.prompt_ids] == [
        tok(p)["input_ids"] for p in PROMPTS for _ in range(rows)
    ]


def test_cutting_every_cross_layer_read_equals_self_only_router_weights(models):
    model, tok = models["lime"]
    hf = model._module
    routers = [layer.self_attn.router for layer in hf.model.layers]
    cuts = [RouteEdit(i) for i, router in enumerate(routers) if len(router.sources) > 1]
    cut = generate_with_edits(model, tok, PROMPTS, routes=cuts, max_new_tokens=NEW)
    self_only = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in self_only.model.layers:
            router = layer.self_attn.router
            if (
                router.weight is not None
            ):  # weight [kv, S * kv]: the own layer's heads are the last kv columns
                router.weight[:, : -router.num_kv_heads] = 0.0
    expected = hf_generate(self_only, tok)
    assert torch.equal(cut.sequences, expected)
    assert not torch.equal(expected, hf_generate(hf, tok))
    assert torch.equal(
        generate_with_edits(model, tok, PROMPTS, max_new_tokens=NEW).sequences, hf_generate(hf, tok)
    )


@pytest.mark.parametrize(
    "name, edits, routes, message",
    [
        ("lime", [Edit("hidden", 9, "add", value=torch.ones(32))], [], "layer 9 out of range"),
        ("lime", [Edit("hidden", 1, "add", value=torch.ones(31))], [], r"value is \(31,\).*\(32,\)"),
        ("lime", [Edit("values", 1, "set", value=torch.ones(3, 16))], [], r"value is \(3, 16\)"),
        ("lime", [Edit("hidden", 1, "zero", sequences=[2])], [], "sequence 2 out of range"),
        ("lime", [Edit("hidden", 1, "zero", positions=[-50])], [], "-50 is before the first token of a"),
        ("lime", [], [RouteEdit(5)], "route edit layer 5 out of range"),
        ("llama", [], [RouteEdit(1)], "no routers"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_generating(models, name, edits, routes, message):
    model, tok = models[name]
    passes = []
    handle = model._module.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        with pytest.raises(ValueError, match=message) as error:
            generate_with_edits(model, tok, PROMPTS, edits, routes=routes, max_new_tokens=NEW)
    finally:
        handle.remove()
    assert "\n" not in str(error.value)
    assert not passes
