"""Hub-ready run folders: the model's code and ``auto_map`` travel with the weights, and a model card.

The clean-environment checks run in subprocesses whose ``sitecustomize`` makes ``lime_model``
unimportable and drops the repository from ``sys.path``: stock transformers (and the ``lm_eval`` CLI)
must load the folders with ``trust_remote_code=True`` from the files in them alone. Their logits and
lm-eval's accuracy are compared with the in-repo model's, computed here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BASELINES, save_tiny_checkpoint
from transformers import AutoModelForCausalLM

import lime_model
from lime_model import train as T

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "model": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "seq_len": 32, "batch_size": 4, "micro_batch_size": 4, "steps": 3, "warmup_steps": 1, "log_every": 1,
    "eval_holdout": 0.1,
}  # fmt: skip
MODEL_FILES = {
    "config.py",
    "modeling.py",
    "routing.py",
    "router.py",
    "kv_buffer.py",
    "kv_kernels.py",
    "kv_read.py",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A LIMe (routing "full") trained for 3 steps by ``lime-model train``'s loop."""
    tmp = tmp_path_factory.mktemp("hub")
    text = tmp / "t.txt"
    text.write_text("\n\n".join(f"document {i} says the cat sat on mat number {i % 13}" for i in range(80)))
    return T.train(
        "cpu-tiny", tmp / "lime-run", progress=False, data=str(text), cache_dir=str(tmp / "c"), **TINY
    )


def test_run_folder_carries_its_code_and_auto_map(run):
    config = json.loads((run / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "config.LimeConfig",
        "AutoModelForCausalLM": "modeling.LimeForCausalLM",
    }
    assert {p.name for p in run.glob("*.py")} == MODEL_FILES
    for name in MODEL_FILES:  # the package's own source, unchanged (its imports are all relative)
        assert (run / name).read_text() == (REPO / "lime_model" / name).read_text()
        assert "lime_model" not in [
            line.split()[1].split(".")[0] for line in (run / name).read_text().splitlines()
            if line.startswith(("import ", "from "))
        ]  # fmt: skip


def test_model_card(run):
    """README.md states the recipe, data, steps, routing and the last logged numbers of metrics.jsonl."""
    card = (run / "README.md").read_text()
    recipe = json.loads((run / "recipe.json").read_text())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    assert card.startswith("---\n")
    assert "- routing-full" in card and "routing `full`" in card
    assert f"The recipe's description, as written: {recipe['description']}" in card  # --set may differ
    assert f"data `{recipe['data']}`" in card
    assert f"{last['step']} steps of 4 sequences of 32 tokens, {last['tokens']:,} tokens seen" in card
    assert f"final training loss {last['loss']:.4f} (step 3)" in card
    assert f"held-out loss {last['val_loss']:.4f}, perplexity {math.exp(last['val_loss']):.2f}" in card
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(run).parameters())
    assert f"({n_params:,} parameters)" in card  # tied head: counted once by both
    assert f'from_pretrained("{run.resolve()}", trust_remote_code=True)' in card  # loads from any folder


def test_parameter_count_sums_every_shard_without_reading_the_tensors(tmp_path):
    """The card's count over a sharded model in any dtype: the tensors' element counts, summed here."""
    from safetensors.torch import save_file

    from lime_model.hub import _n_parameters

    shards = [
        {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)},
        {"c": torch.zeros(2, 3, 7, dtype=torch.float16), "d": torch.zeros((), dtype=torch.int64)},
    ]
    for i, tensors in enumerate(shards):
        save_file(tensors, tmp_path / f"model-{i + 1:05d}-of-00002.safetensors", metadata={"format": "pt"})
    assert _n_parameters(tmp_path) == sum(t.numel() for s in shards for t in s.values()) == 60
    assert _n_parameters(tmp_path / "absent") is None


def test_model_card_parses_with_a_license_and_its_tokenizer_line_needs_no_remote_code(run, tmp_path):
    """The card is what ``huggingface_hub`` reads (metadata with a license); its usage block's tokenizer
    line, run as written from another folder in a process without ``lime_model``, loads the run's tokenizer
    without asking about remote code (stdin closed: a prompt would show in the output)."""
    from huggingface_hub import ModelCard
    from transformers import AutoTokenizer

    card = ModelCard.load(run / "README.md")
    assert card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and "routing-full" in card.data.tags
    code = card.text.split("```python\n")[1].split("```")[0]
    (line,) = [ln for ln in code.splitlines() if ln.startswith("tokenizer =")]
    assert "trust_remote_code" not in line
    imports = [ln for ln in code.splitlines() if ln.startswith("from ")]
    script = "\n".join([*imports, line, "print(tokenizer('the cat sat')['input_ids'])"])
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=_clean_env(tmp_path), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "custom code" not in done.stdout + done.stderr, done.stdout + done.stderr
    want = AutoTokenizer.from_pretrained(run)("the cat sat")["input_ids"]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want


def test_lime_probe_still_loads_the_registered_classes(run):
    """With ``lime_model`` imported, a plain load (no trust_remote_code) takes the in-repo classes."""
    from lime_probe.extraction.loading import load

    model, _ = load(run)
    assert type(model._module) is lime_model.LimeForCausalLM  # under nnsight's wrapper


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """Environment for a subprocess where ``lime_model`` cannot be imported and the repository is off
    ``sys.path`` (a ``sitecustomize`` runs before anything else); remote code is cached under tmp."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != {str(REPO)!r}]\n"
        "sys.modules['lime_model'] = None  # any import of it raises ImportError\n"
    )
    return {
        **os.environ,
        "PYTHONPATH": str(site),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


LOAD = """
import os, sys, torch
from transformers import AutoModelForCausalLM
try:
    import lime_model
except ImportError:
    pass
else:
    raise SystemExit("lime_model is importable")
assert {repo!r} not in map(os.path.realpath, sys.path), sys.path
ids = torch.tensor([[1, 5, 9, 42, 7, 3, 250, 11]])
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model)
    with torch.no_grad():
        torch.save(model(ids).logits, folder + "/remote_logits.pt")
"""


@pytest.mark.slow
def test_loads_with_stock_transformers_without_lime_model(run, tmp_path):
    """The trained LIMe and every baseline's saved folder load through ``trust_remote_code`` in a clean
    process; their logits equal the in-repo models' exactly."""
    folders = [shutil.copytree(run, tmp_path / "lime")] + [
        save_tiny_checkpoint(tmp_path / arch, arch) for arch in BASELINES
    ]
    script = tmp_path / "load.py"
    script.write_text(LOAD.format(repo=str(REPO)))
    done = subprocess.run(
        [sys.executable, str(script), *map(str, folders)],
        cwd=tmp_path,
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 250, 11]])
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(model).__module__.startswith("lime_model.")
        with torch.no_grad():
            expected = model(ids).logits
        assert torch.equal(torch.load(folder / "remote_logits.pt"), expected), folder.name


@pytest.mark.slow
def test_lm_eval_cli_with_trust_remote_code(run, tmp_path):
    """The standard ``lm_eval`` CLI scores the run on the packaged local task, in a clean process, with
    the accuracy of a plain loop over the choices on the in-repo model."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lime-probe[eval]')")
    lm_eval = Path(sys.executable).with_name("lm_eval")
    if not lm_eval.is_file():
        pytest.skip("the lm_eval command is not installed next to this Python")
    from test_downstream import by_hand

    from lime_model.downstream import TASKS_DIR

    done = subprocess.run(
        [str(lm_eval), "--model", "hf", "--model_args", f"pretrained={run},trust_remote_code=True",
         "--tasks", "agreement_demo", "--include_path", str(TASKS_DIR), "--device", "cpu",
         "--batch_size", "4", "--output_path", str(tmp_path / "out")],
        cwd=tmp_path, env=_clean_env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    report = json.loads(results.read_text())
    docs = [json.loads(line) for line in (TASKS_DIR / "agreement_demo" / "agreement_demo.jsonl").open()]
    best, _ = by_hand(run, docs)
    acc = sum(b == d["label"] for b, d in zip(best, docs, strict=True)) / len(docs)
    assert report["n-samples"]["agreement_demo"]["effective"] == len(docs)
    assert report["results"]["agreement_demo"]["acc,none"] == pytest.approx(acc)
