"""Moving a batch between the host and the model's device without stalling the forward pass.

`to_device` moves a batch's inputs to the model's device and `to_host` copies its rows back into pinned
(page-locked) host memory on a copy stream of their device, both with ``non_blocking=True``: the host does
not wait for the device, and the forward's stream does not wait for the copies (on the forward's own
stream a copy holds back every kernel queued after it until it has landed). `copies_landed` marks a
traced pass's copies, and `wait_for` waits for that mark only, not for the whole device, so the device
can already run the next batch while the host places the rows (`assembly`). Rows travel in the model's
own dtype (a bf16 model's rows are half the bytes of float32 ones); `all_finite` checks them where they
are, in one reduction. On the CPU all of it is plain tensor operations: the rows are already there.
"""

from __future__ import annotations

from itertools import accumulate
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


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` on the host: each itself when it is there, else a copy. From a CUDA device the copies go
    into one pinned buffer per device, on the device's copy stream, after everything queued so far on
    its current stream (which wrote them): read them only after `wait_for` the mark `copies_landed` sets.
    One buffer and one switch of streams per batch, not per tensor: per tensor, the switches alone cost a
    bf16 extraction on one H100 22 ms of host time (bench/RESULTS.md)."""
    host = {name: x.cpu() for name, x in tensors.items() if x.device.type != "cuda"}
    devices: dict[torch.device, list[str]] = {}
    for name, x in tensors.items():
        if x.device.type == "cuda":
            devices.setdefault(x.device, []).append(name)
    for device, names in devices.items():
        stream = _copy_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        staged = staging([tensors[name] for name in names], pin_memory=True)
        with torch.cuda.stream(stream):
            for name, into in zip(names, staged, strict=True):
                into.copy_(tensors[name], non_blocking=True)
                tensors[name].record_stream(
                    stream
                )  # its memory must not be handed out before the copy read it
                host[name] = into
    return {name: host[name] for name in tensors}


def staging(tensors: list[torch.Tensor], pin_memory: bool = False) -> list[torch.Tensor]:
    """Empty host tensors shaped and typed like ``tensors``, all views of one new buffer (each starting
    at a multiple of 16 bytes), pinned with ``pin_memory``."""
    sizes = [-(-x.nbytes // 16) * 16 for x in tensors]
    starts = [0, *accumulate(sizes)]
    buffer = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=pin_memory)
    return [
        buffer[start : start + x.nbytes].view(x.dtype).view(x.shape)
        for x, start in zip(tensors, starts, strict=False)
    ]


def copies_landed() -> list[Any]:
    """A mark on every copy stream, after the `to_host` copies started so far: CUDA events, none off CUDA."""
    events = []
    for stream in _COPY_STREAMS.values():
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


def wait_for(landed: list[Any]) -> None:
    """Wait until the copies before the mark ``landed`` (`copies_landed`) are done, and for nothing else
    the device is running."""
    for event in landed:
        event.synchronize()


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``x`` is finite: a 0-d bool tensor on ``x``'s device (no wait for it).
    NaN and infinities show in the extremes, which one reduction finds (on the CPU about 20x faster than
    ``isfinite(x).all()``, which writes a mask as large as ``x``)."""
    if x.numel() == 0 or not x.is_floating_point():  # integers and booleans are finite
        return torch.ones((), dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(x)
    return torch.isfinite(low) & torch.isfinite(high)
