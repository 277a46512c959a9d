"""One traced forward pass of a batch (`trace_batch`): inside an nnsight trace it reads the module values
`planning` lists, in the order the pass produces them, and keeps each site's rows (`select_rows`; attention
weights as `pattern_rows`), with the sequences' summed log-probabilities (`token_logprobs`) where asked;
`attention_for` runs the attention implementation that returns weights where a site reads them.

nnsight notes: the trace lives in this module, so `extract` works from scripts, notebooks, ``python -c``
and stdin alike; a model must not be traced from two threads at once (use one model per thread).
Each forward stops (``tracer.stop()``) right after the last site it needs.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import nnsight
import torch

from lime_probe.extraction.planning import SitePlan
from lime_probe.extraction.transfer import all_finite, copies_landed, to_device, to_host, wait_for


def envoy_path(path: str) -> str:
    """A module path ending in .input/.output as nnsight spells it: a module named like an attribute every Envoy
    has (BERT's ``output`` submodules) is served under nnsight's prefixed name (``E_output``)."""
    *modules, what = path.split(".")
    prefix = nnsight.Envoy.OVERLOAD_PREFIX
    return ".".join(
        [
            prefix + m
            if not m.startswith("_") and inspect.isdatadescriptor(getattr(nnsight.Envoy, m, None))
            else m
            for m in modules
        ]
        + [what]
    )


@contextlib.contextmanager
def attention_for(hf: Any, weights: bool, remote: bool | str = False) -> Iterator[str]:
    """A context in which `hf` runs the attention implementation it yields: its own, or "eager" where the
    attention `weights` are read and it runs another (SDPA and flash attention return none), with a
    one-line warning, restoring its own after. A remote model cannot be switched: ValueError."""
    own = getattr(hf.config, "_attn_implementation", None) or "eager"
    if not weights or own == "eager":
        yield own
        return
    if remote and remote != "local":
        raise ValueError(f"attn_pattern needs eager attention, and this remote model runs {own!r}")
    warnings.warn(
        f"attn_pattern: {type(hf).__name__} runs {own!r} attention, which returns no weights; this "
        "extraction runs eager attention for every site (load with attn_implementation='eager' to choose it)",
        stacklevel=4,  # the caller of `extract` (through contextlib and `extract`)
    )
    hf.set_attn_implementation("eager")
    try:
        yield "eager"
    finally:
        hf.set_attn_implementation(own)


def pattern_rows(weights: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """Attention weights (batch, heads, T, T) as a row per query (batch, T, heads * width): per head, the
    weights over the sequence's keys counted from its first real token (`mask` (batch, T) marks them, one
    contiguous run whichever side is padded), zero past its end and from T to `width`."""
    b, h, t, _ = weights.shape
    mask = mask.to(weights.device)
    positions = torch.arange(t, device=weights.device)
    start = (mask.cumsum(1) == 0).sum(1, keepdim=True)  # the first real token (left padding: after the pads)
    columns = (start + positions).clamp(max=t - 1)  # (batch, T): key k of each sequence
    aligned = weights.gather(-1, columns[:, None, None, :].expand(b, h, t, t))
    aligned = aligned * (positions < mask.sum(1, keepdim=True))[:, None, None, :]
    return torch.nn.functional.pad(aligned, (0, width - t)).transpose(1, 2).flatten(2)


@dataclass
class TracedBatch:
    """A traced batch's rows on their way to the host (`trace_batch`); `result` waits for them.

    Attributes:
        rows: "<site>/<layer>" (and "logprobs") -> the host tensor its copy lands in.
        finite: the same names -> 0-d bool on the host, whether every value was finite (found on the device).
        landed: the mark after the batch's copies (`transfer.copies_landed`).
        index: the batch's sequences (their positions in the input), for errors.
    """

    rows: dict[str, torch.Tensor]
    finite: dict[str, torch.Tensor]
    landed: list[Any]
    index: list[int]

    def result(self) -> dict[str, torch.Tensor]:
        """The rows once landed, in the dtype they travelled in (the model's; log-probabilities float64).
        ValueError names the first site with a non-finite value."""
        wait_for(self.landed)
        for name, finite in self.finite.items():
            if not bool(finite):
                what = (
                    "log-probabilities"
                    if name == "logprobs"
                    else "activations (NaN/Inf) at site {!r} layer {}".format(*name.split("/"))
                )
                shown = ", ".join(map(str, sorted(self.index)[:8])) + (", ..." if len(self.index) > 8 else "")
                raise ValueError(f"non-finite {what} in a batch of sequences {shown}")
        return self.rows


def trace_batch(
    nn_model: Any,
    batch: dict[str, torch.Tensor],
    keep: torch.Tensor,
    device: torch.device,
    plan: SitePlan,
    pool: str,
    remote: bool | str,
    index: list[int],
    logprobs: bool = False,
) -> TracedBatch:
    """One traced forward pass of `batch` (sequences `index` of the input): "<site>/<layer>" -> selected
    rows (on the host in the model's dtype, once `TracedBatch.result` has them; pooled means in float32);
    with `logprobs` also "logprobs" -> (batch,) float64, each sequence's summed log p(t_i | t_<i) over its
    real tokens after the first. Rows are selected (or pooled) and checked for NaN/Inf on the model's
    device and travel to the host in its dtype after the pass (`lime_probe.extraction.transfer`): from a
    local GPU without stalling the device, and landing while it runs the next batch; a remote run copies
    them where it runs, synchronously. ``keep`` (batch, seq, on the host) marks the rows; ``device`` is
    where the model takes its inputs, which they reach without the host waiting for the device
    (`transfer.to_device`)."""
    # where the rows are, found once per batch (not per site) and where keep is: no wait for a device
    positions = None if pool != "none" else to_device(kept_positions(keep), device)
    inputs = {k: to_device(v, device) for k, v in batch.items()}
    keep = to_device(keep, device)
    # a remote run's values leave its server as they are: moved to the host there; a local run's after the pass
    here = torch.Tensor.cpu if remote else _as_is
    if remote:  # ship this package's readers by value: a remote (NDIF) server does not have lime_probe
        nnsight.register(__package__)
    with torch.inference_mode(), nn_model.trace(**inputs, remote=remote) as tracer:
        rows, finite = nnsight.save({}), nnsight.save({})
        for read in plan.reads:
            value = nn_model.get(envoy_path(read.path))
            for site, layer, take in read.targets:
                x = take(value)
                if site == "attn_pattern":
                    x = pattern_rows(x, inputs["attention_mask"], plan.heads[site][1])
                elif x.shape[:2] != keep.shape and x.shape[:1] == (keep.numel(),):
                    x = x.unflatten(0, keep.shape)  # tokens flattened batch-major (OPT's fc1/fc2 inputs)
                if x.shape[:2] != keep.shape:
                    raise ValueError(
                        f"site {site!r} layer {layer} gives a {tuple(x.shape)} tensor, not (batch, seq, ...) "
                        f"= {tuple(keep.shape)}"
                    )
                # dims after seq flattened: a module site may give (batch, seq, heads, head_dim)
                selected = select_rows(x.reshape(*keep.shape, -1), keep, pool, None, positions)
                rows[f"{site}/{layer}"] = here(selected)
                finite[f"{site}/{layer}"] = here(all_finite(selected))
        if logprobs:
            scores = token_logprobs(nn_model.output.logits, inputs["input_ids"], inputs["attention_mask"])
            rows["logprobs"], finite["logprobs"] = here(scores), here(all_finite(scores))
        tracer.stop()
    return TracedBatch(to_host(rows), to_host(finite), copies_landed(), index)


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Summed next-token log-probabilities: logits (batch, seq, vocab), input_ids and attention_mask
    (batch, seq) -> (batch,) float64, sum over positions i >= 1 where tokens i-1 and i are both real of
    log softmax(logits[i-1])[input_ids[i]] (left or right padding)."""
    input_ids, attention_mask = input_ids.to(logits.device), attention_mask.to(logits.device)
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    pairs = (attention_mask[:, :-1] * attention_mask[:, 1:]).bool()
    return torch.where(pairs, logp, 0.0).double().sum(-1)


def select_rows(
    x: torch.Tensor,
    keep: torch.Tensor,
    pool: str,
    dtype: torch.dtype | None = torch.float32,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of x (batch, seq, dim) where keep (batch, seq) is True, in sequence order -> (n, dim) in
    `dtype` (None: x's own); with pool="mean" the mean over each sequence's kept tokens -> (batch, dim),
    summed in float32 (None: kept in float32). Computed on x's device. ``index``: keep's flat positions
    (`kept_positions`), where the caller reads many sites of one batch: rows taken by index need no
    device sync, where a boolean mask makes the host wait for the device to count its rows."""
    keep = keep.to(x.device)  # a layer of a device-mapped (or remote) model: on its own device
    if pool == "mean":
        weights = keep.unsqueeze(-1)
        rows = torch.where(weights, x, 0).sum(1, dtype=torch.float32) / weights.sum(1)
    elif index is not None:
        rows = x.flatten(0, 1).index_select(0, index.to(x.device))
    else:
        rows = x[keep]
    return rows if dtype is None else rows.to(dtype)


def kept_positions(keep: torch.Tensor) -> torch.Tensor:
    """The flat positions (batch-major) where ``keep`` (batch, seq) is True -> (n,), on its device."""
    return keep.flatten().nonzero().squeeze(1)
