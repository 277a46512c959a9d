"""``lime-model eval-downstream``: lm-eval's scores on a local task match a plain loop over choices.

Offline: a small multiple-choice task YAML with a JSONL data file, written here, on tiny random
LIMe and LLaMA checkpoints. The independent computation scores each choice as lm-eval documents
it (the summed log-probability of ``" " + choice`` after the question, with the pair tokenized
together and split at the question's tokens), with one plain forward pass per choice, and takes
the accuracy (argmax) and the length-normalised accuracy (argmax of the sum over the choice's
characters) by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import save_tiny_checkpoint

from lime_model import cli

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lime-probe[eval]')")

DOCS = [
    {"question": "The cat", "choices": ["is on the mat.", "are on the mat.", "were clean."], "label": 0},
    {"question": "They", "choices": ["was happy.", "were happy.", "is the dog."], "label": 1},
    {"question": "The rivers were", "choices": ["clean.", "a function.", "happy because"], "label": 0},
    {"question": "A model is", "choices": ["the garden.", "a time.", "a function."], "label": 2},
    {"question": "The quick brown fox", "choices": ["jumps over the lazy dog.", "is who it is."], "label": 0},
    {"question": "She was", "choices": ["in the garden.", "happy.", "the results.", "clean."], "label": 1},
]
LIMIT = 5  # lm-eval keeps the first 5 documents


def write_task(folder: Path, docs: list[dict] = DOCS, name: str = "tiny_mc") -> Path:
    """A local multiple-choice task ``name`` in ``folder``: its YAML and its JSONL data."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n"
        + "".join(
            f"  - {{metric: {m}, aggregation: mean, higher_is_better: true}}\n" for m in ("acc", "acc_norm")
        )
    )
    return folder


@torch.no_grad()
def choice_logliks(model, tokenizer, question: str, choices: list[str]) -> list[float]:
    """Summed log-probability of each ``" " + choice`` after ``question`` (one forward per choice)."""
    n_context = len(tokenizer(question)["input_ids"])
    out = []
    for choice in choices:
        ids = tokenizer(question + " " + choice)["input_ids"]
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        out.append(sum(float(logp[t - 1, ids[t]]) for t in range(n_context, len(ids))))
    return out


def by_hand(ckpt: Path, docs: list[dict]) -> tuple[list[int], list[int]]:
    """Per document, the choice with the highest summed log-probability, and the highest per character."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    best, best_norm = [], []
    for doc in docs:
        lls = choice_logliks(model, tokenizer, doc["question"], doc["choices"])
        per_char = [ll / len(c) for ll, c in zip(lls, doc["choices"], strict=True)]
        best.append(max(range(len(lls)), key=lls.__getitem__))
        best_norm.append(max(range(len(lls)), key=per_char.__getitem__))
    return best, best_norm


@pytest.mark.parametrize("arch", ["lime", "llama"])
@pytest.mark.parametrize("labels", ["given", "loop"])
def test_accuracy_matches_a_plain_loop(tmp_path, arch, labels, capsys):
    """With the given labels, lm-eval's acc and acc_norm equal the loop's; with each label set to
    the loop's own pick, lm-eval's acc is 1 only if it picks the same choice on every document."""
    ckpt = save_tiny_checkpoint(tmp_path / arch, arch)
    best, best_norm = by_hand(ckpt, DOCS[:LIMIT])
    docs = DOCS if labels == "given" else [{**d, "label": b} for d, b in zip(DOCS, best + [0], strict=True)]
    tasks = write_task(tmp_path / "tasks", docs)
    code = cli.main(
        ["eval-downstream", "--ckpt", str(ckpt), "--tasks", "tiny_mc", "--include-path", str(tasks),
         "--limit", str(LIMIT), "--batch-size", "2", "--threads", "1"]
    )  # fmt: skip
    assert code == 0
    path = ckpt / "downstream" / f"tiny_mc.limit{LIMIT}.json"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(path)
    report = json.loads(path.read_text())
    gold = [d["label"] for d in docs[:LIMIT]]
    acc = sum(b == g for b, g in zip(best, gold, strict=True)) / LIMIT
    acc_norm = sum(b == g for b, g in zip(best_norm, gold, strict=True)) / LIMIT
    assert report["results"]["tiny_mc"]["acc,none"] == pytest.approx(acc)
    assert report["results"]["tiny_mc"]["acc_norm,none"] == pytest.approx(acc_norm)
    assert report["n-samples"]["tiny_mc"]["effective"] == LIMIT
    info = report["run_info"]
    assert (info["limit"], info["threads"], info["batch_size"]) == (LIMIT, 1, 2)
    assert info["lm_eval_version"] == __import__("lm_eval").__version__


def test_packaged_demo_task(tmp_path):
    """``agreement_demo`` ships with the package and runs offline without --include-path."""
    from lime_model.downstream import TASKS_DIR

    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    docs = [json.loads(line) for line in (TASKS_DIR / "agreement_demo" / "agreement_demo.jsonl").open()]
    argv = ["eval-downstream", "--ckpt", str(ckpt), "--tasks", "agreement_demo", "--threads", "1"]
    assert cli.main(argv) == 0
    report = json.loads((ckpt / "downstream" / "agreement_demo.json").read_text())
    best, _ = by_hand(ckpt, docs)
    acc = sum(b == d["label"] for b, d in zip(best, docs, strict=True)) / len(docs)
    assert report["n-samples"]["agreement_demo"]["effective"] == len(docs) == 16
    assert report["results"]["agreement_demo"]["acc,none"] == pytest.approx(acc)


def test_out_folder_and_fewshot(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    tasks = write_task(tmp_path / "tasks")
    out = tmp_path / "elsewhere"
    argv = ["eval-downstream", "--ckpt", str(ckpt), "--tasks", "tiny_mc", "--include-path", str(tasks)]
    assert cli.main([*argv, "--limit", "2", "--num-fewshot", "1", "--seed", "7", "--out", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["tiny_mc.1shot.limit2.json"]
    report = json.loads((out / "tiny_mc.1shot.limit2.json").read_text())
    assert report["n-shot"]["tiny_mc"] == 1
    seeds = ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")
    assert report["run_info"]["seed"] == dict.fromkeys(seeds, 7)
    assert not (ckpt / "downstream").exists()


def _error(argv: list[str], capsys) -> str:
    capsys.readouterr()  # drop what saving the checkpoint printed
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lime-model: error: "), err
    return err


def test_missing_checkpoint(tmp_path, capsys):
    tasks = write_task(tmp_path / "tasks")
    argv = ["eval-downstream", "--ckpt", str(tmp_path / "nope"), "--tasks", "tiny_mc"]
    err = _error([*argv, "--include-path", str(tasks)], capsys)
    assert "nope is not a model directory" in err


@pytest.mark.slow
def test_unknown_task(tmp_path, capsys):
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    err = _error(["eval-downstream", "--ckpt", str(ckpt), "--tasks", "arc_easy,no_such_task"], capsys)
    assert "unknown lm-eval task(s) no_such_task" in err and "--include-path" in err
    assert not (ckpt / "downstream").exists()


@pytest.mark.slow
def test_hub_task_offline(tmp_path, capsys, monkeypatch):
    """A hub task without network: one line that says so and points to --include-path."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    err = _error(["eval-downstream", "--ckpt", str(ckpt), "--tasks", "copa", "--limit", "2"], capsys)
    assert "could not load the data of task copa" in err and "--include-path" in err
    assert not (ckpt / "downstream").exists()


def test_lm_eval_not_installed(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # makes `import lm_eval` raise ImportError
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    err = _error(["eval-downstream", "--ckpt", str(ckpt), "--tasks", "arc_easy"], capsys)
    assert "lm-eval is not installed" in err and "lime-probe[eval]" in err


def test_bad_device_and_limit(tmp_path, capsys):
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    tasks = write_task(tmp_path / "tasks")
    argv = ["eval-downstream", "--ckpt", str(ckpt), "--tasks", "tiny_mc", "--include-path", str(tasks)]
    assert "--device 'gpu0'" in _error([*argv, "--device", "gpu0"], capsys)
    assert "--limit must be >= 1" in _error([*argv, "--limit", "0"], capsys)
    assert "--include-path" in _error([*argv[:-1], str(tmp_path / "missing")], capsys)


# Presets. Table 1's columns and shots as the paper prints them (Sec. 5.1, Table 1's caption), and
# App. C Tables 7-9's, written here by hand as lm-eval task names.
TABLE1 = ["multirc", "wic", "qnli", "arc_easy", "arc_challenge",
          "bigbench_key_value_maps_multiple_choice", "bigbench_mathematical_induction_multiple_choice"]  # fmt: skip
APPENDIX_C = ["copa", "multirc", "wic", "qnli", "wnli", "arc_easy", "arc_challenge", "hellaswag", "openbookqa",
              "bigbench_key_value_maps_multiple_choice", "bigbench_mathematical_induction_multiple_choice",
              "bigbench_implicit_relations_multiple_choice",
              "bigbench_reasoning_about_colored_objects_multiple_choice"]  # fmt: skip


def test_paper_presets_are_the_papers_tables():
    from lime_model.downstream import DEFAULT_PRESET, PRESETS

    assert (list(PRESETS["paper"].tasks), PRESETS["paper"].num_fewshot) == (TABLE1, 3)
    assert (sorted(PRESETS["paper-appendix"].tasks), PRESETS["paper-appendix"].num_fewshot) == (
        sorted(APPENDIX_C),
        3,
    )
    assert PRESETS["official-readme"].num_fewshot is None  # the README table states no shot count
    assert (
        DEFAULT_PRESET == "paper" == cli.build_parser().parse_args(["eval-downstream", "--ckpt", "x"]).tasks
    )


def test_paper_presets_against_the_papers_text():
    """Table 1's header row and its caption's shot count, in the paper's own text."""
    import os

    path = os.environ.get("LIME_PROBE_PAPER")
    if not path or not Path(path).is_file():
        pytest.skip("LIME_PROBE_PAPER (the paper's text) is not set")
    text = Path(path).read_text()
    assert "Model\tMultiRC\tWiC\tQNLI\tARC-E\tARC-C\tKV\tInduction\tAvg" in text
    assert "Table 1: LM Evaluation Harness results on 1B models with GQA in 3-shot setup." in text
    for header in ("COPA (50)\tMultiRC (50)\tWiC (50)\tQNLI (50)\tWNLI (50)",
                   "ARC-E (25)\tARC-C (25)\tHellaSwag (25)\tOBQA (25)",
                   "KV (50)\tInduction (50)\tIR (0.04)\tCO (0.06)"):  # fmt: skip
        assert header in text


@pytest.mark.slow
def test_every_preset_task_is_known_to_the_installed_lm_eval():
    """Every preset's names are in lm-eval's task index (names only: no data is downloaded)."""
    from lm_eval.tasks import TaskManager

    from lime_model.downstream import PRESETS

    known = set(TaskManager().all_tasks)
    missing = {name: [t for t in p.tasks if t not in known] for name, p in PRESETS.items()}
    assert missing == dict.fromkeys(PRESETS, [])


def test_a_preset_sets_tasks_shots_and_file_name(tmp_path, monkeypatch):
    """A preset name runs its tasks at its shots (unless --num-fewshot says otherwise) and names the file."""
    from lime_model import downstream

    monkeypatch.setitem(downstream.PRESETS, "demo", downstream.Preset(("agreement_demo",), 1, "a test"))
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    argv = ["eval-downstream", "--ckpt", str(ckpt), "--tasks", "demo", "--limit", "2", "--threads", "1"]
    assert cli.main(argv) == 0
    report = json.loads((ckpt / "downstream" / "demo.1shot.limit2.json").read_text())
    assert report["n-shot"]["agreement_demo"] == 1
    assert (report["run_info"]["preset"], report["run_info"]["tasks"]) == ("demo", ["agreement_demo"])
    assert cli.main([*argv, "--num-fewshot", "0"]) == 0
    report = json.loads((ckpt / "downstream" / "demo.0shot.limit2.json").read_text())
    assert report["n-shot"]["agreement_demo"] == 0


def test_preset_mixed_with_tasks(tmp_path, capsys):
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    err = _error(["eval-downstream", "--ckpt", str(ckpt), "--tasks", "paper,agreement_demo"], capsys)
    assert "preset paper cannot be combined" in err
