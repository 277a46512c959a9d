"""What an extraction reads from a model: the sites a model offers and their layer indices, resolved
against its architecture (`adapter_for`), and the module values a trace reads to produce them, in the order
one forward pass produces them (`plan_sites` -> `SitePlan`).

Sites and their layer indices (L = number of blocks):

- ``hidden``: L+1 entries. X_0 = the embeddings (the input of block 0), X_l = the output of block l;
  X_L is the last block's output *before* the final norm (Hugging Face's ``output_hidden_states``
  instead ends with the normalised output, which is the ``final`` site here).
- ``final``: 1 entry (index 0), the final norm's output (encoders without one: the last block's output).
  Registered architectures have it; one found without an adapter, where a forward pass shows its place
  (`lime_probe.extraction.adapters.verified_places`), else it is refused.
- ``keys`` / ``values``: L entries, the W_K / W_V projection outputs (before RoPE), heads
  concatenated: dim = kv_heads * head_dim. The LIMe paper's text calls the W_V output "values".
- ``routed_keys`` / ``routed_values`` (LIMe only): L entries, the output of each layer's
  ``self_attn.router`` (what the heads attend to), dim = kv_heads * head_dim. The official LIMe
  analysis code records these as the "values" of a LIMe model; both are offered, pick deliberately.
- ``mixed_values`` (ResFormer only): L entries, the values each layer attends over,
  lambda_1 V_1 + lambda_2 V_n (layer 0: V_1 itself), dim = kv_heads * head_dim.
- ``attn_out`` / ``mlp_out``: L entries, the output of each block's attention / MLP module (after its output
  projection, before the residual add and any norm the block applies to it), dim = hidden_size.
- ``attn_pattern``: L entries, each head's attention weights (the softmax over the keys; for LIMe over the
  routed keys its heads attend to). A row per query token, dim = heads * W: per head, the weights the token
  gives to the keys at its sequence's positions 0..W-1, counted from the sequence's first token whatever the
  padding, zero past the sequence's end (and above the diagonal, being causal). W is `max_length` (capped
  at the model's positions): set it to the longest sequence to keep rows small. ``acts.per_head(
  "attn_pattern", l)`` gives (n_rows, heads, W), ``acts.pattern(l, i)`` sequence i's (heads, t_i, t_i)
  square, to plot; the mean over windows of one length T is ``acts.per_head("attn_pattern", l)[..., :T]
  .unflatten(0, (-1, T)).mean(0)``, (T, heads, T). Only eager attention returns the weights: a model
  that runs SDPA or flash attention runs eager attention for the whole extraction (a warning says so;
  ``acts.attn_implementation`` and the cache key record it).
- ``module:PATH`` (or ``module:PATH:input``): any module's output (or first positional input), PATH dotted
  and relative to the base model (``layers.{i}.mlp.down_proj`` in a LLaMA) or the root (``lm_head``); with
  ``{i}`` an entry per block (``{i}`` = 0..L-1), without it one entry (index 0). The value must be a tensor
  (batch, seq, ...), the first of a tuple; dims after seq are flattened into dim. A PATH that names no
  module is refused with the nearest names. The reads are ordered by one two-token forward pass run first.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from lime_probe.extraction.adapters import Adapter, Take, adapter_for, first, head_shape
from lime_probe.extraction.loading import input_device
from lime_probe.extraction.sites import HEADED, module_site, per_block


@dataclass(frozen=True)
class Read:
    """One value read inside a trace: `path` (from the nnsight root, ending in .input/.output) and the
    (site, layer, reader) targets computed from it."""

    path: str
    targets: tuple[tuple[str, int, Take], ...]


def site_sizes(adapter: Adapter, config: Any, n_layers: int) -> dict[str, int]:
    """Number of layer entries of each site this model offers."""
    sizes = {"hidden": n_layers + 1} | ({"final": 1} if adapter.has_final else {})
    sizes |= {site: n_layers for site in adapter.block_sites(config)}
    return sizes


def resolve_layers(
    sites: Sequence[str], layers: Iterable[int] | None, sizes: dict[str, int], model_type: str
) -> dict[str, list[int]]:
    """site -> sorted layer indices; negative indices count from each site's end; a site with one entry
    (``final``, a ``module:`` site without ``{i}``) is always [0]."""
    out = {}
    for site in sites:
        if site not in sizes:
            raise ValueError(
                f"site {site!r} is not available for model_type {model_type!r}; available: {list(sizes)}"
            )
        n = sizes[site]
        if layers is None or not per_block(site):
            out[site] = list(range(n))
            continue
        chosen = set()
        for layer in layers:
            if not isinstance(layer, int) or isinstance(layer, bool):
                raise ValueError(f"layers must be integers, got {layer!r}")
            if not -n <= layer < n:
                raise ValueError(f"layer {layer} out of range for site {site!r}, which has {n} entries")
            chosen.add(layer % n)
        out[site] = sorted(chosen)
    return out


def plan_reads(
    adapter: Adapter, config: Any, prefix: str, n_layers: int, site_layers: dict[str, list[int]]
) -> list[Read]:
    """The reads that produce `site_layers`, in the order the forward pass produces them."""
    wanted = {(s, i) for s, ls in site_layers.items() for i in ls}
    blocks = f"{prefix}{adapter.layers}"
    reads = []
    if ("hidden", 0) in wanted:
        reads.append(Read(f"{blocks}.0.input", (("hidden", 0, first),)))
    block_sites = adapter.block_sites(config)
    for i in range(n_layers):
        by_module: dict[str, list[tuple[str, int, Take]]] = {}
        for site, (module, take) in block_sites.items():
            if (site, i) in wanted:
                by_module.setdefault(module, []).append((site, i, take))
        reads += [Read(f"{blocks}.{i}.{module}.output", tuple(t)) for module, t in by_module.items()]
        out_targets = [("hidden", i + 1, first)] if ("hidden", i + 1) in wanted else []
        if adapter.final_norm is None and i == n_layers - 1 and ("final", 0) in wanted:
            out_targets.append(("final", 0, first))
        if out_targets:
            reads.append(Read(f"{blocks}.{i}.output", tuple(out_targets)))
    if adapter.final_norm is not None and ("final", 0) in wanted:
        reads.append(Read(f"{prefix}{adapter.final_norm}.output", (("final", 0, first),)))
    return reads


def module_path(hf: Any, site: str, blocks: str, n_layers: int) -> str:
    """The module path from the root of `hf` (with ``{i}``) that the ``module:`` `site` names, relative to the
    base model, else to the root, else (``layers.{i}.fc1``) to the blocks' parent, ``{i}`` standing for blocks
    0..`n_layers`-1 (`blocks`: their path from the root). ValueError in one line, with the nearest names, where it names no module."""
    path, _ = cast("tuple[str, str]", module_site(site))
    prefix = "" if hf.base_model is hf else f"{hf.base_model_prefix}."
    names = {name for name, _ in hf.named_modules() if name}
    # ``layers.{i}`` also names the blocks where they sit deeper (OPT's ``decoder.layers``)
    head = path.partition(".{i}")[0] if "{i}" in path else None
    inner = [blocks + path[len(head) :]] if head and (blocks == head or blocks.endswith("." + head)) else []
    for candidate in dict.fromkeys([prefix + path, path, *inner]):
        if all(candidate.replace("{i}", str(i)) in names for i in range(n_layers if "{i}" in path else 1)):
            return candidate
    # the model's module names as a site spells them: blocks as {i}, relative to the base model where they can be
    spelled = {re.sub(rf"^{re.escape(blocks)}\.\d+(?=\.|$)", blocks + ".{i}", n) for n in names}
    spelled = {n.removeprefix(prefix) if prefix and n.startswith(prefix) else n for n in spelled}
    near = difflib.get_close_matches(path, sorted(spelled), n=3)
    hint = (
        f"; nearest: {', '.join(near)}" if near else f"; the blocks are {blocks.removeprefix(prefix)}.{{i}}"
    )
    raise ValueError(f"site {site!r} names no module of {type(hf).__name__}{hint}")


def module_reader(site: str) -> Take:
    """Reader of a ``module:`` site: the module's value, the first of a tuple (`forward.trace_batch` checks that
    it is (batch, seq, ...)); ValueError in one line for a value that is no tensor."""

    def take(value: Any) -> torch.Tensor:
        x = first(value)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"site {site!r} gives a {type(x).__name__}, not a (batch, seq, ...) tensor")
        return x

    return take


def execution_order(hf: Any, reads: list[Read]) -> list[Read]:
    """`reads` merged by path and sorted in the order one forward pass produces them (what a trace needs),
    found by running two tokens through `hf` with plain hooks: module inputs at their pre-hooks, outputs at
    their hooks, a module called twice by its first call (the one a trace reads). ValueError in one line for
    a module the pass never called."""
    merged: dict[str, tuple[tuple[str, int, Take], ...]] = {}
    for read in reads:
        merged[read.path] = merged.get(read.path, ()) + read.targets
    order: dict[str, int] = {}
    handles = []
    for path in merged:
        name, what = path.rsplit(".", 1)
        module = hf.get_submodule(name)

        def record(*_: Any, path: str = path) -> None:
            order.setdefault(path, len(order))

        hook = module.register_forward_pre_hook if what == "input" else module.register_forward_hook
        handles.append(hook(record))
    try:
        with torch.inference_mode():
            hf(input_ids=torch.zeros((1, 2), dtype=torch.long, device=input_device(hf, False)))
    finally:
        for handle in handles:
            handle.remove()
    missing = [path for path in merged if path not in order]
    if missing:
        raise ValueError(
            f"module {missing[0].rsplit('.', 1)[0]!r} does not run in a forward pass of this model"
        )
    return [Read(path, merged[path]) for path in sorted(merged, key=order.__getitem__)]


@dataclass(frozen=True)
class SitePlan:
    """What one extraction reads from a model: the layers per site, the trace reads in execution order,
    the per-head shapes of the keys/values and attn_pattern sites, the width of each site's rows and the
    bytes of one row of every site and layer (module sites: estimates)."""

    site_layers: dict[str, list[int]]
    reads: list[Read]
    heads: dict[str, tuple[int, int]]
    dims: dict[str, int]
    row_bytes: int


def plan_sites(hf: Any, sites: list[str], layers: Iterable[int] | None, width: int) -> SitePlan:
    """The plan of `sites` at `layers` for `hf`; `width`: the key positions of an ``attn_pattern`` row."""
    base = hf.base_model
    prefix = "" if base is hf else f"{hf.base_model_prefix}."
    adapter = adapter_for(hf)
    n_layers = len(base.get_submodule(adapter.layers))
    blocks = f"{prefix}{adapter.layers}"
    sites = list(dict.fromkeys(sites))
    if "attn_pattern" in sites and not getattr(hf, "_supports_attention_backend", False):
        # transformers' attention interface: its eager function returns the softmax weights, as output[1]
        raise ValueError(
            f"attn_pattern reads the weights transformers' attention interface returns, and {type(hf).__name__} "
            "does not use it: read its attention module with a module: site instead"
        )
    modules = {s: module_path(hf, s, blocks, n_layers) for s in sites if module_site(s)}
    sizes = site_sizes(adapter, hf.config, n_layers) | {s: n_layers if per_block(s) else 1 for s in modules}
    site_layers = resolve_layers(sites, layers, sizes, hf.config.model_type)
    heads = {s: head_shape(hf.config) for s in site_layers if s in HEADED}
    if "attn_pattern" in site_layers:
        heads["attn_pattern"] = (hf.config.num_attention_heads, width)
    dims = {s: heads[s][0] * heads[s][1] if s in heads else hf.config.hidden_size for s in site_layers}
    reads = plan_reads(adapter, hf.config, prefix, n_layers, site_layers)
    for site, path in modules.items():
        what = cast("tuple[str, str]", module_site(site))[1]
        module = hf.get_submodule(path.replace("{i}", "0"))
        # rows of a Linear are its in/out features wide; of anything else, estimated as hidden_size
        dims[site] = getattr(module, {"input": "in_features", "output": "out_features"}[what], dims[site])
        take = module_reader(site)
        reads += [
            Read(f"{path.replace('{i}', str(i))}.{what}", ((site, i, take),)) for i in site_layers[site]
        ]
    return SitePlan(
        site_layers,
        execution_order(hf, reads) if modules else reads,
        heads,
        dims,
        4 * sum(dims[s] * len(ls) for s, ls in site_layers.items()),
    )
