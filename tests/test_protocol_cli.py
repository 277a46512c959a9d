"""The measurement protocol (issue 8) from the command line: each option against a computation written here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import CORPUS, save_tiny_checkpoint

from lime_probe import cli

DOCS = CORPUS * 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {arch: save_tiny_checkpoint(root / arch, arch) for arch in ("llama", "lime")}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n\n".join(DOCS) + "\n")
    return path


def run_ok(capsys, *argv) -> str:
    code = cli.main([str(a) for a in argv] + ["--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out + err


def read_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def numpy_lime_entropy(seqs: list[np.ndarray], alpha: float = 0.5, eps: float = 1e-5) -> np.ndarray:
    """The official code's entropy per sequence, from the formula: z-score over all tokens of the layer,
    eigenvalues of each sequence's t x t Gram, p = lambda / trace, Renyi order alpha."""
    rows = np.concatenate(seqs).astype(np.float64)
    mu, sd = rows.mean(0), rows.std(0, ddof=1)
    out = []
    for z in seqs:
        z = (z.astype(np.float64) - mu) / (sd + eps)
        K = z @ z.T
        lam = np.linalg.eigvalsh(K)
        lam[lam < lam.max() * K.shape[0] * np.finfo(np.float64).eps] = 0.0
        p = lam / np.trace(K)
        out.append(np.log((p**alpha).sum()) / (1 - alpha))
    return np.array(out)


def manual_windows(tok, texts, window: int, count: int, seed: int) -> list[list[int]]:
    """[BOS] + tokens + [EOS] per document, concatenated, cut into windows, `count` drawn with `seed`."""
    stream = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        if ids:
            stream += [tok.bos_token_id, *ids, tok.eos_token_id]
    starts = [k * window for k in range(len(stream) // window)]
    picked = sorted(np.random.default_rng(seed).choice(starts, size=count, replace=False).tolist())
    return [stream[s : s + window] for s in picked]


def test_entropy_windows_equal_hand_built_windows(capsys, tmp_path, ckpts, text_file):
    from lime_probe.extraction import extract
    from lime_probe.loading import load

    out = tmp_path / "o"
    common = ["--data", text_file, "--site", "values", "--no-cache", "--seed", 2]
    run_ok(
        capsys, "entropy", "--ckpt", ckpts["llama"], "--ckpt", ckpts["lime"], *common,
        "--window", 16, "--num-windows", 6, "--out", out,
    )  # fmt: skip
    rows = read_rows(out / "entropy_values.json")
    for label in ("llama", "lime"):
        model, tok = load(ckpts[label])
        windows = manual_windows(tok, DOCS, 16, 6, seed=2)
        acts = extract(model, tok, windows, sites=["values"], max_length=16, pretokenized=True, progress=False)
        mine = [r for r in rows if r["model"] == label]
        assert [r["layer"] for r in mine] == acts.layers("values")
        for r in mine:
            seqs = [s.numpy() for s in acts.sequences("values", r["layer"])]
            assert [len(s) for s in seqs] == [16] * 6
            want = numpy_lime_entropy(seqs)
            np.testing.assert_allclose(r["entropy_mean"], want.mean(), rtol=1e-6)
            np.testing.assert_allclose(r["entropy_std"], want.std(), rtol=1e-5)  # ddof=0, as lime_probe.stats
            assert (r["unit"], r["window"], r["window_source"], r["num_windows"]) == ("windows", 16, "given", 6)
            assert r["n_sequences"] == 6
    # two checkpoints with one tokenizer saw the same windows
    assert len({r["windows_digest"] for r in rows}) == 1


def test_entropy_default_window_is_capped_by_max_positions(capsys, tmp_path, ckpts, text_file):
    out = tmp_path / "o"
    run_ok(
        capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--no-cache",
        "--num-windows", 2, "--out", out,
    )  # fmt: skip
    rows = read_rows(out / "entropy_values.json")
    assert {(r["window"], r["window_source"], r["num_windows"]) for r in rows} == {(128, "max_positions", 2)}
    from lime_probe.analyses import ANALYSES, load_checkpoints

    result = ANALYSES["entropy"].run(
        load_checkpoints([str(ckpts["llama"])], None, "cpu"), DOCS, {"cache_dir": None}, num_windows=2
    )
    assert "llama: 128 tokens (max_positions)" in result.text


def test_entropy_documents_mode_and_max_normalize(capsys, tmp_path, ckpts, text_file):
    from lime_probe.extraction import extract
    from lime_probe.loading import load

    out = tmp_path / "o"
    run_ok(
        capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--no-cache", "--unit", "documents",
        "--max-length", 12, "--preset", "layer-by-layer", "--max-normalize", "--out", out,
    )  # fmt: skip
    rows = read_rows(out / "entropy_values.json")
    model, tok = load(ckpts["llama"])
    acts = extract(model, tok, DOCS, sites=["values"], max_length=12, progress=False)
    for r in rows:
        want = []
        for z in acts.sequences("values", r["layer"]):  # Skean et al.: centre, L2 rows, clamp Gram, / log min
            c = z.numpy().astype(np.float64)
            c = c - c.mean(0)
            c /= np.linalg.norm(c, axis=1, keepdims=True)
            K = c @ c.T if c.shape[0] <= c.shape[1] else c.T @ c
            lam = np.linalg.eigvalsh(np.clip(K, 0, None))
            p = lam[lam > 0] / lam[lam > 0].sum()
            want.append(-(p * np.log(p)).sum() / np.log(min(c.shape)))
        np.testing.assert_allclose(r["entropy_mean"], np.mean(want), rtol=1e-6)
        assert r["unit"] == "documents" and r["window"] is None and r["max_normalize"] is True
        assert r["n_sequences"] == len(DOCS)
