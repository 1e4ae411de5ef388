"""Tensor parallelism's all-reduce of decode-sized messages: one kernel over buffers every rank
maps, with the residual add and the next RMSNorm in it (`kernels.peer_sum`).

A decode step all-reduces a few KB twice per layer (after the attention's output projection
and after the MLP's down projection). At that size NCCL's cost is its latency and what it does
to the kernels around it: the next kernel cannot start early behind it, and the sum joins the
residual stream in a kernel of its own. Here the product's rows go into every other rank's
inbox, a buffer every rank of the host maps (CUDA IPC handles, exchanged once at start-up and
opened in this rank's own context, through the driver API): from the fused GEMV's epilogue as
they are computed (`PeerSum.push`), or from the sum kernel after a cuBLAS product; that kernel
waits for the peers' rows in its own inbox and sums them into the residual. Messages over
`MAX_BYTES` (prefills, large batches) and every message under `--all-reduce nccl` go through
NCCL, whose ring uses the links' bandwidth better. NVLink multicast is never used: ranks write
each other's memory with ordinary stores.

`PeerSum.setup` is collective (every rank calls it at the same point of start-up); it returns
None, and NCCL takes every all-reduce, on the CPU, with one rank, or where some pair of GPUs
cannot map each other's memory.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch
import torch.distributed as dist

from stride.engine.kernels import peer_sum

log = logging.getLogger(__name__)

# Larger messages go through NCCL (docs/BENCHMARKS.md, "the peer sum and the GEMV tiles")
MAX_BYTES = 64 << 10
MODES = ("auto", "nccl")


class PeerUnavailable(RuntimeError):
    """Some rank could not share or map the buffers (every rank then keeps NCCL)."""


class PeerSum:
    """This rank's staging rows and its inbox (two halves each), every rank's inbox mapped here;
    `stage` gives the view a product writes its partial rows into, `add` sums every rank's
    into the residual."""

    def __init__(self, device: torch.device, dtype: torch.dtype, cols: int) -> None:
        """Collective; raises PeerUnavailable on every rank if any rank could not map."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cols = cols
        self.max_rows = max(1, MAX_BYTES // (cols * dtype.itemsize))
        self.half_numel = self.max_rows * cols
        self._stage = torch.empty(2 * self.half_numel, dtype=dtype, device=device)
        # [half][sender][rows]: where each rank's rows arrive; empty (the sentinel) to begin with
        bits, self._empty = peer_sum.sentinel(dtype)
        inbox = torch.full((2 * self.world * self.half_numel,), self._empty, dtype=bits,
                           device=device)  # fmt: skip
        addresses, opened = _map_peers(inbox, device)
        torch.cuda.synchronize(device)
        mapped = torch.tensor([int(len(addresses) == self.world)], device=device)
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN)  # (and every rank's inbox is empty now)
        if not mapped.item():
            _unmap(opened, device)
            raise PeerUnavailable("some rank could not map the others' buffers")
        self.inbox_ptrs = torch.tensor(addresses, device=device)
        self._inbox = inbox  # (ours: freed with this object, after the peers' unmapping)
        weakref.finalize(self, _unmap, opened, device)

    @classmethod
    def setup(
        cls, device: torch.device, dtype: torch.dtype, cols: int, mode: str = "auto"
    ) -> PeerSum | None:
        """This rank's peer sum, or None where NCCL takes every all-reduce (collective)."""
        if mode not in MODES:
            raise ValueError(f"all-reduce mode {mode!r}: give one of {', '.join(MODES)}")
        if mode == "nccl" or device.type != "cuda" or peer_sum.triton is None:
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        first = index - dist.get_rank()  # rank r holds cuda:first + r (`rank_device`)
        ok = all(
            torch.cuda.can_device_access_peer(index, first + r)
            for r in range(dist.get_world_size())
            if first + r != index
        )
        agreed = torch.tensor([int(ok)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # one rank without peer access: none use it
        if not agreed.item():
            log.info("all-reduce: NCCL only (some GPUs cannot map each other's memory)")
            return None
        try:
            peer = cls(torch.device("cuda", index), dtype, cols)
        except PeerUnavailable as e:
            log.warning("all-reduce: NCCL only (%s)", e)
            return None
        log.info("all-reduce: one kernel over peer memory up to %d rows, NCCL above", peer.max_rows)
        return peer

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def stage(self, rows: int, half: int) -> torch.Tensor:
        """Where this rank's partial rows of sum `half` (0 or 1, alternating) go: [rows, cols]."""
        at = half * self.half_numel
        return self._stage[at : at + rows * self.cols].view(rows, self.cols)

    def push(self, half: int) -> peer_sum.Push:
        """Where a product that stages its rows for sum `half` delivers them as well."""
        at = (half * self.world + self.rank) * self.half_numel
        return peer_sum.Push(self.inbox_ptrs, at, self.rank, self.world, self._empty)

    def add(
        self,
        residual: torch.Tensor,
        half: int,
        norm: torch.nn.Module | None = None,
        pushed: bool = False,
    ) -> torch.Tensor | None:
        """residual += every rank's staged rows of `half`; with `norm`, return norm(residual).
        `pushed`: the product delivered them (`push`)."""
        return peer_sum.peer_sum(self.stage(len(residual), half), self.inbox_ptrs, self.rank,
                                 residual, half * self.world * self.half_numel, self.half_numel,
                                 norm, pushed)  # fmt: skip


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_driver: ctypes.CDLL | None = None


def _cu(name: str, *args) -> None:
    """Call CUDA driver function `name`; raise on an error code."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    code = getattr(_driver, name)(*args)
    if code != 0:
        raise RuntimeError(f"{name}: CUDA driver error {code}")


def _map_peers(local: torch.Tensor, device: torch.device) -> tuple[list[int], list[int]]:
    """The address of every rank's `local` in this process (its own as it is), and the bases of
    the other ranks' allocations opened here: each rank shares an IPC handle of the allocation
    `local` lies in (and where in it `local` starts), and opens the others' in this device's
    context, peer access enabled as it goes. Where some rank cannot share or this one cannot
    open, fewer addresses than ranks (every rank still takes part in the exchange)."""
    with torch.cuda.device(device):
        mine = None
        try:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _cu("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size),
                ctypes.c_uint64(local.data_ptr()))  # fmt: skip
            handle = _IpcHandle()
            _cu("cuIpcGetMemHandle", ctypes.byref(handle), base)
            mine = (bytes(handle), local.data_ptr() - base.value)
        except (OSError, RuntimeError):
            log.debug("sharing this rank's buffer failed", exc_info=True)
        shared: list = [None] * dist.get_world_size()
        dist.all_gather_object(shared, mine)
        addresses: list[int] = []
        opened: list[int] = []
        if any(entry is None for entry in shared):
            return addresses, opened
        for rank, (raw, offset) in enumerate(shared):
            if rank == dist.get_rank():
                addresses.append(local.data_ptr())
                continue
            theirs = ctypes.c_uint64()
            lazy_peer_access = ctypes.c_uint(1)  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            try:
                handle = _IpcHandle.from_buffer_copy(raw)
                _cu("cuIpcOpenMemHandle_v2", ctypes.byref(theirs), handle, lazy_peer_access)
            except RuntimeError:
                log.debug("mapping rank %d's buffer failed", rank, exc_info=True)
                return [], opened
            opened.append(theirs.value)
            addresses.append(theirs.value + offset)
    return addresses, opened


def _unmap(opened: list[int], device: torch.device) -> None:
    """Close the other ranks' allocations `_map_peers` opened (their memory is freed once every
    rank that mapped it has closed it)."""
    try:
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            for base in opened:
                _cu("cuIpcCloseMemHandle", ctypes.c_uint64(base))
    except Exception:  # (at exit the context may be gone already: nothing is left to free)
        log.debug("unmapping peer memory failed", exc_info=True)
