"""Moving extracted rows from the model's device to the host without stalling the forward pass.

`to_host` starts a copy of a device tensor into pinned (page-locked) host memory with
``non_blocking=True``, so the device keeps running the forward pass while the copy proceeds;
`finish_host_copies` waits for every such copy of a traced pass and converts the rows to the dtype the
results hold (float32), on the host. Rows travel in the model's own dtype (a bf16 model's rows are half
the bytes of float32 ones). On the CPU both are plain tensor operations: the rows are already there.
"""

from __future__ import annotations

import torch


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the host: ``x`` itself when it is there, else a copy. From a CUDA device the copy goes
    into pinned memory without blocking: read it only after `finish_host_copies`."""
    if x.device.type != "cuda":
        return x.cpu()
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return staged.copy_(x, non_blocking=True)


def finish_host_copies(
    rows: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``rows`` (`to_host` copies from a model on ``device``) once their copies have landed, each in
    ``dtype`` (float64 ones, the log-probabilities, kept).

    A CUDA model may be spread over several GPUs, so every one is synchronised. A staged (pinned) row is
    converted into a fresh tensor, which frees its pinned block for the next batch's copies (pinned
    memory is a scarce resource: results held in it would grow without bound)."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
    return {
        name: x if x.dtype == torch.float64 else x.to(dtype, copy=x.is_pinned()) for name, x in rows.items()
    }
