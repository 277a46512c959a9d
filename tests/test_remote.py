"""The remote (NDIF) path of `extract`: a model loaded without weights builds and serialises its request
with the inputs on the CPU. No server is reached: the request is captured where nnsight would send it."""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_checkpoint
from nnsight.modeling.transformers import TransformersModel

from lime_probe.extraction.tracing import extract


class Sent(Exception):
    """Raised by `Capture` where the request would leave for the server."""


class Capture:
    """A backend in place of nnsight's RemoteBackend: serialises the trace as it does, keeps the request's
    inputs and bytes, and stops there."""

    def __init__(self):
        self.requests: list[tuple[dict, bytes]] = []

    def __call__(self, tracer) -> None:
        from nnsight.schema.request import RequestModel

        self.requests.append((dict(tracer.kwargs), RequestModel.serialize(tracer, compress=False)))
        raise Sent


@pytest.mark.parametrize("arch", ["llama", "lime"])
def test_a_model_without_weights_sends_its_inputs_from_the_cpu(tmp_path, monkeypatch, arch):
    ckpt = save_tiny_checkpoint(tmp_path / arch, arch)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    # as a user of NDIF builds it: the architecture on `meta`, no weights read (`dispatch=False`)
    model = TransformersModel(str(ckpt), tokenizer=tok, dispatch=False, task="text-generation")
    assert {p.device.type for p in model._module.parameters()} == {"meta"}
    model.repo_id = "org/tiny"  # as if built from the hub: NDIF serves hub ids only
    capture = Capture()
    monkeypatch.setattr(model, "_remote_backend", lambda *args: capture)
    text = "The cat is on the mat."
    with pytest.raises(Sent):
        extract(model, tok, [text], sites=["hidden", "values"], logprobs=True, progress=False, remote=True)
    ((inputs, request),) = capture.requests
    assert len(request) > 0  # serialised as nnsight's RemoteBackend would send it
    ids = tok(text)["input_ids"]
    assert set(inputs) >= {"input_ids", "attention_mask"}
    assert all(v.device.type == "cpu" for v in inputs.values())  # not the weights' `meta`
    assert inputs["input_ids"].tolist() == [ids]  # the data itself travels, not a meta placeholder
    assert inputs["attention_mask"].tolist() == [[1] * len(ids)]
    # building the request touched no weight: the model is still the meta skeleton
    assert {p.device.type for p in model._module.parameters()} == {"meta"}
    # the cache is keyed by the weights: without them it is refused before anything is sent or written
    with pytest.raises(ValueError, match="holds none.*without cache_dir"):
        extract(model, tok, [text], progress=False, remote=True, cache_dir=tmp_path / "cache")
    assert len(capture.requests) == 1 and not (tmp_path / "cache").exists()


def test_the_local_simulation_of_the_remote_path_gives_the_local_activations(tmp_path):
    """``remote="local"``: nnsight serialises the request, deserialises it with this package hidden (as a
    server that lacks it) and runs it here, on a loaded model."""
    from lime_probe.extraction.loading import load

    model, tok = load(save_tiny_checkpoint(tmp_path / "m", "lime"))
    texts = ["The cat is on the mat.", "A dog ran far away."]
    want = extract(model, tok, texts, sites=["hidden", "routed_values"], logprobs=True, progress=False)
    got = extract(
        model, tok, texts, sites=["hidden", "routed_values"], logprobs=True, progress=False, remote="local"
    )
    for site in ("hidden", "routed_values"):
        for layer in want.layers(site):
            torch.testing.assert_close(got[site][layer], want[site][layer], rtol=0, atol=0)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)


def test_a_model_from_a_local_folder_is_refused_for_ndif_in_one_line(tmp_path):
    from lime_probe.extraction.loading import load

    model, tok = load(save_tiny_checkpoint(tmp_path / "m", "llama"))
    with pytest.raises(ValueError, match=r"^NDIF serves hub ids only, and this model comes from '/") as error:
        extract(model, tok, ["The cat is on the mat."], progress=False, remote=True)
    assert "\n" not in str(error.value)
