"""The logit lens equals a plain loop over ``output_hidden_states`` with the final norm and the unembedding applied
by hand; its last layer is the model's own prediction and loss; the analysis, its figure and its command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import CORPUS, save_tiny_checkpoint, tiny_config, tiny_model, tiny_tokenizer
from transformers import AutoModel

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.tracing import extract
from lime_probe.probes.logit_lens import LensLayer, check_model_loss, lens_head, logit_lens
from lime_probe.probes.stats import bootstrap_ratio_ci

TEXTS = CORPUS + ["It was", "A"]  # a one-token text predicts nothing


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def norm_by_hand(arch: str, model, h: torch.Tensor) -> torch.Tensor:
    """The final norm written out: GPT-2's LayerNorm, LIMe's (LLaMA's) RMSNorm."""
    if arch == "gpt2":
        ln = model.transformer.ln_f
        mean, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
        return (h - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias
    norm = model.model.norm
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight


def reference(arch: str, model, tok, texts):
    """Each text alone: per layer l < L, W_U norm(hidden_states[l]) by hand; at L the model's own logits. Returns
    {layer: (summed NLL, agreements)}, the predicted-token count, and the model's summed loss."""
    n_layers = model.config.num_hidden_layers
    totals = {layer: [0.0, 0] for layer in range(n_layers + 1)}
    count, loss = 0, 0.0
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt")["input_ids"]
            out = model(input_ids=ids, labels=ids, output_hidden_states=True)
            t = ids.shape[1] - 1
            if t == 0:
                continue
            count, loss = count + t, loss + out.loss.item() * t
            final = out.logits[0, :-1]
            for layer in range(n_layers + 1):
                if (
                    layer < n_layers
                ):  # hidden_states[L] is already normalised: the model's logits stand for X_L
                    logits = (
                        norm_by_hand(arch, model, out.hidden_states[layer][0, :-1]) @ model.lm_head.weight.T
                    )
                else:
                    logits = final
                totals[layer][0] += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
                totals[layer][1] += int((logits.argmax(-1) == final.argmax(-1)).sum())
    return totals, count, loss


@pytest.mark.parametrize("arch", ["gpt2", "lime"])
def test_lens_equals_a_plain_loop_over_output_hidden_states(tok, arch):
    model = tiny_model(arch, tok, num_hidden_layers=3)
    acts = extract(model, tok, TEXTS, sites="hidden", logprobs=True, batch_size=3, progress=False)
    lens = logit_lens(model, acts, progress=False)
    want, count, loss = reference(arch, model, tok, TEXTS)
    assert list(lens) == [0, 1, 2, 3]
    for layer, r in lens.items():
        assert r.count.sum() == count
        assert r.nll.sum() == pytest.approx(want[layer][0], rel=1e-5), layer
        assert r.agree.sum() == want[layer][1], layer
    # closed form: the last layer's lens is the model itself
    assert lens[3].agreement == 1.0
    assert lens[3].cross_entropy == pytest.approx(loss / count, rel=1e-5)
    assert lens[0].agreement < 1.0  # the embeddings do not already give the prediction


def test_layers_without_the_last_are_refused(tok):
    model = tiny_model("gpt2", tok)
    acts = extract(model, tok, TEXTS[:2], sites="hidden", layers=[0, 1], progress=False)
    with pytest.raises(ValueError, match=r"needs the hidden site with its last layer, X_2, extracted"):
        logit_lens(model, acts, progress=False)


def test_an_encoder_is_refused_in_one_line(tok):
    model = AutoModel.from_config(tiny_config("bert", len(tok))).eval()
    with pytest.raises(
        ValueError, match=r"^the logit lens needs a causal LM with an unembedding .*BertModel has none$"
    ):
        lens_head(model)


def test_a_head_that_is_not_the_unembedding_of_the_final_norm_is_refused():
    """The model's own loss (from its logits) must be the last layer's lens; a soft-capped head is not."""
    r = LensLayer(np.array([10.0, 20.0]), np.array([4, 9]), np.array([4, 9]))
    check_model_loss(r, torch.tensor([-10.0, -20.0 - 1e-4]))
    with pytest.raises(ValueError, match=r"nats per token away from the model's own loss"):
        check_model_loss(r, torch.tensor([-10.0, -21.0]))


def test_bootstrap_ratio_ci_is_a_per_token_interval_over_sequences():
    num, den = np.array([2.0, 4.0, 6.0, 8.0]), np.array([1.0, 2.0, 3.0, 4.0])
    assert bootstrap_ratio_ci(num, den) == (2.0, 2.0)  # every sequence has the same per-token mean
    rng = np.random.default_rng(0)
    den = rng.integers(1, 20, 200).astype(float)
    num = den * rng.normal(3.0, 1.0, 200)
    low, high = bootstrap_ratio_ci(num, den, seed=1)
    assert low < num.sum() / den.sum() < high and high - low < 1.0
    assert bootstrap_ratio_ci(num, den, seed=1) == (low, high)


def test_the_analysis_and_its_figure(tok, tmp_path):
    from lime_probe.specs import ANALYSES, load_checkpoints

    paths = [save_tiny_checkpoint(tmp_path / a, a) for a in ("lime", "gpt2")]
    cks = load_checkpoints([str(p) for p in paths], ["LIMe", "GPT-2"], "cpu")
    spec = ANALYSES["logit-lens"]
    result = spec.run(cks, TEXTS, Extraction(max_length=32))
    assert [(r["model"], r["layer"]) for r in result.rows] == [
        (m, i) for m in ("LIMe", "GPT-2") for i in range(3)
    ]
    for r in result.rows:
        assert r["ce_ci_low"] <= r["cross_entropy"] <= r["ce_ci_high"]
        assert r["agreement_ci_low"] <= r["agreement"] <= r["agreement_ci_high"]
    last = [r for r in result.rows if r["layer"] == 2]
    assert all(r["agreement"] == 1.0 and r["cross_entropy"] == pytest.approx(r["model_loss"]) for r in last)
    fig = spec.plot(result)["logit_lens"]
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 2]  # loss and agreement, one line per model
    # --layers picks layers; the last (the model's prediction) is always measured
    picked = spec.run(cks[:1], TEXTS, Extraction(max_length=32, layers=(0,)))
    assert [r["layer"] for r in picked.rows] == [0, 2]
    assert picked.rows[0]["agreement"] == result.rows[0]["agreement"]


def test_the_command_writes_its_results_and_refuses_an_encoder(tok, tmp_path, capsys):
    from lime_probe import cli

    ckpt, bert = (
        save_tiny_checkpoint(tmp_path / "gpt2", "gpt2"),
        save_tiny_checkpoint(tmp_path / "bert", "bert"),
    )
    data = tmp_path / "t.txt"
    data.write_text("\n\n".join(CORPUS) + "\n")
    args = ["logit-lens", "--ckpt", str(ckpt), "--data", str(data), "--max-length", "16", "--no-cache"]
    capsys.readouterr()
    assert cli.main([*args, "--out", str(tmp_path / "o"), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "cross_entropy" in out and "agreement" in out
    rows = json.loads((tmp_path / "o" / "logit_lens.json").read_text())["rows"]
    assert [r["layer"] for r in rows] == [0, 1, 2]
    assert {p.name for p in (tmp_path / "o").iterdir()} >= {
        "logit_lens.csv",
        "logit_lens.png",
        "logit_lens.pdf",
    }
    code = cli.main(["logit-lens", "--ckpt", str(bert), "--data", str(data), "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "needs a causal LM" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("arch", ["lime", "gpt2"])
def test_per_token_top_k_is_the_models_own_top_k_at_the_last_layer_and_by_hand_below(arch, tok):
    """`lens_top_tokens`: at the last layer the model's own top-k next tokens and probabilities (its logits'
    softmax), below it the top-k of W_U norm(hidden_states[l]) written out by hand, each text alone."""
    from lime_probe.extraction.loading import wrap
    from lime_probe.probes.logit_lens import lens_top_tokens

    model = tiny_model(arch, tok)
    texts = TEXTS[:2]
    acts = extract(wrap(model, tok), tok, texts, sites="hidden", progress=False)
    rows = lens_top_tokens(model, tok, acts, k=3, sequences=2)
    L = model.config.num_hidden_layers
    for s, text in enumerate(texts):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        for layer in (0, L):
            if layer == L:
                logits = out.logits[0, :-1]
            else:
                logits = model.get_output_embeddings()(
                    norm_by_hand(arch, model, out.hidden_states[layer][0, :-1])
                )
            top = logits.softmax(-1).topk(3, dim=-1)
            got = [r for r in rows if r["sequence"] == s and r["layer"] == layer]
            assert len(got) == 3 * (ids.shape[1] - 1)
            for r in got:
                p, rank = r["position"], r["rank"] - 1
                assert r["prediction"] == tok.decode([int(top.indices[p, rank])])
                assert r["probability"] == pytest.approx(float(top.values[p, rank]), rel=1e-4, abs=1e-6)
                assert r["correct"] == (int(top.indices[p, rank]) == int(ids[0, p + 1]))


def test_per_token_top_k_refuses_selected_rows(tok):
    from lime_probe.extraction.loading import wrap
    from lime_probe.probes.logit_lens import lens_top_tokens

    model = tiny_model("lime", tok)
    acts = extract(wrap(model, tok), tok, TEXTS[:2], sites="hidden", pool="mean", progress=False)
    with pytest.raises(ValueError, match="every token's row"):
        lens_top_tokens(model, tok, acts)
