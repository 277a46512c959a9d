"""Tiny random models and a tiny tokenizer for tests (no network, a few ms to build).

    tok = tiny_tokenizer()                      # byte-level BPE, pad/bos/eos/unk, " is" etc. single tokens
    model = tiny_model("llama", tok)            # random LlamaForCausalLM, 2 layers, hidden 32
    path = save_tiny_checkpoint(tmp_path, "gpt2")  # save_pretrained model + tokenizer, returns the dir

Architectures: "llama" (with GQA: 4 heads, 2 kv heads), "lime" and the cross-layer baselines
"denseformer", "resformer", "hyperconnections" (need `lime_model`), "gpt2", "gpt_neox", "bert"; and
"qwen2", "phi", "mistral", "opt". Every model is built from a config with a fixed seed, in eval mode,
float32.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ARCHS = ("llama", "lime", "denseformer", "resformer", "hyperconnections", "gpt2", "gpt_neox", "bert")
HF_CONFIGS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "mistral": "MistralConfig",
    "phi": "PhiConfig",
    "opt": "OPTConfig",
    "gpt2": "GPT2Config",
    "gpt_neox": "GPTNeoXConfig",
    "bert": "BertConfig",
}  # transformers' config class of each tiny architecture that is not lime_model's
BASELINES = (
    "denseformer",
    "resformer",
    "hyperconnections",
)  # lime_model's cross-layer baselines (LLaMA sizes, routing "none")


def isolate_registries(monkeypatch) -> None:
    """Give the test copies of the analysis, adapter and routing registries (restored after it), so what
    docs/extending.md's examples register there is seen by no later test."""
    from lime_model import routing
    from lime_probe import specs
    from lime_probe.extraction import adapters

    monkeypatch.setattr(routing, "ROUTINGS", dict(routing.ROUTINGS))
    monkeypatch.setattr(specs, "ANALYSES", dict(specs.ANALYSES))
    monkeypatch.setattr(adapters, "ADAPTERS", dict(adapters.ADAPTERS))


def routed_specs() -> list[str]:
    """One routing spec per kind with routers in `lime_model.routing.ROUTINGS` (``<kind>-2`` for the
    parametric kinds), so that a new variant is tested wherever these are."""
    from lime_model.routing import ROUTINGS

    return [f"{kind}-2" if k.parametric else kind for kind, k in ROUTINGS.items() if k.router is not None]


# The paper's 1B configuration (Table 16's rows use it with 8 or 32 K/V heads).
PAPER_1B = dict(
    vocab_size=50257,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    tie_word_embeddings=True,
)

# `lime-model train` flags for a 2-layer model that trains in well under a second.
TINY_TRAIN = [
    "--set", "model.hidden_size=32", "--set", "model.intermediate_size=64", "--set", "model.num_hidden_layers=2",
    "--set", "model.vocab_size=300", "--set", "seq_len=32", "--set", "batch_size=4",
    "--set", "micro_batch_size=4", "--set", "log_every=1", "--no-progress",
]  # fmt: skip


def train_args(out, data, *extra, steps: int = 2) -> list[str]:
    """``lime-model train`` argv: ``steps`` steps of the tiny model on ``data``, writing ``out``;
    ``extra`` flags come last, so their ``--set``s override the tiny ones."""
    return ["train", "--recipe", "cpu-tiny", "--out", str(out), "--data", str(data), "--steps", str(steps),
            *TINY_TRAIN, *extra]  # fmt: skip


SPECIALS = {
    "pad_token": "<pad>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
}

CORPUS = [
    "The cat is on the mat and the dogs are in the garden.",
    "She was happy because the results were good.",
    "It is what it is, they are who they are.",
    "There was a time when the rivers were clean.",
    "A model is a function; layers are functions too.",
    "The quick brown fox jumps over the lazy dog.",
]

# BLiMP-style minimal pairs (good, bad) over the corpus vocabulary
PAIRS = [
    ("The cat is here.", "The cat are here."),
    ("They were happy.", "They was happy."),
    ("It is what it is.", "It are what it is."),
    ("The dogs are in the garden.", "The dogs is in the garden."),
    ("She was happy.", "She were happy."),
    ("The rivers were clean.", "The rivers was clean."),
]


def tiny_tokenizer(corpus: list[str] | None = None, vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `corpus` (default: a few English sentences).

    Words from the corpus that are frequent enough (" is", " are", " was", " were", " the")
    become single tokens, as in GPT-2's tokenizer. Specials: <pad> (id 0), <s>, </s>, <unk>, <mask>.
    """
    tok = Tokenizer(models.BPE(unk_token=SPECIALS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or CORPUS) * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIALS)


def tiny_config(arch: str, vocab_size: int, **overrides):
    """A config for a tiny random model: 2 layers, hidden 32, 4 heads (2 kv heads in the families with
    grouped-query attention: LLaMA, LIMe and its baselines, Qwen2, Mistral)."""
    import transformers as tf

    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128)  # fmt: skip
    if arch in ("llama", "lime", "qwen2", "mistral", *BASELINES):
        kw |= special | dict(num_key_value_heads=2)
    elif arch == "gpt2":
        kw = dict(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=128, **special)
    elif arch == "opt":  # the MLP's width is ffn_dim
        kw = {k: v for k, v in kw.items() if k != "intermediate_size"} | special
        kw |= dict(ffn_dim=64, word_embed_proj_dim=32)
    elif arch == "bert":
        kw["pad_token_id"] = 0
    else:
        kw |= special
    kw |= overrides
    if arch == "lime":
        import lime_model  # registers LimeConfig

        return lime_model.LimeConfig(**{"routing": "full", **kw})
    if arch in BASELINES:
        import lime_model

        return lime_model.config_for(arch, **kw)
    if arch not in HF_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted({*ARCHS, *HF_CONFIGS})}")
    return getattr(tf, HF_CONFIGS[arch])(**kw)


def tiny_model(arch: str, tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0, **overrides):
    """A random model of `arch` sized to `tokenizer`'s vocabulary; causal LMs have an LM head,
    BERT is a masked LM. Eval mode, float32."""
    import transformers as tf

    vocab = len(tokenizer or tiny_tokenizer())
    config = tiny_config(arch, vocab, **overrides)
    torch.manual_seed(seed)
    auto = tf.AutoModelForMaskedLM if arch == "bert" else tf.AutoModelForCausalLM
    return auto.from_config(config).eval()


def save_tiny_checkpoint(directory: str | Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random `arch` model and its tokenizer into `directory` (created); return it."""
    directory = Path(directory)
    tok = tiny_tokenizer()
    tiny_model(arch, tok, seed=seed, **overrides).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def write_blimp_dir(directory: str | Path) -> Path:
    """Write two BLiMP-format paradigms (``agreement_a``/``_b``) of ``PAIRS`` into ``directory`` (created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for uid in ("agreement_a", "agreement_b"):
        rows = [
            {
                "sentence_good": g,
                "sentence_bad": b,
                "UID": uid,
                "pairID": str(k),
                "field": "syntax",
                "linguistics_term": "subject_verb_agreement",
            }
            for k, (g, b) in enumerate(PAIRS * 2)
        ]
        (directory / f"{uid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def torchrun(*args: str, env: dict[str, str] | None = None, timeout: int = 400):
    """Run ``args`` (a script and its arguments, or ``-m module ...``) under torchrun on two CPU processes
    (gloo; a free port); asserts they succeed and returns the completed process. The processes import
    the ``lime_model`` under test: a script's folder, not the working directory, heads their
    ``sys.path``, so the package's root goes on ``PYTHONPATH``. One thread each."""
    import os
    import subprocess
    import sys

    import lime_model

    root = str(Path(lime_model.__file__).parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **(env or {}), "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def bench_script(name: str):
    """``bench/NAME.py`` imported as a module (``bench/`` holds scripts, not a package)."""
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


DOCS = CORPUS * 3  # the command-line tests' documents: every probed word occurs at least 5 times


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``lime-probe ARGV`` through its entry point: (exit code, stdout, stderr)."""
    from lime_probe import cli

    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_ok(capsys, *argv) -> str:
    """`run_cli` of a command that must succeed: its stdout."""
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    return stdout


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def digits_checkpoint(directory: Path) -> Path:
    """A tiny LLaMA whose tokenizer knows digits and arithmetic only: English is mostly its unknown token."""
    from lime_model.tokenization import char_tokenizer

    tok = char_tokenizer("0123456789+-*/()= ")
    tiny_model("llama", tok).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def word_features(ckpt: Path, site: str) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The rows of `DOCS` at `site` that hold one of the default probed words, per layer, and each row's
    word label: what the separability and t-SNE commands measure."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.sites import DEFAULT_WORDS
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.separability import word_rows, word_token_ids

    model, tok = load(ckpt)
    ids = word_token_ids(tok, DEFAULT_WORDS)
    acts = extract(
        model, tok, DOCS, sites=[site], token_ids=list(ids.values()), max_length=32, progress=False
    )
    rows, y = word_rows(acts.token_ids, ids)
    return {la: acts[site][la][rows] for la in acts[site]}, y


@contextmanager
def collector_off() -> Iterator[None]:
    """Python's cyclic garbage collector off inside: an object in a reference cycle stays alive there
    unless the code under test collects it."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def built_models(monkeypatch, before_each: Callable[[list], None] | None = None) -> Iterator[list]:
    """Weak references to every model ``AutoModelForCausalLM.from_config`` builds inside, with the cyclic
    collector off (`collector_off`): a model that the code under test let go of but left in a cycle reads
    as alive. ``before_each(refs)`` runs before each build, with the references so far."""
    import transformers

    built: list[weakref.ref] = []
    from_config = transformers.AutoModelForCausalLM.from_config

    def build(*args, **kwargs):
        if before_each is not None:
            before_each(built)
        model = from_config(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", build)
    with collector_off():
        yield built
