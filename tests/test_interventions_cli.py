"""`lime-probe patch` and `lime-probe ablate-routes` end to end through the entry point: the files they write,
the patching grid equal to the library's own call, a route cut equal to a LIMe whose router weights are cut
by hand, and bad input refused in one line with exit 2."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from helpers import CORPUS, save_tiny_checkpoint, tiny_tokenizer
from safetensors.torch import load_file, save_file
from test_checks_first import run_program
from transformers import AutoTokenizer

from lime_probe import cli
from lime_probe.specs import ANALYSES

# Clean/corrupt prompts that differ in one word of one token; every pair has one token length.
PAIRS = [
    {"clean": "The cat is in the garden", "corrupt": "The cat are in the garden", "answer": " is", "wrong": " are"},
    {"clean": "The cat was in the garden", "corrupt": "The cat are in the garden", "answer": " was", "wrong": " were"},
]  # fmt: skip
WINDOW, NUM_WINDOWS, SEED = 16, 4, 1


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "llama": save_tiny_checkpoint(root / "llama", "llama"),
        # three layers: layer 2 reads two earlier layers, so its cross-layer cut differs from a single cut
        "lime": save_tiny_checkpoint(root / "lime", "lime", num_hidden_layers=3),
    }


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    """`PAIRS` as JSONL, checked to have equal token lengths and one-token answers under the tiny tokenizer."""
    tok = tiny_tokenizer()
    lengths = {len(tok(p[k])["input_ids"]) for p in PAIRS for k in ("clean", "corrupt")}
    assert len(lengths) == 1, lengths
    assert all(
        len(tok(p[k], add_special_tokens=False)["input_ids"]) == 1 for p in PAIRS for k in ("answer", "wrong")
    )
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n\n".join(CORPUS * 4) + "\n")
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _cells(rows: list[dict]) -> dict[tuple, float]:
    """{(layer, position, head): score} of tidy patching rows (CSV strings or the library's values)."""
    return {
        (int(r["layer"]), int(r["position"]), None if r.get("head") in (None, "") else int(r["head"])): float(
            r["score"]
        )
        for r in rows
    }


def test_patch_writes_the_library_grid_and_its_heatmap(capsys, tmp_path, ckpts, pairs_file):
    from lime_probe.extraction.loading import load
    from lime_probe.interventions.pairs import load_pairs
    from lime_probe.interventions.patching import activation_patching

    out = tmp_path / "out"
    argv = ["patch", "--ckpt", ckpts["lime"], "--label", "LIMe", "--pairs", pairs_file, "--site", "hidden"]
    code, stdout, err = run_cli(capsys, *argv, "--out", out, "--no-cache")
    assert code == 0, err
    columns, rows = read_csv(out / "patching.csv")
    assert {"model", "method", "site", "layer", "position", "score"} <= set(columns)
    assert "head" not in columns
    assert {(r["model"], r["method"], r["site"]) for r in rows} == {("LIMe", "activation", "hidden")}
    model, tok = load(ckpts["lime"])
    want = activation_patching(model, tok, load_pairs(pairs_file), "hidden")
    n_tokens = len(tok(PAIRS[0]["clean"])["input_ids"])
    assert want.scores.shape == (4, n_tokens)  # the embeddings and three blocks, every position
    got = _cells(rows)
    assert got.keys() == _cells(want.rows()).keys()
    for key, score in _cells(want.rows()).items():
        assert got[key] == pytest.approx(score, rel=1e-9, abs=1e-12), key
    assert {p.name for p in out.iterdir()} >= {"patching_LIMe.png", "patching_LIMe.pdf", "patching.json"}
    assert "LIMe" in stdout and "activation" in stdout


def test_patch_per_head_and_attribution(capsys, tmp_path, ckpts, pairs_file):
    from lime_probe.extraction.loading import load
    from lime_probe.interventions.logit_attribution import direct_logit_attribution
    from lime_probe.interventions.pairs import load_pairs
    from lime_probe.interventions.patching import activation_patching, attribution_patching

    out = tmp_path / "out"
    argv = ["patch", "--ckpt", ckpts["llama"], "--pairs", pairs_file, "--site", "values", "--per-head"]
    code, _, err = run_cli(capsys, *argv, "--attribution", "--out", out, "--no-cache")
    assert code == 0, err
    columns, rows = read_csv(out / "patching.csv")
    assert "head" in columns
    model, tok = load(ckpts["llama"])
    pairs = load_pairs(pairs_file)
    activation = [r for r in rows if r["method"] == "activation"]
    attribution = [r for r in rows if r["method"] == "attribution"]
    assert {r["head"] for r in activation} == {"0", "1"}  # the tiny LLaMA's two kv heads
    for method, got, want in (
        ("activation", activation, activation_patching(model, tok, pairs, "values", per_head=True)),
        ("attribution", attribution, attribution_patching(model, tok, pairs, "values")),
    ):
        expected = _cells(want.rows())
        assert _cells(got).keys() == expected.keys(), method
        for key, score in expected.items():
            assert _cells(got)[key] == pytest.approx(score, rel=1e-9, abs=1e-12), (method, key)
    _, dla = read_csv(out / "logit_attribution.csv")
    want_dla = direct_logit_attribution(model, tok, pairs).rows()
    assert [r["component"] for r in dla] == [r["component"] for r in want_dla]
    for r, w in zip(dla, want_dla, strict=True):
        assert float(r["attribution"]) == pytest.approx(w["attribution"], rel=1e-9, abs=1e-12)
    names = {p.name for p in out.iterdir()}
    assert {f"patching_llama_head{h}.{x}" for h in (0, 1) for x in ("png", "pdf")} <= names
    assert {"patching_llama_attribution.png", "logit_attribution.json"} <= names


def _cut_by_hand(src: Path, dst: Path, layers: list[int], renormalize: bool) -> Path:
    """A copy of LIMe checkpoint `src` whose `layers` read only their own K/V: the router weight columns of
    every earlier source zeroed (``weight [kv, S * kv]``, column ``p * kv + h'`` for source p, own last); with
    `renormalize` each routed head's own weights rescaled to the L1 mass its whole row had."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    kv = json.loads((src / "config.json").read_text())["num_key_value_heads"]
    for layer in layers:
        key = f"model.layers.{layer}.self_attn.router.weight"
        w = weights[key].clone()
        assert w.shape == (kv, (layer + 1) * kv)  # full routing: every layer up to its own
        mass = w.abs().sum(1, keepdim=True)
        w[:, : layer * kv] = 0.0
        if renormalize:
            w[:, layer * kv :] *= mass / w[:, layer * kv :].abs().sum(1, keepdim=True)
        weights[key] = w.contiguous()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _loss_and_entropy(ckpt: Path, windows: list[list[int]], layers: list[int]) -> tuple[float, float]:
    """The mean next-token loss (nats) over `windows` and the mean over `layers` of their routed values'
    matrix entropy (the official preset, seed `SEED`)."""
    from lime_probe import extract, load
    from lime_probe.probes.entropy import layer_entropy

    model, tok = load(ckpt)
    acts = extract(
        model,
        tok,
        windows,
        sites="routed_values",
        layers=layers,
        pretokenized=True,
        logprobs=True,
        progress=False,
    )
    loss = -float(acts.logprobs.sum()) / sum(len(w) - 1 for w in windows)
    entropy = [layer_entropy(acts.sequences("routed_values", i), "lime", seed=SEED).mean for i in layers]
    return loss, sum(entropy) / len(entropy)


def test_ablate_routes_cross_layer_rows_equal_a_lime_cut_by_hand(capsys, tmp_path, ckpts, text_file):
    from lime_model.data import load_texts
    from lime_probe.extraction.windows import token_windows

    out = tmp_path / "out"
    argv = ["ablate-routes", "--ckpt", ckpts["lime"], "--data", text_file, "--window", WINDOW]
    code, _, err = run_cli(
        capsys, *argv, "--num-windows", NUM_WINDOWS, "--seed", SEED, "--out", out, "--no-cache"
    )
    assert code == 0, err
    columns, rows = read_csv(out / "route_ablation.csv")
    assert {"layer", "source", "delta_loss", "delta_value_entropy", "renormalized"} <= set(columns)
    assert {"route_ablation_lime.png", "route_ablation_lime.pdf"} <= {p.name for p in out.iterdir()}
    # layer 1 reads layer 0, layer 2 layers 0 and 1: one row per single cut, per layer's cross-layer cut and
    # the cut of all, each plain and renormalised
    assert sorted((r["layer"], r["source"], r["renormalized"]) for r in rows) == sorted(
        (layer, source, renorm)
        for renorm in ("False", "True")
        for layer, source in [("1", "0"), ("2", "0"), ("2", "1"), ("1", "cross-layer"), ("2", "cross-layer"),
                              ("all", "all")]
    )  # fmt: skip
    # the command's windows: its --max-sequences documents packed with the checkpoint's tokenizer
    texts = load_texts(str(text_file), max_texts=ANALYSES["ablate-routes"].max_sequences)
    tok = AutoTokenizer.from_pretrained(ckpts["lime"])
    windows = token_windows(texts, tok, WINDOW, NUM_WINDOWS, seed=SEED)
    by_key = {(r["layer"], r["source"], r["renormalized"]): r for r in rows}
    for layer, source, cut in (("1", "cross-layer", [1]), ("2", "cross-layer", [2]), ("all", "all", [1, 2])):
        base_loss, base_entropy = _loss_and_entropy(ckpts["lime"], windows, cut)
        for renorm in (False, True):
            edited = _cut_by_hand(ckpts["lime"], tmp_path / f"cut-{layer}-{renorm}", cut, renorm)
            loss, entropy = _loss_and_entropy(edited, windows, cut)
            row = by_key[(layer, source, str(renorm))]
            assert float(row["delta_loss"]) == pytest.approx(loss - base_loss, abs=1e-5), (layer, renorm)
            assert float(row["delta_value_entropy"]) == pytest.approx(entropy - base_entropy, abs=1e-4)
            assert abs(loss - base_loss) > 1e-4  # the cut changes the model: the check is not vacuous


@pytest.mark.parametrize(
    "case, match",
    [
        ("no_wrong", "{pairs}:2: a pair needs the fields clean, corrupt, answer, wrong"),
        ("unequal", "pair 0: the clean prompt has 9 tokens and the corrupt one 8; they must match"),
        ("site", "site 'routed_values' is not available for model_type 'llama'"),
        ("layer", "layer 7 out of range for site 'hidden', which has 3 entries"),
        ("not_routed", "ablate-routes needs LIMe checkpoints that route; llama has no routers"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys, monkeypatch, tmp_path, ckpts, pairs_file, text_file, case, match
):
    command, pairs, extra = "patch", tmp_path / "pairs.jsonl", []
    ckpt = ckpts["llama"]
    if case == "no_wrong":  # known from the file alone: refused before any model loads
        monkeypatch.setattr("lime_probe.cli.load_checkpoints", lambda *a, **k: pytest.fail("loaded"))
        pairs.write_text(
            json.dumps(PAIRS[0]) + "\n" + json.dumps({k: PAIRS[1][k] for k in ("clean", "corrupt", "answer")})
        )
    elif case == "unequal":
        pairs.write_text(
            json.dumps(PAIRS[0] | {"clean": "The cat is on the mat", "corrupt": "The dog is on the mat"})
        )
    else:
        pairs = pairs_file
        extra = {"site": ["--site", "routed_values"], "layer": ["--layers", "7"], "not_routed": []}[case]
    if case == "not_routed":
        command, data = "ablate-routes", ["--data", text_file]
    else:
        data = ["--pairs", pairs]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, command, "--ckpt", ckpt, *data, *extra, "--out", out, "--no-cache")
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("lime-probe")]
    assert len(lines) == 1 and lines[0].startswith(f"lime-probe {command}: error: "), err
    assert match.format(pairs=pairs) in lines[0], err
    assert "Traceback" not in err
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_missing_pairs_file_is_named_before_torch_loads(tmp_path, ckpts):
    missing = tmp_path / "nope.jsonl"
    out = tmp_path / "out"
    code, err, imported, cpu = run_program(
        "lime_probe.cli", ["patch", "--ckpt", ckpts["llama"], "--pairs", missing, "--out", out]
    )
    assert code == 2, err
    assert (
        err.strip()
        == f"lime-probe patch: error: --pairs {missing}: no such file (a JSONL file of clean/corrupt pairs)"
    )
    assert "torch" not in imported and cpu < 1.0, (sorted(imported), cpu)
    assert not out.exists()
