"""The separability mixing null (``lime-probe separability --mix-router``): LLaMA's values mixed across its
layers by a LIMe's routers, then probed, against the same written here as a plain loop; and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import CORPUS, save_tiny_checkpoint

from lime_probe import cli

DOCS = CORPUS * 8
WORDS = (" is", " are", " was", " were")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    out = {arch: save_tiny_checkpoint(root / arch, arch) for arch in ("llama", "lime")}
    out["lime-3"] = save_tiny_checkpoint(root / "lime-3", "lime", num_hidden_layers=3)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n\n".join(DOCS) + "\n")
    return path


def separability(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in ("separability", *argv, "--threads", 1)])
    return code, capsys.readouterr().err


def by_hand_mixing(router_model, values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """out[i][n, h * hd + e] = sum over layer i's sources p and heads q of C_i[h, p, q] values[p][n, q * hd + e],
    one term at a time (C_i: layer i's router coefficients, one per head pair for static routing)."""
    module = router_model._module
    kv, hd = module.config.num_key_value_heads, module.config.head_dim
    out = {}
    for i, layer in enumerate(module.model.layers):
        router = layer.self_attn.router
        C = router.coefficients(None).detach().double().numpy()[0]  # (kv, sources, kv, 1)
        n = values[0].shape[0]
        mixed = np.zeros((n, kv * hd))
        for h in range(kv):
            for p, j in enumerate(router.sources):
                for q in range(kv):
                    mixed[:, h * hd : (h + 1) * hd] += C[h, p, q, 0] * values[j][:, q * hd : (q + 1) * hd]
        out[i] = mixed
    return out


def test_llama_values_mixed_by_lime_routers_then_probed_as_written_here(capsys, tmp_path, ckpts, text_file):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.separability import token_separability

    out = tmp_path / "null"
    code, err = separability(
        capsys, "--ckpt", ckpts["llama"], "--label", "LLaMA", "--mix-router", ckpts["lime"], "--data", text_file,
        "--max-length", 32, "--no-cache", "--seed", 1, "--method", "logreg", "--allow-small-samples",
        "--out", out,
    )  # fmt: skip
    assert code == 0, err
    rows = json.loads((out / "separability_values.json").read_text())["rows"]
    assert {(r["model"], r["site"], r["mix_router"]) for r in rows} == {
        ("LLaMA", "router_mixed_values", str(ckpts["lime"]))
    }
    llama, tok = load(ckpts["llama"])
    lime, _ = load(ckpts["lime"])
    ids = {w: tok.encode(w, add_special_tokens=False)[0] for w in WORDS}
    acts = extract(llama, tok, DOCS, sites=["values"], max_length=32, progress=False)
    keep = np.isin(acts.token_ids.numpy(), list(ids.values()))
    values = {layer: acts["values"][layer].double().numpy()[keep] for layer in acts.layers("values")}
    y = np.array([{i: w for w, i in ids.items()}[int(t)] for t in acts.token_ids[keep]], dtype=object)
    mixed = by_hand_mixing(lime, values)
    assert not np.allclose(mixed[1], values[1])  # layer 1 reads layer 0 too: not the values themselves
    want = token_separability(mixed, y, method="logreg", seed=1, classes=list(WORDS), progress=False)
    assert [r["layer"] for r in rows] == want.layers
    np.testing.assert_allclose([r["accuracy_mean"] for r in rows], want.accuracy_mean, atol=1e-12)
    np.testing.assert_allclose(
        [r["feature_norm"] for r in rows], [np.linalg.norm(mixed[la], axis=1).mean() for la in want.layers]
    )


@pytest.mark.parametrize(
    "router, extra, message",
    [
        ("llama", (), "--mix-router {llama}: LlamaForCausalLM is not a LIMe model"),
        ("lime-3", (), "--mix-router {lime-3} has 3 layers and llama 2"),
        ("lime", ("--site", "hidden"), "--mix-router mixes the values; --site hidden cannot go with it"),
    ],
)
def test_mixing_refusals_are_one_line_exit_2_and_write_nothing(
    capsys, tmp_path, ckpts, text_file, router, extra, message
):
    out = tmp_path / "o"
    code, err = separability(
        capsys, "--ckpt", ckpts["llama"], "--mix-router", ckpts[router], "--data", text_file, *extra,
        "--allow-small-samples", "--out", out,
    )  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message.format(**{k: str(v) for k, v in ckpts.items()}) in err
    assert not out.exists()
