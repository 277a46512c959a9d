"""Inputs a user can get wrong, each refused in one line with exit 2 and nothing written in ``--out``: before
torch is imported where a check needs no model (a window against the positions config.json states, an empty
``--layers``, a ``--max-length`` the logit lens cannot read, a file given as the demo's ``--runs``), else
before any work on the data (a tokenizer larger than the model's embedding, checked at load; a JSONL line
whose text is no string, named by file and line; a model of no layers). ``report`` says which analyses
apply to none of its checkpoints, and an error line never follows a progress bar on the same line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import CORPUS, save_tiny_checkpoint, tiny_config, tiny_tokenizer, train_args
from test_checks_first import BUDGET_S, run_program

from lime_model import cli as model_cli
from lime_model.checks import check_window, config_positions
from lime_model.command_line import run_command
from lime_probe import cli as probe_cli
from lime_probe.extraction.settings import Extraction

POSITIONS = 128  # the tiny checkpoints' max_position_embeddings (GPT-2: n_positions)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    import transformers as tf

    root = tmp_path_factory.mktemp("refusals")
    small = root / "small"  # a LLaMA of 100 embedding rows beside the 300-token tokenizer
    tf.AutoModelForCausalLM.from_config(tiny_config("llama", 100)).save_pretrained(small)
    tiny_tokenizer().save_pretrained(small)
    (root / "text.txt").write_text("\n\n".join(CORPUS * 4) + "\n")
    (root / "bad.jsonl").write_text('{"text": "The cat is here."}\n{"text": 5}\n')
    return {
        "llama": save_tiny_checkpoint(root / "llama", "llama"),
        "gpt2": save_tiny_checkpoint(root / "gpt2", "gpt2"),
        "small": small,
        "text": root / "text.txt",
        "bad": root / "bad.jsonl",
        "root": root,
    }


def _main(capsys, main, *argv) -> tuple[int, str]:
    """``main(argv)``'s exit code and stderr (what came before the call left out)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


# --------------------------------------------------------------------------- refused before torch is imported

# (id, program, argv with {llama} {gpt2} {text} {out} filled in, the message expected)
BEFORE_TORCH = [
    ("probe perplexity --window", "lime_probe.cli",
     "perplexity --ckpt {gpt2} --data {text} --window 100000 --out {out}",
     f"--window 100000 is longer than gpt2's {POSITIONS} positions: give --window <= {POSITIONS}"),
    ("probe entropy --window", "lime_probe.cli", "entropy --ckpt {llama} --data {text} --window 100000 --out {out}",
     f"--window 100000 is longer than llama's {POSITIONS} positions"),
    ("probe report --window", "lime_probe.cli", "report --ckpt {llama} --data {text} --window 129 --out {out}",
     f"--window 129 is longer than llama's {POSITIONS} positions"),
    ("probe perplexity --window 1", "lime_probe.cli", "perplexity --ckpt {gpt2} --data {text} --window 1 --out {out}",
     "--window must be an integer >= 2, got 1"),
    ("model eval --window", "lime_model.cli", "eval --ckpt {llama} --data {text} --window 100000 --out {out}",
     f"--window 100000 is longer than {{llama}}'s {POSITIONS} positions"),
    ("model eval --window 0", "lime_model.cli", "eval --ckpt {llama} --data {text} --window 0 --out {out}",
     "argument --window: expected a positive integer, got 0"),
    ("probe --layers ''", "lime_probe.cli", "entropy --ckpt {llama} --data {text} --layers= --out {out}",
     "--layers must be 'all' or comma-separated integers, got ''"),
    ("probe logit-lens --max-length 1", "lime_probe.cli",
     "logit-lens --ckpt {llama} --data {text} --max-length 1 --out {out}",
     "--max-length 1: logit-lens needs at least 2 tokens per sequence"),
    ("probe demo --runs FILE", "lime_probe.cli", "demo --runs {text} --out {out}",
     "lime-probe demo: error: --runs {text}: {text} is not a folder"),
    ("probe blimp --data missing", "lime_probe.cli", "blimp --ckpt {llama} --data {root}/no-blimp --out {out}",
     "--data {root}/no-blimp: no such file or folder"),
    ("probe blimp --data empty folder", "lime_probe.cli", "blimp --ckpt {llama} --data {llama} --out {out}",
     "--data {llama}: the folder holds no .jsonl file"),
    ("probe report --blimp missing", "lime_probe.cli",
     "report --ckpt {llama} --data {text} --blimp {root}/no-blimp --out {out}",
     "--blimp {root}/no-blimp: no such file or folder"),
    ("probe reproduce --data missing files", "lime_probe.cli", "reproduce --study lm-cpu --data {root} --out {out}",
     "data not found: {root}/wikitext-2/valid.txt"),
    ("probe patch --pairs missing", "lime_probe.cli", "patch --ckpt {llama} --pairs {root}/no-pairs.jsonl --out {out}",
     "--pairs {root}/no-pairs.jsonl: no such file"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("module", "argv", "needle"), [r[1:] for r in BEFORE_TORCH], ids=[r[0] for r in BEFORE_TORCH]
)
def test_refused_before_torch_in_one_line(files, tmp_path, module, argv, needle):
    out = tmp_path / "out"
    code, err, imported, cpu = run_program(module, argv.format(**files, out=out).split())
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle.format(**files) in err, err
    assert "torch" not in imported, f"torch was imported before the input was refused: {err}"
    assert cpu < BUDGET_S, f"{cpu:.2f} s of CPU to refuse {argv!r}"
    assert not out.exists()


def test_a_window_is_checked_against_the_positions_the_config_states():
    import transformers as tf

    assert config_positions({"max_position_embeddings": 64}) == 64
    assert config_positions(tf.GPT2Config(n_positions=32)) == 32  # GPT-2 names them n_positions
    assert config_positions({"rope_theta": 1e4}) is None  # none stated: any window goes
    check_window(64, {"max_position_embeddings": 64}, "m")  # the whole length is allowed
    check_window(10**6, {}, "m")
    check_window(None, {"max_position_embeddings": 64}, "m")  # the default
    with pytest.raises(ValueError, match="--window 65 is longer than m's 64 positions"):
        check_window(65, {"max_position_embeddings": 64}, "m")
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="--window must be an integer >= 1"):
            check_window(bad, {"max_position_embeddings": 64}, "m")


def test_model_eval_refuses_a_long_window_before_reading_the_weights(files, monkeypatch):
    """The library: the positions are read from the config, and the weights are never read."""
    import transformers as tf

    from lime_model.evaluate import perplexity

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read before the window was checked")

    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(
        ValueError, match=f"--window {POSITIONS + 1} is longer than .*'s {POSITIONS} positions"
    ):
        perplexity(files["llama"], str(files["text"]), window=POSITIONS + 1)
    with pytest.raises(ValueError, match="--window must be an integer >= 2, got 1"):
        perplexity(files["llama"], str(files["text"]), window=1)


@pytest.mark.parametrize("analysis", ["perplexity", "entropy"])
def test_the_analyses_refuse_a_long_window_on_a_loaded_model(files, analysis):
    """A hub id has no config.json to read first: the analysis itself refuses, before any forward pass."""
    from lime_probe.extraction.loading import load
    from lime_probe.specs import ANALYSES, Checkpoint

    ck = Checkpoint("gpt2", str(files["gpt2"]), *load(files["gpt2"]))
    with pytest.raises(
        ValueError, match=f"--window {POSITIONS + 1} is longer than gpt2's {POSITIONS} positions"
    ):
        ANALYSES[analysis].run([ck], CORPUS, Extraction(), window=POSITIONS + 1)


# --------------------------------------------------------------------------- a tokenizer larger than the embedding

EMBEDDING = "has 300 tokens but the model's embedding holds 100 rows"


def test_load_refuses_a_tokenizer_larger_than_the_embedding(files):
    from lime_probe.extraction.loading import load

    with pytest.raises(ValueError, match=EMBEDDING):
        load(files["small"])


@pytest.mark.parametrize("command", ["entropy", "logit-lens"])
def test_probe_refuses_a_tokenizer_larger_than_the_embedding(files, tmp_path, capsys, command):
    argv = [command, "--ckpt", files["small"], "--data", files["text"], "--no-cache", "--out", tmp_path / "o"]
    code, err = _main(capsys, probe_cli.main, *argv)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert (
        err.startswith(f"lime-probe {command}: error: the tokenizer of checkpoint {files['small']} ")
        and EMBEDDING in err
    )
    assert not (tmp_path / "o").exists()


def test_model_eval_refuses_a_tokenizer_larger_than_the_embedding(files, tmp_path, capsys):
    argv = ["eval", "--ckpt", files["small"], "--data", files["text"], "--out", tmp_path / "o"]
    code, err = _main(capsys, model_cli.main, *argv)
    assert code == 2 and len(err.splitlines()) == 1 and EMBEDDING in err, err
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- a JSONL text that is no string


def test_load_texts_names_the_file_and_line_of_a_text_that_is_no_string(files, tmp_path):
    from lime_model.data import load_texts

    with pytest.raises(ValueError, match=rf'^{files["bad"]}:2: "text" is 5, expected a string$'):
        load_texts(str(files["bad"]))
    listed = tmp_path / "list.jsonl"
    listed.write_text('{"text": ["a", "b"]}\n')
    with pytest.raises(ValueError, match=r'list.jsonl:1: "text" is \["a", "b"\], expected a string'):
        load_texts(str(listed))
    nulls = tmp_path / "nulls.jsonl"  # a null is an empty document, as in a parquet column: skipped
    nulls.write_text('{"text": null}\n{"text": "The cat."}\n')
    assert load_texts(str(nulls)) == ["The cat."]


def test_a_parquet_text_column_of_numbers_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lime_model.data import load_texts

    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(ValueError, match=rf'^{path}: the "text" column holds int64, expected strings$'):
        load_texts(str(path))


def test_entropy_names_the_line_whose_text_is_no_string(files, tmp_path, capsys):
    argv = [
        "entropy",
        "--ckpt",
        files["llama"],
        "--data",
        files["bad"],
        "--no-cache",
        "--out",
        tmp_path / "o",
    ]
    code, err = _main(capsys, probe_cli.main, *argv)
    assert code == 2, err
    assert err == f'lime-probe entropy: error: {files["bad"]}:2: "text" is 5, expected a string'
    assert not (tmp_path / "o").exists()


def test_train_names_the_line_whose_text_is_no_string(files, tmp_path, capsys):
    code, err = _main(capsys, model_cli.main, *train_args(tmp_path / "run", files["bad"]))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.endswith(f'{files["bad"]}:2: "text" is 5, expected a string'), err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- sizes of no model


@pytest.mark.parametrize("size", ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_lime_config_refuses_a_size_that_is_no_count(size, value):
    from lime_model import LimeConfig, config_for

    with pytest.raises(ValueError, match=rf"^{size} must be an integer >= 1, got {value!r}$"):
        LimeConfig(**{size: value})
    with pytest.raises(ValueError, match=rf"^{size} must be an integer >= 1"):  # the baselines: LimeConfigs
        config_for("denseformer", **{size: value})


def test_lime_config_keeps_transformers_validation_as_one_line():
    from lime_model import LimeConfig

    config = LimeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    assert (config.num_hidden_layers, config.head_dim) == (1, 8)
    with pytest.raises(
        ValueError, match=r"The hidden size \(30\) is not a multiple of the number of attention heads \(4\)"
    ):
        LimeConfig(hidden_size=30, num_attention_heads=4, num_key_value_heads=4)


def test_train_refuses_a_model_of_no_layers(files, tmp_path, capsys):
    argv = train_args(tmp_path / "run", files["text"], "--set", "model.num_hidden_layers=0")
    code, err = _main(capsys, model_cli.main, *argv)
    assert code == 2, err
    assert err == "lime-model: error: recipe key model.num_hidden_layers must be an integer >= 1, got 0"
    assert not (tmp_path / "run").exists()


def test_an_empty_layers_value_is_not_all_layers():
    from lime_probe.extraction.settings import layer_list

    assert layer_list("all") is None and layer_list(None) is None and layer_list("0,-1") == [0, -1]
    with pytest.raises(ValueError, match="got ''"):
        layer_list("")


def test_logit_lens_refuses_one_token_sequences_before_a_forward_pass(files, monkeypatch):
    import importlib

    from lime_probe.extraction.loading import load
    from lime_probe.specs import ANALYSES, Checkpoint

    tracing = importlib.import_module("lime_probe.extraction.tracing")

    def no_pass(*args, **kwargs):
        raise AssertionError("a forward pass ran before --max-length was checked")

    monkeypatch.setattr(tracing, "extract", no_pass)
    ck = Checkpoint("llama", str(files["llama"]), *load(files["llama"]))
    with pytest.raises(ValueError, match="--max-length 1: logit-lens needs at least 2 tokens per sequence"):
        ANALYSES["logit-lens"].run([ck], CORPUS, Extraction(max_length=1))


# --------------------------------------------------------------------------- what report leaves out; lines after bars


def test_report_says_which_analysis_applies_to_none_of_its_checkpoints(files, tmp_path, capsys):
    argv = ["report", "--ckpt", files["llama"], "--data", files["text"], "--analyses", "entropy", "router"]
    argv += ["--window", 16, "--num-windows", 2, "--max-sequences", 8, "--no-cache", "--out", tmp_path / "r"]
    code, err = _main(capsys, probe_cli.main, *argv)
    assert code == 0, err  # nothing the input could have given was missed: no exit 3
    line = (
        "lime-probe report: skipped router: it applies to LIMe checkpoints with routers and the cross-layer "
        "baselines, and none of these is one"
    )
    assert line in err.splitlines(), err
    html = (tmp_path / "r" / "report.html").read_text()
    assert "Skipped sections" in html and "it applies to LIMe checkpoints with routers" in html


@pytest.mark.parametrize(
    ("failure", "line", "code"),
    [
        (ValueError("bad input"), "prog cmd: error: bad input", 2),
        (
            RuntimeError("boom"),
            "prog cmd: failed: RuntimeError: boom (rerun with --debug for the traceback)",
            1,
        ),
        (KeyboardInterrupt(), "prog cmd: interrupted; nothing was written", 130),
    ],
)
def test_an_error_line_starts_its_own_line_after_a_progress_bar(capsys, failure, line, code):
    import signal

    from tqdm import tqdm

    capsys.readouterr()
    bar = tqdm(total=10, file=sys.stderr, desc="extract", mininterval=0)
    bar.update(3)  # drawn half-way, no newline after it: the failure comes mid-loop

    def work():
        raise failure

    handler = signal.getsignal(signal.SIGINT)
    try:
        assert run_command("prog cmd", work, debug=False, interrupted="nothing was written") == code
    finally:
        signal.signal(signal.SIGINT, handler)  # run_command ignores a second Ctrl-C after the first
    err = capsys.readouterr().err
    assert err.endswith("\n" + line + "\n"), repr(err)  # its own line, the bar's above it
    assert "3/10" in err.split("\n")[-3]  # the bar is left where it stopped
    assert bar.disable  # closed: nothing redraws it after the line


def test_a_word_too_rare_is_refused_from_its_tokens_before_any_forward_pass(files, monkeypatch):
    """separability counts the words on the tokens first: the refusal names each word's count and no
    extraction runs (it used to come after a full extraction)."""
    import lime_probe.extraction.tracing as tracing
    from lime_probe.extraction.loading import load
    from lime_probe.specs import ANALYSES, Checkpoint

    model, tok = load(files["llama"])

    def no_extraction(*args, **kwargs):
        raise AssertionError("extract ran before the word counts were checked")

    monkeypatch.setattr(tracing, "extract", no_extraction)
    ck = Checkpoint("llama", str(files["llama"]), model, tok)
    with pytest.raises(
        ValueError, match=r"too rare in the data .*' is': 2, ' are': 1, ' was': 1, ' were': 0"
    ):
        ANALYSES["separability"].run(
            [ck], ["The cat is here.", "It is.", "They are.", "It was."], Extraction(max_length=64)
        )
