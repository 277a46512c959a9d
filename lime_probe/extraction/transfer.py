"""Moving a batch between the host and the model's device without stalling the forward pass.

`to_device` moves a batch's inputs to the model's device and `to_host` copies rows back into pinned
(page-locked) host memory on a copy stream of their device, both with ``non_blocking=True``: the host does
not wait for the device, and the forward's stream does not wait for the copies (on the forward's own
stream a copy holds back every kernel queued after it until it has landed). `copies_landed` marks a
traced pass's copies, and `finish_host_copies` waits for that mark only, not for the whole device, so the
device can already run the next batch, then converts the rows to the dtype the results hold (float32) on
the host. Rows travel in the model's own dtype (a bf16 model's rows are half the bytes of float32 ones);
`all_finite` checks them where they are, in one reduction. On the CPU all of it is plain tensor
operations: the rows are already there.
"""

from __future__ import annotations

from typing import Any

import torch

# one copy stream per CUDA device, made at first use
_COPY_STREAMS: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``. From the host to a CUDA device the copy goes through pinned memory without
    blocking: a pageable copy would make the host wait until the device has finished all it was given,
    where it could be preparing the next pass (the copy itself is queued behind that work)."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host: ``x`` itself when it is there, else a copy. From a CUDA device the copy goes into
    pinned memory on the device's copy stream, after everything queued so far on the current stream (which
    wrote ``x``): read it only after `finish_host_copies`."""
    if x.device.type != "cuda":
        return x.cpu()
    stream = _copy_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        staged.copy_(x, non_blocking=True)
    x.record_stream(stream)  # the allocator must not hand x's memory out again before the copy has read it
    return staged


def copies_landed() -> list[Any]:
    """A mark on every copy stream, after the `to_host` copies started so far: CUDA events, none off CUDA."""
    events = []
    for stream in _COPY_STREAMS.values():
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


def finish_host_copies(
    rows: dict[str, torch.Tensor], landed: list[Any], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``rows`` (`to_host` copies) once the copies before the mark ``landed`` (`copies_landed`) are done,
    each in ``dtype`` (float64 ones, the log-probabilities, kept).

    A staged (pinned) row is converted into a fresh tensor, which frees its pinned block for the next
    batch's copies (pinned memory is a scarce resource: results held in it would grow without bound)."""
    for event in landed:
        event.synchronize()
    return {
        name: x if x.dtype == torch.float64 else x.to(dtype, copy=x.is_pinned()) for name, x in rows.items()
    }


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``x`` is finite: a 0-d bool tensor on ``x``'s device (no wait for it).
    NaN and infinities show in the extremes, which one reduction finds (on the CPU about 20x faster than
    ``isfinite(x).all()``, which writes a mask as large as ``x``)."""
    if x.numel() == 0 or not x.is_floating_point():  # integers and booleans are finite
        return torch.ones((), dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(x)
    return torch.isfinite(low) & torch.isfinite(high)
