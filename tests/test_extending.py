"""docs/extending.md's worked examples, each run as written and its result checked against an independent
computation: the analysis's norms from ``output_hidden_states``, the adapter's sites from forward hooks,
the routing variant's sources from its rule written out and its initial model against transformers' LLaMA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import isolate_registries

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def run_example(heading: str) -> dict:
    """Run the first ```python block under ``## heading`` of docs/extending.md as the docs test does (its
    own namespace, named ``__docs__``); return that namespace."""
    lines = DOC.read_text().splitlines()
    start = lines.index(f"## {heading}")
    first = next(i for i in range(start, len(lines)) if lines[i].strip() == "```python") + 1
    end = next(i for i in range(first, len(lines)) if lines[i].strip() == "```")
    namespace = {"__name__": "__docs__"}
    # dont_inherit: the block runs without this module's `from __future__ import annotations`
    exec(compile("\n" * first + "\n".join(lines[first:end]), str(DOC), "exec", dont_inherit=True), namespace)
    return namespace


@pytest.fixture(autouse=True)
def _registries(monkeypatch):
    isolate_registries(monkeypatch)


def test_analysis_norms_equal_the_hidden_states_by_hand():
    from lime_probe import specs

    ns = run_example("Adding an analysis")
    assert specs.ANALYSES["layer-norm"] is ns["SPEC"]
    model, tok = ns["model"], ns["tok"]
    per_layer: dict[int, list[torch.Tensor]] = {}
    # transformers' last hidden state is after the final norm; X_L, the last block's output, is before it
    last: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(lambda module, args, output: last.append(output))
    with torch.no_grad():
        for text in ns["texts"]:
            ids = torch.tensor([tok(text)["input_ids"]])
            states = [*model(ids, output_hidden_states=True).hidden_states[:-1], last.pop()]
            for layer, h in enumerate(states):
                per_layer.setdefault(layer, []).append(h[0].norm(dim=-1))
    hook.remove()
    want = {layer: torch.cat(norms).mean().item() for layer, norms in per_layer.items()}
    rows = ns["result"].rows
    assert [(r["model"], r["layer"]) for r in rows] == [("tiny", layer) for layer in range(3)]
    assert {r["layer"]: r["mean_norm"] for r in rows} == pytest.approx(want, rel=1e-5)


def test_adapter_sites_equal_forward_hooks(monkeypatch):
    import lime_probe
    from lime_probe.extraction import adapters

    ns = run_example("Adding an architecture adapter")
    model, tok, acts = ns["model"], ns["tok"], ns["acts"]
    D = model.config.n_embd
    seen: dict[tuple[str, int], list[torch.Tensor]] = {}

    def keep(name, layer, pick):
        return lambda module, args, output: seen.setdefault((name, layer), []).append(pick(output)[0])

    blocks = model.transformer.h
    hooks = [
        blocks[i].attn.c_attn.register_forward_hook(keep("keys", i, lambda o: o[..., D : 2 * D]))
        for i in range(2)
    ]
    hooks += [
        blocks[i].attn.c_attn.register_forward_hook(keep("values", i, lambda o: o[..., 2 * D :]))
        for i in range(2)
    ]
    hooks += [blocks[i].attn.register_forward_hook(keep("attn_out", i, lambda o: o[0])) for i in range(2)]
    hooks.append(model.transformer.ln_f.register_forward_hook(keep("final", 0, lambda o: o)))
    with torch.no_grad():
        for text in ["the cat sat on the mat.", "a dog ran."]:
            model(torch.tensor([tok(text)["input_ids"]]))
    for hook in hooks:
        hook.remove()
    assert {
        (site, layer) for site in ("keys", "values", "attn_out", "final") for layer in acts.layers(site)
    } == set(seen)
    for (site, layer), rows in seen.items():
        torch.testing.assert_close(acts[site][layer], torch.cat(rows), msg=f"{site} {layer}")
    # without the adapter, the fused projection is not guessed: no keys
    monkeypatch.delitem(adapters.ADAPTERS, "my_gpt2")
    with pytest.raises(ValueError, match="keys"):
        lime_probe.extract(model, tok, ["a dog ran."], sites=["keys"], progress=False)


def test_routing_variant_sources_and_initial_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lime_model import LimeConfig, LimeForCausalLM, routing
    from lime_model.router import LimeRouter

    ns = run_example("Adding a routing variant")
    assert routing.ROUTINGS["every-other"].router is ns["EveryOtherRouter"]
    sizes = ns["sizes"]
    for n in (1, 2, 3):
        model = LimeForCausalLM(LimeConfig(routing=f"every-other-{n}", **sizes))
        for i, layer in enumerate(model.model.layers):
            # the n most recent layers j <= i with i - j even, ascending
            want = [j for j in range(i + 1) if (i - j) % 2 == 0 and (i - j) // 2 < n]
            assert layer.self_attn.router.sources == want, (n, i)
    # at init the model is transformers' LLaMA with the same weights
    lime, ids = ns["lime"], ns["ids"]
    llama = LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    llama.load_state_dict({k: v for k, v in lime.state_dict().items() if ".router." not in k}, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(lime(ids).logits, llama(ids).logits)
        # its routers mix: weight on layer i-2 changes the logits
        lime.model.layers[2].self_attn.router.weight[:, :2] = 0.5
        assert not torch.allclose(lime(ids).logits, llama(ids).logits)
    run_example("Adding a routing variant")  # the same class defined again replaces it
    with pytest.raises(ValueError, match="'full' is declared twice"):
        type("FullAgain", (LimeRouter,), {"routes": {"full": ns["every_other"]}})


def test_the_pages_line_counts_are_its_code_blocks():
    """The table's "lines of code" are the non-blank lines of each example's block, in order."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    counts = [sum(1 for line in b.splitlines() if line.strip()) for b in blocks]
    table = re.findall(r"^\| an? [^|]+ \| [^|]+ \| 1 \| (\d+) \|$", text, re.M)
    assert [int(n) for n in table] == counts
