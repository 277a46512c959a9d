"""Interventions against independent computations: `run_with_edits` against edits written by hand as plain
torch hooks on the Hugging Face modules, `activation_patching` against a hand-written loop (one hooked forward
per cell) and TransformerLens's own patching, route edits against LIMe copies whose router weights were set by
hand, attribution patching against actual patching; and bad input refused in one line before any forward."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import save_tiny_checkpoint

import lime_probe
from lime_probe.interventions.edits import Edit, RouteEdit
from lime_probe.interventions.pairs import Pair
from lime_probe.interventions.patching import activation_patching, attribution_patching
from lime_probe.interventions.run import run_with_edits

ARCHS = ("gpt2", "llama", "gpt_neox", "lime")
TEXTS = ["The cat is on the mat and the dogs are in the garden.", "She was happy.", "It is what it is."]
REFERENCE = ["A model is a function.", "There was a time when the rivers were clean."]
# Clean/corrupt token ids of equal length: pair 0 differs at position 2, pair 1 at positions 2 and 4.
CLEAN = [[270, 287, 271, 269, 225, 273], [264, 289, 271, 269, 40, 50]]
CORRUPT = [[270, 287, 272, 269, 225, 273], [264, 289, 272, 269, 41, 50]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Tiny random checkpoints loaded by `lime_probe.load`; the LIMe has three layers, so that its layer 2
    reads two earlier layers."""
    root = tmp_path_factory.mktemp("interventions")
    layers = {"lime": {"num_hidden_layers": 3}}
    return {
        arch: lime_probe.load(save_tiny_checkpoint(root / arch, arch, **layers.get(arch, {})))
        for arch in ARCHS
    }


# ---------------------------------------------------------------------------------------------------------
# The sites written by hand: the module whose value holds each, and how the site is cut out of that value and
# put back into it (independently of lime_probe's adapters).


def blocks(hf) -> torch.nn.ModuleList:
    return hf.base_model.h if hf.config.model_type == "gpt2" else hf.base_model.layers


def n_layers(hf, site: str) -> int:
    return len(blocks(hf)) + (site == "hidden")


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _with_first(out, new):
    return (new, *out[1:]) if isinstance(out, tuple) else new


def site_module(hf, site: str, layer: int) -> tuple[torch.nn.Module, Callable, Callable]:
    """(module, get, put) of `site` `layer` (layer > 0 for ``hidden``): ``get(output)`` is the site (1, T, dim)
    in the module's output, ``put(output, new)`` the output holding `new` there instead."""
    arch = hf.config.model_type
    if site == "hidden":
        return blocks(hf)[layer - 1], _first, _with_first
    if site == "final":
        norm = {"gpt2": "ln_f", "gpt_neox": "final_layer_norm"}.get(arch, "norm")
        return hf.base_model.get_submodule(norm), _first, _with_first
    block = blocks(hf)[layer]
    if site == "attn_out":
        return (
            block.get_submodule({"gpt2": "attn", "gpt_neox": "attention"}.get(arch, "self_attn")),
            _first,
            _with_first,
        )
    if site == "mlp_out":
        return block.mlp, _first, _with_first
    assert site == "values"
    if arch == "gpt2":  # c_attn's output is [q | k | v], equal thirds
        third = hf.config.n_embd

        def put_gpt2(out, new):
            return torch.cat([out[..., : 2 * third], new], -1)

        return block.attn.c_attn, lambda out: out[..., 2 * third :], put_gpt2
    if arch == "gpt_neox":  # query_key_value's output is [q_h | k_h | v_h] per head h
        heads = hf.config.num_attention_heads

        def get_neox(out):
            return out.unflatten(-1, (heads, 3, -1))[..., 2, :].flatten(-2)

        def put_neox(out, new):
            per_head = out.unflatten(-1, (heads, 3, -1)).clone()
            per_head[..., 2, :] = new.unflatten(-1, (heads, -1))
            return per_head.flatten(-3)

        return block.attention.query_key_value, get_neox, put_neox
    return block.self_attn.v_proj, _first, _with_first


def head_width(hf) -> int:
    return hf.config.hidden_size // hf.config.num_attention_heads


@contextlib.contextmanager
def hooked(hf, sites: dict[tuple[str, int], Callable], seen: dict | None = None) -> Iterator[None]:
    """Within: each ``(site, layer)`` of `sites` passes, in `hf`'s one-sequence forwards, through its change
    ((T, dim) -> (T, dim)) by a plain torch hook (a pre-hook on block 0 for ``hidden`` 0); what the site holds
    after it is appended to ``seen[(site, layer)]``."""
    handles = []

    def through(key, x):
        new = sites[key](x[0].detach().clone())[None]
        if seen is not None:
            seen.setdefault(key, []).append(new[0].detach().clone())
        return new

    for key in sites:
        site, layer = key
        if site == "hidden" and layer == 0:

            def pre(module, args, kwargs, key=key):
                if args:
                    return (through(key, args[0]), *args[1:]), kwargs
                return args, kwargs | {"hidden_states": through(key, kwargs["hidden_states"])}

            handles.append(blocks(hf)[0].register_forward_pre_hook(pre, with_kwargs=True))
        else:
            module, get, put = site_module(hf, site, layer)

            def post(module, args, out, key=key, get=get, put=put):
                return put(out, through(key, get(out)))

            handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def forward(hf, ids: list[int]) -> torch.Tensor:
    """The logits (T, V) of one sequence run alone."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """log p(t_{j+1} | t_<=j), (T - 1,) float64, from one sequence's logits (T, V)."""
    return logits[:-1].double().log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def site_rows(hf, texts_ids: list[list[int]], site: str, layer: int) -> list[torch.Tensor]:
    """The site (T_i, dim) of each sequence run alone, read by a hook."""
    seen: dict = {}
    with hooked(hf, {(site, layer): lambda x: x}, seen):
        for ids in texts_ids:
            forward(hf, ids)
    return seen[(site, layer)]


# ---------------------------------------------------------------------------------------------------------
# run_with_edits against hand-written hooks

# (site, layer, op, the value's kind: "vector" (dim,), "rows" (n_cells, dim) or None, Edit keywords)
CASES = [
    ("hidden", 0, "zero", None, {"positions": [1]}),
    ("hidden", 0, "set", "rows", {"positions": [0, -1], "sequences": [0, 2]}),
    ("hidden", 1, "add", "vector", {"scale": 3.0, "sequences": [1]}),
    ("hidden", -1, "set", "vector", {"positions": [2, -2]}),
    ("attn_out", 1, "add", "rows", {"scale": -2.0, "positions": [1], "sequences": [0, 2]}),
    ("attn_out", 0, "mean", None, {"positions": [1, -2], "reference": REFERENCE}),
    ("mlp_out", 0, "fn", None, {"positions": [2], "fn": lambda x: 2 * torch.tanh(x)}),
    ("mlp_out", 1, "zero", None, {"sequences": [0]}),
    ("values", 1, "set", "rows", {"positions": [0, 1], "heads": [1]}),
    ("values", 0, "zero", None, {"heads": [0], "sequences": [2]}),
    ("values", 1, "add", "vector", {"scale": 2.0, "positions": [-1]}),
]


def cells(n_tokens: int, positions) -> list[int]:
    """The positions (ascending) an edit of `positions` touches in a sequence of `n_tokens` tokens."""
    return list(range(n_tokens)) if positions is None else sorted({p % n_tokens for p in positions})


def by_hand(hf, case: tuple, value, mean) -> Callable[[int, torch.Tensor, int], torch.Tensor]:
    """The case's edit of sequence `s`'s site x (T, dim), its value rows starting at row `first`."""
    site, layer, op, kind, kw = case

    def change(s: int, x: torch.Tensor, first: int) -> torch.Tensor:
        if kw.get("sequences") is not None and s not in kw["sequences"]:
            return x
        new = x.clone()
        columns = torch.ones(x.shape[1], dtype=torch.bool)
        if kw.get("heads") is not None:
            columns = torch.zeros(x.shape[1] // head_width(hf), dtype=torch.bool)
            columns[kw["heads"]] = True
            columns = columns.repeat_interleave(head_width(hf))
        for k, p in enumerate(cells(len(x), kw.get("positions"))):
            if op == "zero":
                row = torch.zeros_like(x[p])
            elif op == "fn":
                row = kw["fn"](x)[p]
            elif op == "mean":
                row = mean
            else:
                v = value if kind == "vector" else value[first + k]
                row = x[p] + kw.get("scale", 1.0) * v if op == "add" else v
            new[p] = torch.where(columns, row, x[p])
        return new

    return change


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{c[1]}-{c[2]}")
def test_run_with_edits_equals_hand_written_hooks(models, arch, case):
    """Per-token log-probs (to 1e-6), last-position logits and the sites read under the edit (``hidden`` at every layer and the edited
    site at every layer) equal each sequence run alone through the Hugging Face model with the edit written by
    a torch hook; the unedited run differs, so the edit is no no-op."""
    model, tok = models[arch]
    hf = model._module
    site, layer, op, kind, kw = case
    layer = layer % n_layers(hf, site)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    dim = site_rows(hf, ids[:1], site, layer)[0].shape[1]
    gen = torch.Generator().manual_seed(0)
    picked = [s for s in range(len(ids)) if kw.get("sequences") is None or s in kw["sequences"]]
    counts = [len(cells(len(ids[s]), kw.get("positions"))) if s in picked else 0 for s in range(len(ids))]
    value = None
    if kind is not None:
        value = torch.randn(dim if kind == "vector" else sum(counts), dim, generator=gen)
        value = value[0] if kind == "vector" else value
    mean = torch.cat(site_rows(hf, [tok(t)["input_ids"] for t in REFERENCE], site, layer)).mean(0)
    edit = Edit(site, case[1], op, value, **kw)
    # two batches: the second's sequence indices and value rows start after the first's
    out = run_with_edits(model, tok, TEXTS, [edit], read=list(dict.fromkeys(["hidden", site])), batch_size=2)

    change = by_hand(hf, case, value, mean)
    keys = {(s, i) for s in ("hidden", site) for i in range(n_layers(hf, s))}
    for s, seq in enumerate(ids):
        first = sum(counts[:s])
        changes = {
            key: (lambda x, s=s, first=first: change(s, x, first)) if key == (site, layer) else (lambda x: x)
            for key in keys
        }
        seen: dict = {}
        with hooked(hf, changes, seen):
            logits = forward(hf, seq)
        torch.testing.assert_close(out.logprobs[s], token_logprobs(logits, seq), rtol=0, atol=1e-6)
        torch.testing.assert_close(out.last_logits[s], logits[-1])
        assert out.token_ids[s].tolist() == seq
        rows = slice(int(out.acts.offsets[s]), int(out.acts.offsets[s + 1]))
        for read_site, read_layer in keys:
            torch.testing.assert_close(
                out.acts[read_site][read_layer][rows], seen[(read_site, read_layer)][0]
            )
    plain = [forward(hf, seq) for seq in ids]
    moved = [
        (a - token_logprobs(b, seq)).abs().max() for a, b, seq in zip(out.logprobs, plain, ids, strict=True)
    ]
    assert max(moved + [(out.last_logits - torch.stack([b[-1] for b in plain])).abs().max()]) > 1e-4


# ---------------------------------------------------------------------------------------------------------
# Activation patching


def widest_answers(hf, clean: list[list[int]], corrupt: list[list[int]]) -> list[tuple[int, int]]:
    """Per pair, the (answer, wrong) tokens whose logit difference the corruption changes most: a wide gap to
    normalise by, so the scores' float32 rounding stays far below the tolerances."""
    out = []
    for c, k in zip(clean, corrupt, strict=True):
        gap = forward(hf, c)[-1] - forward(hf, k)[-1]
        out.append((int(gap.argmax()), int(gap.argmin())))
    return out


def pairs_of(hf, clean=CLEAN, corrupt=CORRUPT) -> list[Pair]:
    return [
        Pair(c, k, a, w)
        for c, k, (a, w) in zip(clean, corrupt, widest_answers(hf, clean, corrupt), strict=True)
    ]


def hand_patching(hf, pairs: list[Pair], site: str, per_head: bool) -> torch.Tensor:
    """(layers, positions[, heads]) normalised logit-difference recovery: per cell and pair one forward of the
    corrupt prompt with the cell set to the clean run's value by a hook."""

    def diff(logits, pair):
        return float(logits[-1, pair.answer]) - float(logits[-1, pair.wrong])

    ld_clean = sum(diff(forward(hf, p.clean), p) for p in pairs) / len(pairs)
    ld_corrupt = sum(diff(forward(hf, p.corrupt), p) for p in pairs) / len(pairs)
    length = len(pairs[0].clean)
    width = head_width(hf)
    scores = []
    for layer in range(n_layers(hf, site)):
        clean_rows = site_rows(hf, [p.clean for p in pairs], site, layer)
        n_heads = clean_rows[0].shape[1] // width if per_head else 1
        grid = torch.zeros(length, n_heads, dtype=torch.float64)
        for pos in range(length):
            for h in range(n_heads):
                cols = slice(h * width, (h + 1) * width) if per_head else slice(None)
                total = 0.0
                for pair, rows in zip(pairs, clean_rows, strict=True):

                    def patch(x, pos=pos, cols=cols, rows=rows):
                        x[pos, cols] = rows[pos, cols]
                        return x

                    with hooked(hf, {(site, layer): patch}):
                        total += diff(forward(hf, pair.corrupt), pair)
                grid[pos, h] = (total / len(pairs) - ld_corrupt) / (ld_clean - ld_corrupt)
        scores.append(grid if per_head else grid[:, 0])
    return torch.stack(scores)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("site, per_head", [("attn_out", False), ("values", True)])
def test_activation_patching_equals_a_hand_written_hook_loop(models, arch, site, per_head):
    model, tok = models[arch]
    pairs = pairs_of(model._module)
    result = activation_patching(model, tok, pairs, site=site, per_head=per_head, batch_size=7)
    expected = hand_patching(model._module, pairs, site, per_head)
    assert result.scores.shape == expected.shape
    torch.testing.assert_close(result.scores.double(), expected, rtol=0, atol=1e-5)
    assert result.layers == list(range(n_layers(model._module, site)))
    assert expected.abs().max() > 0.05  # the grid is not all zeros


@pytest.mark.parametrize("arch", ARCHS)
def test_patching_the_embedding_of_the_one_differing_token_recovers_exactly(models, arch):
    """Pair 0 differs at position 2 only: patching ``hidden`` 0 there makes the corrupt run the clean one (score
    1 exactly), anywhere else it changes nothing (0 exactly), whatever batch the patched rows run in."""
    model, tok = models[arch]
    pairs = pairs_of(model._module, CLEAN[:1], CORRUPT[:1])
    for batch_size in (1, 4, 32):
        scores = activation_patching(
            model, tok, pairs, site="hidden", layers=[0], batch_size=batch_size
        ).scores
        expected = torch.zeros(1, len(CLEAN[0]), dtype=scores.dtype)
        expected[0, 2] = 1.0
        assert torch.equal(scores, expected), (batch_size, scores)


@pytest.fixture
def keep_transformers_verbosity():
    """Importing TransformerLens turns transformers' logging to errors only, for the whole process."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    yield
    logging.set_verbosity(level)


def test_hidden_patching_equals_transformer_lens_resid_pre(
    tmp_path, monkeypatch, keep_transformers_verbosity
):
    """TransformerLens's `get_act_patch_resid_pre` (its own hooks on a TransformerBridge of the same GPT-2
    checkpoint; resid_pre of block l is our ``hidden`` l) gives the same (layer, position) heatmap to 1e-5,
    with its metric the logit difference averaged over pairs and normalised as ours is."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.patching import get_act_patch_resid_pre
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = save_tiny_checkpoint(tmp_path / "gpt2", "gpt2")
    model, tok = lime_probe.load(path)
    bridge = TransformerBridge.boot_transformers(
        str(path), tokenizer=AutoTokenizer.from_pretrained(path), device="cpu"
    )
    pairs = pairs_of(model._module)
    answers = torch.tensor([[p.answer, p.wrong] for p in pairs])

    def diff(logits):
        return (logits[:, -1].gather(1, answers) @ torch.tensor([1.0, -1.0])).mean()

    with torch.no_grad():
        clean_logits, clean_cache = bridge.run_with_cache(torch.tensor(CLEAN))
        ld_clean, ld_corrupt = diff(clean_logits), diff(bridge(torch.tensor(CORRUPT)))
        theirs = get_act_patch_resid_pre(
            bridge,
            torch.tensor(CORRUPT),
            clean_cache,
            lambda logits: (diff(logits) - ld_corrupt) / (ld_clean - ld_corrupt),
        )
    ours = activation_patching(model, tok, pairs, site="hidden", layers=[0, 1])
    torch.testing.assert_close(ours.scores.float(), theirs, rtol=0, atol=1e-5)
    assert theirs.abs().max() > 0.05


# ---------------------------------------------------------------------------------------------------------
# Route edits (LIMe)


def routed_layers(hf) -> list[int]:
    return [i for i, block in enumerate(hf.model.layers) if len(block.self_attn.router.sources) > 1]


def logprobs_of(hf, texts_ids: list[list[int]]) -> list[torch.Tensor]:
    return [token_logprobs(forward(hf, ids), ids) for ids in texts_ids]


@pytest.mark.parametrize("which", ["each", "all"])
def test_cutting_cross_layer_reads_equals_router_weights_zeroed_by_hand(models, which):
    """`RouteEdit(layer)` (every source but the layer itself), one layer at a time or every routed layer at
    once, equals a copy of the LIMe whose router weight columns of the other layers are zeroed by hand
    (``weight [kv, S * kv]``: column ``p * kv + h'`` weights head ``h'`` of ``sources[p]``, the own layer last)."""
    model, tok = models["lime"]
    hf = model._module
    ids = [tok(t)["input_ids"] for t in TEXTS]
    cuts = [[i] for i in routed_layers(hf)] if which == "each" else [routed_layers(hf)]
    assert cuts and len(hf.model.layers[2].self_attn.router.sources) == 3
    for layers in cuts:
        out = run_with_edits(model, tok, TEXTS, routes=[RouteEdit(i) for i in layers])
        by_hand = copy.deepcopy(hf)
        with torch.no_grad():
            for i in layers:
                router = by_hand.model.layers[i].self_attn.router
                router.weight[:, : -router.num_kv_heads] = 0.0
        for got, expected, plain in zip(
            out.logprobs, logprobs_of(by_hand, ids), logprobs_of(hf, ids), strict=True
        ):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
            assert (got - plain).abs().max() > 1e-4
    # the routers are restored after the run
    torch.testing.assert_close(
        run_with_edits(model, tok, TEXTS).logprobs[0], logprobs_of(hf, ids)[0], rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("heads", [None, [1]])
def test_a_renormalised_cut_equals_router_weights_rescaled_by_hand(models, heads):
    """Cutting source 0 of layer 2 with ``renormalize=True`` equals router weights whose cut columns are zeroed
    and whose remaining weights, in each routed head cut, are scaled back to the row's L1 mass before the cut."""
    model, tok = models["lime"]
    hf = model._module
    ids = [tok(t)["input_ids"] for t in TEXTS]
    out = run_with_edits(model, tok, TEXTS, routes=[RouteEdit(2, sources=[0], heads=heads, renormalize=True)])
    by_hand = copy.deepcopy(hf)
    with torch.no_grad():
        weight = by_hand.model.layers[2].self_attn.router.weight  # (kv, S * kv), sources [0, 1, 2]
        kv = weight.shape[0]
        for h in range(kv) if heads is None else heads:
            before = weight[h].abs().sum()
            weight[h, :kv] = 0.0
            weight[h] *= before / weight[h].abs().sum()
    unnormalised = run_with_edits(model, tok, TEXTS, routes=[RouteEdit(2, sources=[0], heads=heads)])
    for got, expected, cut in zip(
        out.logprobs, logprobs_of(by_hand, ids), unnormalised.logprobs, strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        assert (got - cut).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------------------
# Attribution patching


@pytest.mark.parametrize("arch", ARCHS)
def test_attribution_patching_is_exact_where_the_logits_are_linear_in_the_site(models, arch):
    """The logits are a linear map of ``final`` (the unembedding), so the first-order estimate is the patching
    score itself."""
    model, tok = models[arch]
    pairs = pairs_of(model._module)
    actual = activation_patching(model, tok, pairs, site="final")
    estimate = attribution_patching(model, tok, pairs, site="final")
    torch.testing.assert_close(estimate.scores.double(), actual.scores.double(), rtol=0, atol=1e-5)
    assert actual.scores.abs().max() > 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_attribution_patching_correlates_with_actual_patching_of_hidden(models, arch):
    """Over every (layer, position) cell of ``hidden``, the estimate's Pearson r with actual patching: measured
    0.997 (GPT-2), 0.961 (LLaMA), 0.925 (GPT-NeoX) and 0.983 (LIMe) on these tiny models; asserted above 0.8,
    below every one of them (the first-order estimate is close, not exact, where the path is nonlinear)."""
    model, tok = models[arch]
    pairs = pairs_of(model._module)
    actual = activation_patching(model, tok, pairs, site="hidden").scores.flatten().double()
    estimate = attribution_patching(model, tok, pairs, site="hidden").scores.flatten().double()
    r = torch.corrcoef(torch.stack([actual, estimate]))[0, 1]
    assert r > 0.8


# ---------------------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture
def forwards(models):
    """Counts the forward passes of every model (a pre-hook on each)."""
    calls: list[str] = []
    handles = [
        m._module.register_forward_pre_hook(lambda *a, arch=arch: calls.append(arch))
        for arch, (m, _) in models.items()
    ]
    yield calls
    for handle in handles:
        handle.remove()


BAD_RUNS = [
    ("llama", [Edit("routed_values", 0, "zero")], [], "routed_values"),
    ("gpt2", [Edit("hidden", 9, "zero")], [], "layer 9 out of range"),
    ("llama", [Edit("mlp_out", -3, "zero")], [], "layer -3 out of range"),
    ("llama", [Edit("hidden", 1, "set", torch.ones(31))], [], r"is \(31,\); it must be \(32,\)"),
    ("gpt2", [Edit("hidden", 1, "set", torch.ones(5, 32), positions=[0, 1])], [], r"\(5, 32\).*\(4, 32\)"),
    ("llama", [Edit("values", 1, "zero", heads=[2])], [], "head 2 out of range, the site has 2 heads"),
    ("gpt_neox", [Edit("attn_out", 1, "zero", heads=[0])], [], "the site has no heads"),
    ("llama", [], [RouteEdit(1)], "no routers"),
    ("lime", [], [RouteEdit(0)], "reads only its own K/V"),
    ("lime", [Edit("hidden", 1, "zero", positions=[5])], [], "position 5 is outside a sequence of 3 tokens"),
    (
        "lime",
        [Edit("hidden", 1, "zero", positions=[-9])],
        [],
        "position -9 is outside a sequence of 3 tokens",
    ),
    (
        "lime",
        [Edit("hidden", 1, "zero", sequences=[3])],
        [],
        "sequence 3 out of range: there are 2 sequences",
    ),
]


@pytest.mark.parametrize("arch, edits, routes, message", BAD_RUNS)
def test_bad_edits_are_refused_in_one_line_before_any_forward(models, forwards, arch, edits, routes, message):
    model, tok = models[arch]
    with pytest.raises(ValueError, match=message) as error:
        run_with_edits(model, tok, ["The cat is on the mat", "She was"], edits, routes=routes)
    assert "\n" not in str(error.value)
    assert not forwards


@pytest.mark.parametrize(
    "arch, clean, corrupt, site, layers, message",
    [
        (
            "gpt2",
            CLEAN[0],
            CORRUPT[0][:-1],
            "hidden",
            None,
            "clean prompt has 6 tokens and the corrupt one 5",
        ),
        ("llama", CLEAN[0], CORRUPT[0], "routed_values", None, "routed_values"),
        ("gpt2", CLEAN[0], CORRUPT[0], "hidden", [7], "layer 7 out of range"),
    ],
)
def test_bad_patching_input_is_refused_in_one_line_before_any_forward(
    models, forwards, arch, clean, corrupt, site, layers, message
):
    model, tok = models[arch]
    for patching in (activation_patching, attribution_patching):
        with pytest.raises(ValueError, match=message) as error:
            patching(model, tok, [Pair(clean, corrupt, 5, 6)], site=site, layers=layers)
        assert "\n" not in str(error.value)
    assert not forwards
