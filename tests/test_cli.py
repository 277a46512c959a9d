"""`lime-probe` end to end through its entry point: results equal the library's, bad input exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers as tf
from helpers import CORPUS, save_tiny_checkpoint, write_blimp_dir

from lime_probe import cli
from lime_probe.extraction.sites import DEFAULT_WORDS
from lime_probe.specs import ANALYSES

TEXTS = CORPUS
DOCS = TEXTS * 3  # every probed word occurs at least 5 times


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {arch: save_tiny_checkpoint(root / arch, arch) for arch in ("llama", "lime", "bert")}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n\n".join(DOCS) + "\n")
    return path


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_help_shows_an_example(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert "examples:" in out and f"lime-probe {command}" in out.split("examples:")[1]


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2 and "COMMAND" in err


def test_label_count_must_match(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello there\n")
    code, _, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        "a",
        "--ckpt",
        "b",
        "--label",
        "x",
        "--data",
        text,
        "--out",
        tmp_path / "out",
    )
    assert code == 2
    assert (
        err.strip()
        == "lime-probe entropy: error: got 1 --label for 2 --ckpt; give one label per checkpoint or none"
    )
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_rejected(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    code, _, err = run_cli(capsys, "entropy", "--ckpt", "a", "--data", "x", "--out", tmp_path / "f")
    assert code == 2 and f"--out {tmp_path / 'f'}: {tmp_path / 'f'} is not a folder" in err


def test_unwritable_out_is_rejected(capsys, tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; /proc refuses new entries even to root
        out = Path("/proc/lime-probe-out")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        out = locked / "out"
    try:
        code, _, err = run_cli(capsys, "entropy", "--ckpt", "a", "--data", "x", "--out", out)
    finally:
        if os.geteuid() != 0:
            locked.chmod(0o700)
    assert code == 2 and f"--out {out}: cannot write in" in err and err.count("\n") == 1
    assert not out.exists()


def test_staged_output_moves_files_only_on_success(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with cli.staged_output(out) as tmp:
        (tmp / "new.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.png").write_text("png")
        assert not (out / "new.json").exists()  # nothing appears before the end
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "keep.txt",
        "new.json",
        "sub",
        "sub/a.png",
    ]
    with pytest.raises(KeyboardInterrupt), cli.staged_output(out) as tmp:
        (tmp / "half.json").write_text("{")
        raise KeyboardInterrupt
    assert not (out / "half.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folder left behind


def test_staged_output_creates_missing_parents_and_removes_them_on_failure(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with cli.staged_output(out) as tmp:
        (tmp / "r.json").write_text("{}")
    assert (out / "r.json").read_text() == "{}"
    failed = tmp_path / "x" / "y" / "out"
    with pytest.raises(ValueError), cli.staged_output(failed) as tmp:
        raise ValueError("bad input")
    assert not (tmp_path / "x").exists()  # nothing half-made is left behind


def test_format_table_aligns_columns():
    text = cli.format_table(
        [{"model": "LIMe", "layer": 0, "v": 1.234567}, {"model": "LLaMA", "layer": 10, "v": None}]
    )
    lines = text.splitlines()
    assert lines[0].split() == ["model", "layer", "v"]
    assert lines[2].split() == ["LIMe", "0", "1.235"] and lines[3].split() == ["LLaMA", "10"]
    assert len({len(line) for line in lines}) == 1


def test_entropy_matches_the_library(capsys, tmp_path, ckpts, text_file, monkeypatch):
    import importlib

    from lime_probe.extraction.activations import Activations
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.entropy import layer_entropy

    extract_mod = importlib.import_module("lime_probe.extraction.tracing")
    monkeypatch.setattr(extract_mod, "SHARD_BYTES", 1)  # a cache shard per batch: the command streams them

    def whole_layer(*a, **k):
        raise AssertionError("the entropy command must stream, not load every sequence of a layer")

    monkeypatch.setattr(Activations, "sequences", whole_layer)
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--ckpt",
        ckpts["bert"],
        "--label",
        "LLaMA",
        "--label",
        "BERT",
        "--data",
        text_file,
        "--site",
        "values",
        "--max-length",
        16,
        "--batch-size",
        4,
        "--out",
        out,
        "--cache",
        tmp_path / "cache",
        "--seed",
        3,
        "--unit",
        "documents",
    )
    assert code == 0, err
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) > 2  # several shards were streamed
    monkeypatch.undo()
    doc = _read_json(out / "entropy_values.json")
    assert doc["meta"]["settings"]["site"] == "values"
    assert doc["meta"]["checkpoints"]["BERT"]["model_type"] == "bert"
    for label, arch in (("LLaMA", "llama"), ("BERT", "bert")):
        model, tok = load(ckpts[arch])
        acts = extract(
            model, tok, DOCS, sites=["values"], max_length=16, progress=False
        )  # in memory, unbatched
        rows = [r for r in doc["rows"] if r["model"] == label]
        assert [r["layer"] for r in rows] == acts.layers("values")
        for r in rows:
            seqs = acts.sequences("values", r["layer"])
            got = [r["entropy_mean"], r["entropy_std"], r["ci_low"], r["ci_high"]]
            # the library on all sequences at once, in memory; equal up to float64 round-off in the feature
            # moments (merged per shard here), which p**0.5 of the smallest Gram eigenvalues magnifies to ~1e-9
            want = layer_entropy(seqs, "lime", seed=3)
            np.testing.assert_allclose(got, [want.mean, want.std, want.ci_low, want.ci_high], rtol=1e-7)
            assert r["n_sequences"] == len(DOCS)
    assert sorted(p.name for p in out.iterdir()) == [
        f"entropy_values.{x}" for x in ("csv", "json", "pdf", "png")
    ]
    assert "LLaMA" in stdout and "entropy_mean" in stdout


def _corrupt_copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    return dst


def _digits_checkpoint(directory: Path) -> Path:
    """A tiny LLaMA whose tokenizer knows digits and arithmetic only: English is mostly its unknown token."""
    from helpers import tiny_model

    from lime_model.tokenization import char_tokenizer

    tok = char_tokenizer("0123456789+-*/()= ")
    tiny_model("llama", tok).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "checkpoint not found"),
        ("not_ckpt", "not a checkpoint"),
        ("corrupt", "cannot read the weights file {tmp_path}/corrupt/model.safetensors"),
        ("no_tokenizer", "has no tokenizer"),
        ("empty_data", "no text"),
        ("missing_data", "data not found"),
        ("non_utf8", "latin1.txt is not UTF-8 text"),
        ("unknown_tokens", "the data does not fit the tokenizer"),
        ("device_name", "--device 'gpu0' is not a torch device"),
        ("device_absent", "--device cuda: this machine has no CUDA device"),
        ("cache_unwritable", "--cache"),
        (
            "hf_unreachable",
            "--data hf:wikitext:wikitext-2-raw-v1 not found locally and the hub is unreachable",
        ),
        ("hf_offline", "--data hf:wikitext:wikitext-2-raw-v1 not found locally and the hub is unreachable"),
        ("blimp_unreachable", "BLiMP data (nyu-mll/blimp) not found locally and the hub is unreachable"),
        ("blimp_non_utf8", "latin1.jsonl: not UTF-8 text"),
        ("one_word", "--words needs at least two distinct words"),
        ("repeated_word", "--words repeats ' is'"),
        ("small_sample", "per word in each of the 5 test folds (fewer than 10)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, ckpts, text_file, monkeypatch, case, match):
    ckpt, data, command, extra = ckpts["llama"], text_file, "entropy", []
    if case == "missing":
        ckpt = tmp_path / "nope"
    elif case == "not_ckpt":
        ckpt = tmp_path / "plain"
        ckpt.mkdir()
    elif case == "corrupt":
        ckpt = _corrupt_copy(ckpts["llama"], tmp_path / "corrupt")
    elif case == "no_tokenizer":  # a model saved alone, as save_pretrained(DIR) leaves it
        ckpt = tmp_path / "weights-only"
        tf.AutoModelForCausalLM.from_pretrained(ckpts["llama"]).save_pretrained(ckpt)
    elif case == "empty_data":
        data = tmp_path / "empty.txt"
        data.write_text("\n\n  \n")
    elif case == "missing_data":
        data = tmp_path / "nothing.txt"
    elif case == "non_utf8":  # named even inside a folder
        data = tmp_path / "folder"
        data.mkdir()
        (data / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    elif case == "unknown_tokens":
        ckpt = _digits_checkpoint(tmp_path / "digits")
        extra = ["--num-windows", 2]
    elif case == "device_name":
        extra = ["--device", "gpu0"]
    elif case == "device_absent":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
        extra = ["--device", "cuda"]
    elif case == "cache_unwritable":  # under a file: no folder can be made there
        (tmp_path / "a-file").write_text("x")
        extra = ["--cache", tmp_path / "a-file" / "cache"]
    elif case == "hf_unreachable":  # nothing listens there: the one request fails at once
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
        data = "hf:wikitext:wikitext-2-raw-v1"
    elif case == "hf_offline":  # HF_HUB_OFFLINE: datasets reads its cache, which lacks the dataset
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
        monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
        monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
        data = "hf:wikitext:wikitext-2-raw-v1"
    elif case == "blimp_unreachable":  # blimp without --data reads the hub
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
        command, data = "blimp", None
    elif case == "blimp_non_utf8":
        command, data, extra = "blimp", tmp_path / "blimp", ["--tasks", "all"]
        data.mkdir()
        (data / "latin1.jsonl").write_bytes('{"sentence_good": "caf\u00e9"}\n'.encode("latin-1"))
    elif case in ("one_word", "repeated_word"):  # refused before any data or model is read
        monkeypatch.setattr("lime_probe.cli.load_checkpoints", lambda *a, **k: pytest.fail("loaded"))
        monkeypatch.setattr("lime_probe.cli._texts", lambda *a, **k: pytest.fail("read"))
        command, extra = "separability", ["--words", " is", *([" is"] if case == "repeated_word" else [])]
    elif case == "small_sample":  # 6 occurrences of each word: 1.2 per word per test fold
        command = "separability"
    out = tmp_path / "out"
    argv = [command, "--ckpt", ckpt, *(["--data", data] if data is not None else []), "--out", out, *extra]
    if "--cache" not in extra:
        argv.append("--no-cache")
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("lime-probe")]
    match = match.format(tmp_path=tmp_path)
    assert len(lines) == 1 and lines[0].startswith(f"lime-probe {command}: error: ") and match in lines[0], (
        err
    )
    assert "Traceback" not in err
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_reproduce_checks_its_output_folders_before_training(capsys, tmp_path):
    (tmp_path / "a-file").write_text("x")
    argv = ["reproduce", "--study", "arithmetic-seeds", "--out", tmp_path / "runs"]
    code, _, err = run_cli(capsys, *argv, "--results", tmp_path / "a-file" / "results")
    assert code == 2 and err.count("\n") == 1 and "--results" in err and "not a folder" in err, err
    assert not (tmp_path / "runs").exists()  # nothing created, nothing trained


def test_tsne_says_when_it_has_fewer_points_than_asked(capsys, tmp_path, ckpts, text_file):
    # LIMe's two value sites (values, routed_values) meet the same shortfall: said once
    argv = ["tsne", "--ckpt", ckpts["lime"], "--data", text_file, "--max-length", 32, "--no-cache"]
    code, _, err = run_cli(capsys, *argv, "--per-word", 150, "--perplexity", 2, "--out", tmp_path / "o")
    warned = [ln for ln in err.splitlines() if "points per word" in ln]
    assert code == 0 and len(warned) == 1, err
    assert warned[0].startswith("lime-probe tsne: warning: lime: ") and "not 150" in warned[0]


def test_unknown_tokens_can_be_allowed_with_a_one_line_warning(capsys, tmp_path, text_file):
    ckpt = _digits_checkpoint(tmp_path / "digits")
    argv = ["entropy", "--ckpt", ckpt, "--data", text_file, "--unit", "documents", "--no-cache"]
    code, _, err = run_cli(capsys, *argv, "--allow-unknown-tokens", "--out", tmp_path / "o")
    warned = [ln for ln in err.splitlines() if "unknown token" in ln]
    assert code == 0 and len(warned) == 1, err
    assert warned[0].startswith("lime-probe entropy: warning: ") and "of the" in warned[0]


def test_unknown_site_is_a_usage_error(capsys, ckpts, text_file, tmp_path):
    code, _, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--site",
        "attn",
        "--out",
        tmp_path / "o",
    )
    assert code == 2 and err.count("\n") == 1 and "unknown site 'attn'; sites are hidden" in err
    assert "attn_pattern" in err and "module:PATH" in err


@pytest.mark.parametrize(
    ("site", "message", "loads"),
    [
        ("module:layers.{i}.mlp:inputs", "malformed site 'module:layers.{i}.mlp:inputs': write module:PATH", False),
        ("module:layers.{i}.mlp.dwn_proj", "names no module of LlamaForCausalLM; nearest: layers.{i}.mlp.down_proj", True),
    ],
)  # fmt: skip
def test_a_bad_module_site_is_exit_2_in_one_line(
    capsys, ckpts, text_file, tmp_path, monkeypatch, site, message, loads
):
    """Its syntax is checked before torch loads (as any --site), the module it names once the model is loaded."""
    if not loads:
        monkeypatch.setattr(cli, "configure_threads", lambda *a: pytest.fail("torch was reached"))
    code, _, err = run_cli(capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--site", site,
                           "--out", tmp_path / "o", "--no-cache", "--num-windows", 2)  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_module_site_runs_through_a_command(capsys, ckpts, text_file, tmp_path):
    """``--site module:...`` measures that module's rows: per document, the entropy of the MLP's inner
    activations equals the library's on an extraction of the same documents; the result's files take the
    site's name in a file-name-safe form."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.entropy import layer_entropy

    site = "module:layers.{i}.mlp.down_proj:input"
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, "entropy", "--ckpt", ckpts["llama"], "--data", text_file, "--site", site,
                           "--max-length", 16, "--out", out, "--no-cache", "--seed", 3, "--unit", "documents")  # fmt: skip
    assert code == 0, err
    rows = _read_json(out / "entropy_module_layers__i__mlp_down_proj_input.json")["rows"]
    assert [r["layer"] for r in rows] == [0, 1] and {r["site"] for r in rows} == {site}
    model, tok = load(ckpts["llama"])
    acts = extract(model, tok, DOCS, sites=site, max_length=16, progress=False)
    for r in rows:
        seqs = acts.sequences(site, r["layer"])
        assert seqs[0].shape[1] == 64  # the MLP's inner width
        want = layer_entropy(seqs, "lime", seed=3)
        np.testing.assert_allclose([r["entropy_mean"], r["ci_low"]], [want.mean, want.ci_low], rtol=1e-7)


def test_a_site_the_model_lacks_is_exit_2(capsys, ckpts, text_file, tmp_path):
    code, _, err = run_cli(
        capsys,
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--site",
        "routed_values",
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--num-windows",
        2,
    )
    assert code == 2 and "routed_values" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_missing_relative_path_fails_fast_naming_both_readings(capsys, tmp_path, text_file, monkeypatch):
    import time

    monkeypatch.chdir(tmp_path)  # "runs/nope" reads as a hub id too, and the hub cannot be reached here
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    code, _, err = run_cli(
        capsys, "entropy", "--ckpt", "runs/nope", "--data", text_file, "--out", "o", "--no-cache"
    )
    took = time.monotonic() - start
    assert code == 2
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "lime-probe entropy: error: checkpoint not found: runs/nope (no such local folder, and no hub model "
        )
    )
    assert "Retry" not in err and "Traceback" not in err
    assert took < 10, f"took {took:.1f} s: the hub was retried"
    assert not (tmp_path / "o").exists()


def test_a_bug_raising_keyerror_is_exit_1_not_bad_input(capsys, tmp_path, monkeypatch):
    def buggy(*args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "run_analysis", buggy)
    monkeypatch.setattr(cli, "load_checkpoints", lambda *a, **kw: [])
    (tmp_path / "t.txt").write_text("hello there\n")
    code, _, err = run_cli(
        capsys, "cka", "--ckpt", "x", "--data", tmp_path / "t.txt", "--out", tmp_path / "o"
    )
    assert code == 1 and "failed: KeyError: internal" in err


def test_published_files_and_folder_have_normal_permissions(capsys, tmp_path, ckpts):
    from lime_model.files import umask

    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "router", "--ckpt", ckpts["lime"], "--out", out)
    assert code == 0, err
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask()
    files = sorted(out.iterdir())
    assert {f.suffix for f in files} == {".json", ".csv", ".png", ".pdf"}
    assert {f.name: f.stat().st_mode & 0o777 for f in files} == {f.name: 0o666 & ~umask() for f in files}


@pytest.mark.slow
def test_installed_script_reports_bad_input(tmp_path, text_file):
    script = Path(sys.executable).with_name("lime-probe")
    if not script.exists():
        pytest.skip("lime-probe is not installed in this environment (pip install -e .)")
    proc = subprocess.run(
        [
            str(script),
            "entropy",
            "--ckpt",
            str(tmp_path / "nope"),
            "--data",
            str(text_file),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"lime-probe entropy: error: checkpoint not found: {tmp_path / 'nope'}"
    )


def _ok(capsys, *argv) -> str:
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    return stdout


def _word_features(ckpt, site, words=DEFAULT_WORDS):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.separability import word_rows, word_token_ids

    model, tok = load(ckpt)
    ids = word_token_ids(tok, words)
    acts = extract(
        model, tok, DOCS, sites=[site], token_ids=list(ids.values()), max_length=32, progress=False
    )
    rows, y = word_rows(acts.token_ids, ids)
    return {la: acts[site][la][rows] for la in acts[site]}, y


def test_separability_matches_the_library(capsys, tmp_path, ckpts, text_file):
    from lime_probe.probes.separability import token_separability

    _ok(
        capsys,
        "separability",
        "--ckpt",
        ckpts["lime"],
        "--ckpt",
        ckpts["bert"],
        "--data",
        text_file,
        "--site",
        "values",
        "--max-length",
        32,
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--seed",
        1,
        "--allow-small-samples",
    )
    doc = _read_json(tmp_path / "o" / "separability_values.json")
    for label in ("lime", "bert"):
        want = token_separability(
            *_word_features(ckpts[label], "values"), seed=1, classes=DEFAULT_WORDS, progress=False
        )
        rows = [r for r in doc["rows"] if r["model"] == label]
        assert [r["layer"] for r in rows] == want.layers
        np.testing.assert_allclose([r["accuracy_mean"] for r in rows], want.accuracy_mean)
        np.testing.assert_allclose([r["accuracy_std"] for r in rows], want.accuracy_std)
        assert rows[0]["majority_baseline"] == want.majority_baseline


def test_missing_words_are_named(capsys, tmp_path, ckpts, text_file):
    # the first two documents hold " is" once and " the" four times: both are named with their counts
    code, _, err = run_cli(
        capsys,
        "separability",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--words",
        " is",
        " the",
        "--max-sequences",
        2,
        "--out",
        tmp_path / "o",
        "--no-cache",
    )
    assert code == 2 and "too rare in the data" in err and "' is': 1, ' the': 4" in err
    code, _, err = run_cli(
        capsys,
        "separability",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--words",
        " is",
        " garden",
        "--out",
        tmp_path / "o",
        "--no-cache",
    )
    # ' garden' is 5 tokens: found as a whole word, it occurs 3 times
    assert code == 2 and "' garden': 3" in err and not (tmp_path / "o").exists()


def test_tsne_matches_the_library(capsys, tmp_path, ckpts, text_file):
    from lime_probe.probes.separability import balance_classes
    from lime_probe.probes.tsne import tsne_layers

    _ok(
        capsys,
        "tsne",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--site",
        "hidden",
        "--layers",
        "0,2",
        "--per-word",
        6,
        "--perplexity",
        3,
        "--max-length",
        32,
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--seed",
        2,
    )
    doc = _read_json(tmp_path / "o" / "tsne_hidden.json")
    feats, y = _word_features(ckpts["llama"], "hidden")
    keep = balance_classes(y, seed=2, n_per_class=6)
    want = tsne_layers({la: feats[la][keep] for la in (0, 2)}, perplexity=3, seed=2, progress=False)
    for layer in (0, 2):
        rows = [r for r in doc["rows"] if r["layer"] == layer]
        np.testing.assert_allclose([[r["x"], r["y"]] for r in rows], want[layer])
        assert [r["token"] for r in rows] == [str(t) for t in y[keep]]
    assert (tmp_path / "o" / "tsne_hidden.png").exists()


def test_cka_matches_the_library(capsys, tmp_path, ckpts, text_file):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.similarity import cka_matrix, effective_ranks

    _ok(
        capsys,
        "cka",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--max-length",
        32,
        "--out",
        tmp_path / "o",
        "--no-cache",
    )
    doc = _read_json(tmp_path / "o" / "cka_hidden.json")
    model, tok = load(ckpts["llama"])
    acts = extract(model, tok, DOCS, sites=["hidden"], max_length=32, progress=False)
    feats = {la: acts["hidden"][la] for la in acts["hidden"]}
    np.testing.assert_allclose(doc["cka"]["llama"]["cka"], cka_matrix(feats, progress=False))
    np.testing.assert_allclose(
        [r["effective_rank"] for r in doc["rows"]], effective_ranks(feats, center=True, progress=False)
    )


@pytest.mark.slow  # ~7 s under load
def test_router_matches_the_library_and_rejects_llama(capsys, tmp_path, ckpts):
    from lime_probe.extraction.loading import load
    from lime_probe.probes.router_weights import router_weights

    _ok(capsys, "router", "--ckpt", ckpts["lime"], "--label", "LIMe", "--out", tmp_path / "o")
    doc = _read_json(tmp_path / "o" / "router.json")
    want = router_weights(load(ckpts["lime"])[0])
    got = np.array(doc["routers"]["LIMe"]["per_layer"], dtype=float)  # None (NaN) above the diagonal
    np.testing.assert_allclose(got, want.per_layer)
    assert {(r["layer"], r["source_layer"]) for r in doc["rows"]} == {
        (i, j) for i, s in enumerate(want.sources) for j in s
    }
    code, _, err = run_cli(capsys, "router", "--ckpt", ckpts["llama"], "--out", tmp_path / "o2")
    assert code == 2 and "has no LIMe routers" in err


@pytest.fixture(scope="module")
def blimp_dir(tmp_path_factory) -> Path:
    return write_blimp_dir(tmp_path_factory.mktemp("blimp"))


@pytest.mark.slow  # ~8 s under load
def test_blimp_matches_the_library(capsys, tmp_path, ckpts, blimp_dir):
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.blimp import blimp_probe, load_blimp, score_minimal_pairs, scoring_sequences

    _ok(
        capsys,
        "blimp",
        "--ckpt",
        ckpts["llama"],
        "--ckpt",
        ckpts["bert"],
        "--data",
        blimp_dir,
        "--max-pairs",
        10,
        "--out",
        tmp_path / "o",
        "--no-cache",
        "--tasks",
        "all",
        "--sites",
        "hidden",
        "--layers",
        "all",
    )
    doc = _read_json(tmp_path / "o" / "blimp.json")
    data = load_blimp(blimp_dir)
    model, tok = load(ckpts["llama"])
    part = data.select(range(10))  # the first paradigm's first 10 pairs, as scored: prefix, then the sentence
    good, bad = (
        extract(model, tok, scoring_sequences(tok, part[c]), sites=["hidden"], pool="mean", pretokenized=True)
        for c in ("sentence_good", "sentence_bad")
    )
    want = blimp_probe(
        {la: good["hidden"][la] for la in good["hidden"]},
        {la: bad["hidden"][la] for la in bad["hidden"]},
        np.asarray(part["pairID"]),
        progress=False,
    )
    rows = [r for r in doc["rows"] if r["model"] == "llama" and r["paradigm"] == "agreement_a"]
    np.testing.assert_allclose([r["probe_accuracy_mean"] for r in rows], want.accuracy_mean)
    picked = data.select(list(range(10)) + list(range(12, 22)))
    scores = score_minimal_pairs(model, tok, picked, progress=False)
    assert doc["blimp"]["llama"]["minimal_pairs"]["per_paradigm"] == pytest.approx(scores.per_paradigm)
    assert "minimal_pairs" not in doc["blimp"]["bert"]  # an encoder is probed but not scored as a causal LM
    assert doc["blimp"]["bert"]["skipped_pairs"] == {"agreement_a": 0, "agreement_b": 0}
    assert {r["model"] for r in doc["rows"]} == {"llama", "bert"}


def test_blimp_with_wrong_fields_is_exit_2(capsys, tmp_path, ckpts):
    bad = tmp_path / "b"
    bad.mkdir()
    (bad / "x.jsonl").write_text(json.dumps({"good": "a", "bad": "b"}) + "\n")
    code, _, err = run_cli(
        capsys, "blimp", "--ckpt", ckpts["llama"], "--data", bad, "--tasks", "all", "--out", tmp_path / "o"
    )
    assert code == 2 and "missing field" in err and not (tmp_path / "o").exists()


@pytest.mark.slow  # ~11 s under load: every analysis twice
def test_report_is_self_contained_and_matches_the_commands(capsys, tmp_path, ckpts, text_file):
    common = [
        "--ckpt",
        ckpts["lime"],
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--max-length",
        32,
        "--no-cache",
        "--num-windows",
        2,
    ]
    _ok(capsys, "report", *common, "--analyses", "entropy", "router", "--out", tmp_path / "r")
    _ok(capsys, "entropy", *common, "--out", tmp_path / "e")
    html = (tmp_path / "r" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3  # entropy + router per layer + router per head
    assert "<script" not in html and "Matrix entropy of values" in html and "Router weights" in html
    assert (
        _read_json(tmp_path / "r" / "entropy_values.json")["rows"]
        == _read_json(tmp_path / "e" / "entropy_values.json")["rows"]
    )
    assert {r["model"] for r in _read_json(tmp_path / "r" / "router.json")["rows"]} == {"lime"}  # LIMe only


def test_report_options_left_out_keep_each_analysis_default():
    """report reads each analysis's defaults from its Spec: options left out give every analysis the
    parameters (and --max-sequences) its own command has by default."""
    args = cli.build_parser().parse_args(["report", "--ckpt", "x", "--data", "t.txt"])
    assert args.max_sequences is None
    for name in [*cli.REPORTABLE, *cli.REPORT_JOINED]:  # BLiMP too: its layers the paper's range
        assert cli.params_of(ANALYSES[name], args) == ANALYSES[name].params(), name
    assert "layers" not in vars(args) and cli.extract_options(args)["layers"] is None  # extraction: all
    layered = cli.build_parser().parse_args(["report", "--ckpt", "x", "--data", "t.txt", "--layers", "2,3"])
    assert cli.params_of(ANALYSES["blimp"], layered).layers == "2,3"
    given = cli.build_parser().parse_args(["report", "--ckpt", "x", "--data", "t.txt", "--site", "keys"])
    assert {cli.params_of(ANALYSES[n], given).site for n in ("entropy", "cka", "tsne")} == {"keys"}


@pytest.mark.slow
def test_report_with_a_skipped_section_exits_3_unless_allowed(capsys, tmp_path, ckpts, text_file):
    common = ["--ckpt", ckpts["llama"], "--data", text_file, "--max-length", 32, "--no-cache"]
    common += ["--num-windows", 2, "--window", 16, "--analyses", "entropy", "cka", "separability"]
    common += ["--words", " is", " the"]
    argv = ["report", *common, "--max-sequences", 2, "--out", tmp_path / "r"]
    code, _, err = run_cli(capsys, *argv)
    last = err.strip().splitlines()[-1]
    assert code == 3, err
    assert last.startswith("lime-probe report: incomplete: 1 of 3 sections skipped (separability: ")
    assert "too rare" in last and "--allow-skips" in last
    html = (tmp_path / "r" / "report.html").read_text()  # written: the sections that worked, the skip listed
    assert "Skipped sections" in html and "Matrix entropy" in html
    code, _, err = run_cli(capsys, *argv[:-1], tmp_path / "r2", "--allow-skips")
    assert code == 0 and "skipped separability" in err and "incomplete" not in err
    # the cka section ran with cka's own default site (hidden), as `lime-probe cka` does
    _ok(capsys, "cka", *common[:7], "--max-sequences", 2, "--out", tmp_path / "c")
    assert (
        _read_json(tmp_path / "r2" / "cka_hidden.json")["rows"]
        == _read_json(tmp_path / "c" / "cka_hidden.json")["rows"]
    )


def test_ctrl_c_leaves_no_output_and_a_usable_cache(capsys, tmp_path, ckpts, text_file, monkeypatch):
    import importlib

    extract_mod = importlib.import_module("lime_probe.extraction.tracing")

    monkeypatch.setattr(extract_mod, "SHARD_BYTES", 1)  # a cache shard after every batch
    real_forward, calls = extract_mod._forward, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_forward(*a, **k)

    argv = [
        "entropy",
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--batch-size",
        4,
        "--max-length",
        16,
        "--unit",
        "documents",  # 18 texts, several batches
        "--cache",
        tmp_path / "cache",
    ]
    monkeypatch.setattr(extract_mod, "_forward", interrupted)
    code, _, err = run_cli(capsys, *argv, "--out", tmp_path / "out")
    assert code == 130 and "interrupted" in err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["cache"]
    calls.clear()
    monkeypatch.setattr(extract_mod, "_forward", lambda *a, **k: calls.append(1) or real_forward(*a, **k))
    assert run_cli(capsys, *argv, "--out", tmp_path / "out")[0] == 0
    assert len(calls) == 5 - 2  # 18 texts in batches of 4: the 2 batches cached before Ctrl-C are reused
    assert run_cli(capsys, *argv[:-2], "--no-cache", "--out", tmp_path / "fresh")[0] == 0
    resumed = _read_json(tmp_path / "out" / "entropy_values.json")["rows"]
    assert resumed == _read_json(tmp_path / "fresh" / "entropy_values.json")["rows"]


def test_run_folder_analyses_read_the_trainer_logs(capsys, tmp_path):
    """training-curves and arithmetic-accuracy tabulate metrics.jsonl / arithmetic_eval.json as written."""
    runs = {}
    for label, offset in (("a", 0.0), ("b", 0.5)):
        run = runs[label] = tmp_path / label
        run.mkdir()
        records = [
            {"step": s, "tokens": 64 * s, "flops": 1e6 * s, "loss": 4.0 / s + offset} for s in (1, 2, 3)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
        (run / "arithmetic_eval.json").write_text(json.dumps({"accuracy": {"2": 0.9 - offset, "3": 0.4}}))
    ckpts = [x for run in runs.values() for x in ("--ckpt", run)]
    _ok(capsys, "training-curves", *ckpts, "--smooth", 2, "--out", tmp_path / "c")
    rows = _read_json(tmp_path / "c" / "training_curves.json")["rows"]
    assert [(r["model"], r["step"], r["loss"]) for r in rows] == [
        (m, s, 4.0 / s + off) for m, off in (("a", 0.0), ("b", 0.5)) for s in (1, 2, 3)
    ]
    assert (tmp_path / "c" / "training_curves.png").is_file()
    _ok(capsys, "arithmetic-accuracy", *ckpts, "--label", "A", "--label", "B", "--out", tmp_path / "acc")
    rows = _read_json(tmp_path / "acc" / "arithmetic_accuracy.json")["rows"]
    assert {(r["model"], r["n_operators"]): r["accuracy"] for r in rows} == {
        ("A", 2): 0.9,
        ("A", 3): 0.4,
        ("B", 2): 0.4,
        ("B", 3): 0.4,
    }
    (runs["b"] / "arithmetic_eval.json").unlink()
    code, _, err = run_cli(capsys, "arithmetic-accuracy", *ckpts, "--out", tmp_path / "none")
    assert code == 2 and "no arithmetic_eval.json" in err and not (tmp_path / "none").exists()
