"""BLiMP minimal-pair scoring with lm-evaluation-harness's leading space: against a per-sentence loop written
here and against lm-eval's own BLiMP task (its template, over a local copy of the pairs) on the same model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PAIRS, save_tiny_checkpoint, tiny_model, tiny_tokenizer

from lime_probe.probes.blimp import load_blimp, score_minimal_pairs

ROWS = [
    {"sentence_good": g, "sentence_bad": b, "UID": "agreement", "pairID": str(k), "linguistics_term": "agr"}
    for k, (g, b) in enumerate(PAIRS)
]


@torch.no_grad()
def loop_logprob(model, tok, sentence: str, leading_space: bool) -> float:
    """sum_{i>=1} log p(t_i | t_<i) over [BOS] + the sentence's tokens (after a space with `leading_space`),
    one sequence, one plain forward pass."""
    ids = [tok.bos_token_id] + tok(" " * leading_space + sentence, add_special_tokens=False)["input_ids"]
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return sum(float(logp[i - 1, ids[i]]) for i in range(1, len(ids)))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_leading_space_scores_equal_a_per_sentence_loop(arch):
    tok = tiny_tokenizer()
    model = tiny_model(arch, tok)
    data = {k: [r[k] for r in ROWS] for k in ROWS[0]}
    for leading_space in (False, True):
        scores = score_minimal_pairs(
            model, tok, data, batch_size=4, progress=False, leading_space=leading_space
        )
        good = [loop_logprob(model, tok, g, leading_space) for g, _ in PAIRS]
        bad = [loop_logprob(model, tok, b, leading_space) for _, b in PAIRS]
        np.testing.assert_allclose(scores.logprob_good, good, rtol=1e-5)
        np.testing.assert_allclose(scores.logprob_bad, bad, rtol=1e-5)
        np.testing.assert_array_equal(scores.correct, np.array(good) > np.array(bad))
    # the convention is no detail: "The" and " The" are different tokens of a byte-level BPE
    assert (
        tok(" The", add_special_tokens=False)["input_ids"]
        != tok("The", add_special_tokens=False)["input_ids"]
    )
    plain = score_minimal_pairs(model, tok, data, progress=False)
    assert not np.allclose(plain.logprob_good, scores.logprob_good)


@pytest.mark.slow
def test_leading_space_gives_lm_evals_own_blimp_scores(tmp_path):
    """lm-eval's BLiMP template (``lm_eval/tasks/blimp/_template_yaml``, the sentence as a choice after the
    task's target delimiter) over these pairs as a local JSONL: its per-pair log-likelihoods equal
    ``leading_space=True``'s."""
    lm_eval = pytest.importorskip(
        "lm_eval", reason="lm-eval is not installed (pip install 'lime-probe[eval]')"
    )
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = save_tiny_checkpoint(tmp_path / "m", "gpt2")
    model, tok = AutoModelForCausalLM.from_pretrained(ckpt).eval(), AutoTokenizer.from_pretrained(ckpt)
    folder = tmp_path / "blimp"
    folder.mkdir()
    (folder / "agreement.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    template = Path(lm_eval.__file__).parent / "tasks" / "blimp" / "_template_yaml"
    (folder / "blimp_local.yaml").write_text(
        f"include: {template}\ntask: blimp_local\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    train: {folder / 'agreement.jsonl'}\n"
    )
    out = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tok, batch_size=4),
        tasks=["blimp_local"],
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
    )
    samples = sorted(out["samples"]["blimp_local"], key=lambda s: s["doc_id"])
    harness = np.array([[float(r[0][0]) for r in s["resps"]] for s in samples])  # (pair, good/bad)
    ours = score_minimal_pairs(model, tok, load_blimp(folder), progress=False, leading_space=True)
    np.testing.assert_allclose(ours.logprob_good, harness[:, 0], rtol=1e-5)
    np.testing.assert_allclose(ours.logprob_bad, harness[:, 1], rtol=1e-5)
    assert ours.mean_over_paradigms == pytest.approx(out["results"]["blimp_local"]["acc,none"])
