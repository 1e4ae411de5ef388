"""Programmatic dependent launch: on Hopper and later, a decode kernel starts while the one before
it is still draining.

A batch-1 decode step is ~200 short kernels in a CUDA graph. Launched plainly, each waits for
the previous one to finish before its programs are even scheduled, and the GPU streams no
weights in between: a few microseconds per kernel, which for a small model is most of the
step. Launched with the programmatic-serialization attribute, a kernel's programs become
resident as soon as every program of the one before has signalled (`gdc_launch_dependents`),
issue the loads that depend on nothing earlier (their weights), and only then wait
(`gdc_wait`) for the earlier kernel's results.

The contract for every kernel launched this way: it calls `gdc_wait` before it reads anything
an earlier kernel writes and before it writes anything, and calls `gdc_launch_dependents` only
after that wait, so that at most two kernels overlap. Kernels take it as the constexpr `PDL`
(off under Triton's interpreter, which has no inline assembly).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:
    triton = None

_HOPPER: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Launch this device's kernels with PDL now? `STRIDE_PDL=0` turns it off (A/B runs); it is
    read at each launch, so a CUDA graph keeps what held when it was captured."""
    if device.type != "cuda" or triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _HOPPER[index] and os.environ.get("STRIDE_PDL", "1") != "0"


def launch_options(device: torch.device) -> dict[str, bool]:
    """A kernel launch's PDL arguments: the launch option and the kernel's `PDL` constexpr."""
    on = enabled(device)
    return dict(PDL=on, launch_pdl=on)
