"""The all-reduce that joins tensor-parallel ranks: through peer-mapped memory for small
messages, NCCL for large ones.

A decode step all-reduces a few KB per layer twice (after the attention's output projection and
after the MLP's down projection). At that size NCCL's cost is its latency, not bandwidth. On GPUs
of one host that map each other's memory, a one-shot all-reduce costs about one kernel: every
rank copies its input into a buffer of symmetric memory (allocated at the same offset on every
rank, `torch.distributed._symmetric_memory`), the ranks meet at a barrier, and each reads all
the ranks' buffers and sums them, in rank order: every rank holds the same bits afterwards, as
the replicated residual stream needs. It is captured in the decode graphs like NCCL's kernels.
The kernel has no barrier at its end, so consecutive all-reduces take turns between two halves
of the buffer: a rank that races ahead to stage the next one writes the half nobody reads.
Messages over `PEER_MAX_BYTES` (prefills, large batches) go through NCCL, whose ring uses the
links' bandwidth better.

NVLink multicast (`multimem` operations) is never used: the one-shot kernel reads peers' memory
with ordinary loads.

`setup` runs on every rank at the same point of start-up (it is collective); on the CPU (gloo),
with one rank, or where peer memory is unavailable, every all-reduce goes through
`torch.distributed`.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

PEER_MAX_BYTES = 2 << 20  # larger messages go through NCCL (bench/bench_all_reduce.py)
MODES = ("auto", "nccl")


class PeerAllReduce:
    """One-shot all-reduces of up to `max_bytes` through a buffer of symmetric memory."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.group = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(2, self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group)
        self.calls = 0  # (the same sequence on every rank, in the graphs they capture too)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[self.calls % 2, : x.numel()]
        self.calls += 1
        staged.copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group).view_as(x)


_peer: PeerAllReduce | None = None


def setup(device: torch.device, dtype: torch.dtype, mode: str = "auto") -> None:
    """Choose this rank's small-message all-reduce (collective: every rank calls it together).
    `mode` "nccl" keeps every all-reduce on `torch.distributed`."""
    global _peer
    _peer = None
    if mode not in MODES:
        raise ValueError(f"all-reduce mode {mode!r}: give one of {', '.join(MODES)}")
    if mode == "nccl" or device.type != "cuda" or dist.get_world_size() < 2:
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    first = device.index - dist.get_rank()  # rank r holds cuda:first + r (`rank_device`)
    peers = [torch.device("cuda", first + r) for r in range(dist.get_world_size())]
    ok = hasattr(torch.ops.symm_mem, "one_shot_all_reduce") and all(
        torch.cuda.can_device_access_peer(device, peer) for peer in peers if peer != device
    )
    agreed = torch.tensor([int(ok)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # one rank without peer access: none use it
    if not agreed.item():
        log.info("all-reduce: NCCL only (no peer access between every pair of ranks)")
        return
    _peer = PeerAllReduce(device, dtype, PEER_MAX_BYTES)
    log.info("all-reduce: one-shot over peer memory up to %d KiB, NCCL above", PEER_MAX_BYTES >> 10)


def small_messages() -> str:
    """How this rank all-reduces small messages (what `setup` chose): "peer", or the process
    group's backend ("nccl", "gloo")."""
    return "peer" if _peer is not None else dist.get_backend()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over every rank (in place where NCCL or gloo does it)."""
    if _peer is not None and _peer.fits(x):
        return _peer(x)
    dist.all_reduce(x)
    return x
