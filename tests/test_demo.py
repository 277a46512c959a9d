"""The demo: number occurrences are found as defined, and the whole pipeline runs end to end (quick)."""

from __future__ import annotations

import pytest
import torch

from lime_probe.studies.demo import number_positions, number_rows


def _scan(text: str, numbers) -> list[tuple[int, int]]:
    """Plain character loop: each maximal digit run, reported at its last character."""
    out, i = [], 0
    while i < len(text):
        if text[i].isdigit():
            j = i
            while j + 1 < len(text) and text[j + 1].isdigit():
                j += 1
            if int(text[i : j + 1]) in numbers:
                out.append((j, int(text[i : j + 1])))
            i = j + 1
        else:
            i += 1
    return out


def test_number_positions_on_characters_match_a_plain_scan():
    text = "(3+100)÷4=103÷4\n=1×2+12+1=41+101\n=3"
    numbers = {1, 2, 3, 4, 100, 101, 102, 103}
    got = number_positions(list(text), numbers)
    assert got == _scan(text, numbers)
    assert (12, 103) in got and all(n != 12 and n != 41 for _, n in got)  # 12, 41 are not asked for


def test_number_positions_with_multichar_tokens_pick_the_last_token():
    pieces = ["<s>", "x", "=", "10", "3", "+", "2", "!"]  # "103" split over two tokens
    assert number_positions(pieces, {103, 2}) == [(4, 103), (6, 2)]
    assert number_positions(pieces, {10, 3}) == []  # parts of a larger number do not count


def test_number_rows_maps_to_global_rows():
    from lime_model.tasks.arithmetic import CHARS
    from lime_model.tokenization import char_tokenizer

    tok = char_tokenizer(CHARS)
    texts = ["1+2=3", "100+3=103"]
    ids = [tok(t)["input_ids"] for t in texts]
    offsets = torch.tensor([0, len(ids[0]), len(ids[0]) + len(ids[1])])
    rows, labels = number_rows(offsets, torch.tensor(ids[0] + ids[1]), tok, {1, 3, 103})
    assert rows.tolist() == [0, 4, 5 + 4, 5 + 8] and labels.tolist() == [1, 3, 3, 103]


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from lime_model.recipes import load_recipe
    from lime_model.reproducible import PINNED, run_mode
    from lime_model.tasks.arithmetic import recipe_splits
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract
    from lime_probe.probes.entropy import layer_entropies
    from lime_probe.probes.router_weights import router_weights
    from lime_probe.studies.demo import NUMBER_SETS, QUICK, probe_samples, sample_text

    out = tmp_path / "demo"
    runs = out / "runs"  # the checkpoints are kept inside the output folder by default
    # as a user runs it: a new process, so that the demo's default reproducible mode can pin torch's
    # libraries before they load (this test process loaded torch without it)
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in PINNED and k != "LIME_REPRODUCIBLE"}
    printed = subprocess.run(
        [sys.executable, "-m", "lime_probe.cli", "demo", "--quick", "--out", str(out)],
        cwd=root, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr[-2000:]
    err = printed.stderr
    assert all(f"[{k}/7]" in err for k in range(1, 8))  # progress through every stage
    assert (runs / "lime" / "model.safetensors").is_file() and (
        runs / "llama" / "model.safetensors"
    ).is_file()
    for stem in (
        "arithmetic_accuracy",
        "training_curves",
        "entropy_values",
        "entropy_hidden",
        "router",
        "separability_numbers_1_4",
        "separability_numbers_100_103",
        "tsne_numbers_1_4",
        "tsne_numbers_100_103",
    ):
        assert (out / f"{stem}.json").is_file() and (out / f"{stem}.csv").is_file(), stem
    assert (out / "arithmetic_accuracy.png").is_file() and (out / "router_LIMe.pdf").is_file()
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 10
    # the demo ran in the reproducible mode, and says so in its results and its runs
    mode = json.loads((out / "entropy_values.json").read_text())["meta"]["reproducible"]
    assert mode["reproducible"] is True and mode["env"] == PINNED and mode["deterministic_algorithms"]
    for label in ("lime", "llama"):
        assert run_mode(runs / label) is True
        assert "reproducible mode: on" in (runs / label / "README.md").read_text()

    # accuracy: what the trainer measured, per model and operator count
    rows = json.loads((out / "arithmetic_accuracy.json").read_text())["rows"]
    for label in ("LIMe", "LLaMA"):
        trained = json.loads((runs / label.lower() / "arithmetic_eval.json").read_text())["accuracy"]
        assert {str(r["n_operators"]): r["accuracy"] for r in rows if r["model"] == label} == trained

    # entropy of the values: the library on the same test samples
    lime, tok = load(runs / "lime")
    recipe = load_recipe(str(runs / "lime" / "recipe.json"))
    texts = [sample_text(s, tok) for s in recipe_splits(recipe, with_train=False)[1][: QUICK.entropy_texts]]
    acts = extract(
        lime, tok, texts, sites=["values"], max_length=recipe.seq_len, batch_size=32, progress=False
    )
    want = layer_entropies(
        {la: acts.sequences("values", la) for la in acts["values"]}, seed=0, progress=False
    )
    got = [r for r in json.loads((out / "entropy_values.json").read_text())["rows"] if r["model"] == "LIMe"]
    # the demo streams from its extraction in batches: equal to the in-memory library up to round-off (~1e-9)
    np.testing.assert_allclose(
        [r["entropy_mean"] for r in got], [want[la].mean for la in sorted(want)], rtol=1e-7
    )

    # router weights of the trained LIMe
    doc = json.loads((out / "router.json").read_text())
    np.testing.assert_allclose(
        np.array(doc["routers"]["LIMe"]["per_layer"], dtype=float), router_weights(lime).per_layer
    )

    # every probed number class is balanced to the rarest class's count, counted here by a plain scan
    probe = recipe_splits(recipe, with_train=False)[1] + probe_samples(
        NUMBER_SETS["100-103"], QUICK.per_number, 0
    )
    for key, numbers in NUMBER_SETS.items():
        counts = {
            n: sum(1 for s in probe for _, m in _scan(s.prompt + s.solution, set(numbers)) if m == n)
            for n in numbers
        }
        sep = json.loads((out / f"separability_numbers_{key.replace('-', '_')}.json").read_text())["rows"]
        assert {r["n_rows"] for r in sep} == {len(numbers) * min(counts.values())}
        # the close numbers are probed in the values (the paper's Fig. 8): one row per block, not per hidden layer
        tsne = json.loads((out / f"tsne_numbers_{key.replace('-', '_')}.json").read_text())["rows"]
        n_blocks = lime.config.num_hidden_layers
        for rows in (sep, tsne):
            assert {r["site"] for r in rows} == {"values"}
            assert {r["layer"] for r in rows} == set(range(n_blocks))

    # the headline at the end: each number recomputed from the files the run wrote
    lines = {ln.split("  ")[0]: ln.split() for ln in printed.stdout.splitlines()}
    header = lines["measure"]
    assert header[-2:] == ["LIMe", "LLaMA"]

    def shown(measure: str) -> list[str]:
        return lines[measure][-2:]

    for label_ops in ("2", "3"):
        want = [
            json.loads((runs / m / "arithmetic_eval.json").read_text())["accuracy"][label_ops]
            for m in ("lime", "llama")
        ]
        assert shown(f"accuracy, {label_ops} operators") == [f"{v:.4g}" for v in want]
    ent = json.loads((out / "entropy_values.json").read_text())["rows"]
    layers = sorted({r["layer"] for r in ent})
    want = []
    for m in ("LIMe", "LLaMA"):
        vals = [r["entropy_mean"] for r in ent if r["model"] == m and r["site"] == "values"]
        want.append(sum(vals) / len(vals))
    assert shown(f"value entropy, mean over {len(layers)} blocks [nats]") == [f"{v:.4g}" for v in want]
    for key in NUMBER_SETS:
        sep = json.loads((out / f"separability_numbers_{key.replace('-', '_')}.json").read_text())["rows"]
        last = max(r["layer"] for r in sep)
        want = [
            next(r["accuracy_mean"] for r in sep if r["model"] == m and r["layer"] == last)
            for m in ("LIMe", "LLaMA")
        ]
        assert shown(f"separability of {key}, values of block {last}") == [f"{v:.4g}" for v in want]
    assert f"report: {out / 'report.html'}" in printed.stdout and f"checkpoints: {runs}" in printed.stdout


def test_demo_writes_to_its_own_ignored_folder_by_default():
    """The demo's default output is a folder of its own, git-ignored, not the tracked figures/."""
    import subprocess
    from pathlib import Path

    from lime_probe import cli

    out = cli.build_parser().parse_args(["demo"]).out
    assert Path(out) == Path("lime-probe-out/demo")
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{out}/report.html"], cwd=root)
        assert ignored.returncode == 0, f"{out} is not git-ignored"


def test_the_demo_page_quotes_the_committed_run():
    """docs/demo.md's numbers, recomputed from the committed demo run's files (figures/*.json), which the
    reproducible mode wrote."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    page = " ".join((root / "docs" / "demo.md").read_text().split())

    def rows(stem: str) -> list[dict]:
        doc = json.loads((root / "figures" / f"{stem}.json").read_text())
        assert doc["meta"]["reproducible"]["reproducible"] is True, stem  # the run the page describes
        return doc["rows"]

    acc = {(r["model"], r["n_operators"]): 100 * r["accuracy"] for r in rows("arithmetic_accuracy")}
    lime, llama = (f"{acc[m, 2]:.0f} % / {acc[m, 3]:.0f} %" for m in ("LIMe", "LLaMA"))
    assert f"({lime} on 2 / 3 operators vs LLaMA's {llama})" in page
    assert (
        f"this one +{acc['LIMe', 2] - acc['LLaMA', 2]:.0f} / +{acc['LIMe', 3] - acc['LLaMA', 3]:.0f}" in page
    )

    curves = {(r["model"], r["step"]): r for r in rows("training_curves")}
    steps = sorted({s for m, s in curves if m == "LIMe"})
    lower = sum(curves["LIMe", s]["loss"] < curves["LLaMA", s]["loss"] for s in steps)
    extra = 100 * (curves["LIMe", steps[-1]]["flops"] / curves["LLaMA", steps[-1]]["flops"] - 1)
    assert f"at {lower} of the {len(steps)} logged steps (for {extra:.1f} % more FLOPs per step)" in page

    entropy = {
        (r["model"], r["layer"]): r["entropy_mean"] for r in rows("entropy_values") if r["site"] == "values"
    }
    layers = sorted({la for _, la in entropy})
    assert all(entropy["LIMe", la] > entropy["LLaMA", la] for la in layers) and "in every layer" in page

    rows("router")  # its mode
    per_layer = json.loads((root / "figures" / "router.json").read_text())["routers"]["LIMe"]["per_layer"]
    shares = [
        f"{100 * sources[0]:.0f} %" for sources in per_layer[1:4]
    ]  # each layer's share read from layer 0
    assert f"layers 1-3 read {shares[0]}, {shares[1]} and {shares[2]} of their K/V from layer 0" in page

    def last_block(stem: str) -> dict[str, str]:
        got = rows(stem)
        last = max(r["layer"] for r in got)
        return {r["model"]: f"{100 * r['accuracy_mean']:.1f} %" for r in got if r["layer"] == last}

    small, large = last_block("separability_numbers_1_4"), last_block("separability_numbers_100_103")
    assert (
        f"1-4 stay mostly apart ({small['LLaMA']}) and in LIMe's they do not ({small['LIMe']}, chance 25 %;"
        in page
    )
    assert f"100-103: {large['LLaMA']} vs {large['LIMe']})" in page
