"""The entropy analysis computes where the checkpoint's model is (`specs.entropy.model_device`): the device its
input embedding runs on, the CPU for weights on ``meta``; on the CPU its numbers are those computed where
the extracted values are."""

from __future__ import annotations

import pytest
import torch
from helpers import CORPUS, save_tiny_checkpoint, tiny_model

from lime_probe.extraction.settings import Extraction


@pytest.mark.parametrize("mix", [False, True])
def test_the_entropy_runs_on_the_models_device_with_the_same_numbers(monkeypatch, tmp_path, mix):
    from lime_probe.probes import entropy as probe
    from lime_probe.specs import ANALYSES, load_checkpoints

    lime = save_tiny_checkpoint(tmp_path / "lime", "lime")
    cks = load_checkpoints([str(lime)], ["LIMe"], "cpu")
    knobs = {"unit": "documents", **({"mix_router": str(lime)} if mix else {})}
    real, seen = probe.stream_entropy, []

    def recording(chunks, config, **kw):
        seen.append(kw["device"])
        return real(chunks, config, **kw)

    monkeypatch.setattr(probe, "stream_entropy", recording)
    rows = ANALYSES["entropy"].run(cks, CORPUS * 3, Extraction(max_length=16), **knobs).rows
    assert seen == [torch.device("cpu")] * len(rows) and len(rows) == (2 if mix else 4)
    monkeypatch.setattr(
        probe, "stream_entropy", lambda c, config, **kw: real(c, config, **{**kw, "device": None})
    )
    where_the_values_are = ANALYSES["entropy"].run(cks, CORPUS * 3, Extraction(max_length=16), **knobs).rows
    assert [r["entropy_mean"] for r in rows] == [r["entropy_mean"] for r in where_the_values_are]


def test_the_models_device_is_its_embeddings_and_the_cpu_for_meta_weights():
    from lime_probe.specs.base import Checkpoint
    from lime_probe.specs.entropy import model_device

    model = tiny_model("llama")
    assert model_device(Checkpoint("m", "m", model, None)) == torch.device("cpu")
    assert model_device(Checkpoint("m", "m", model.to("meta"), None)) == torch.device("cpu")
