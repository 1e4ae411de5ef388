"""The one-shot all-reduce of tensor parallelism's decode steps, with the residual add (and the
next RMSNorm) in the same kernel (`collectives.PeerSum` owns its buffers).

Every rank has written its partial product into its own staging buffer. Each program of the
kernel pushes its columns of those rows into every other rank's inbox (a buffer every rank
maps, CUDA IPC), then waits in its own inbox until every other rank's columns have arrived,
sums every rank's rows in rank order (so every rank holds the same bits, as the replicated
residual stream needs), adds the sum into the residual stream and, with NORM, writes the
RMSNorm of the new residual for the next product.

A fused GEMV that stages the rows delivers them itself, from its epilogue (`Push`, `push_rows`):
each of its programs stores its few columns to every peer as soon as they are computed, so the
rows are on their way before this kernel starts, and it only waits and sums (`pushed`).

There are no flags: the data is its own signal. An inbox holds negative zero (the sentinel)
wherever nothing has arrived; a sender turns its own negative zeros into positive ones, which
sum to the same value, so that a value that has arrived never looks like the sentinel. A
reader polls until no sentinel is left, then puts the sentinel back where it read, so the
kernel replays in a CUDA graph with nothing reset from the host. Its only waits are for data
to arrive over the links (one way), not for a flag and then a read (there and back).

Consecutive sums take turns between two halves of the inboxes: a rank that races ahead to push
the next sum writes the half nobody reads, and it cannot push into this half again before
every peer has finished this sum (it needs their rows of the sum in between first). A program
gives up waiting after `SPINS` polls, so that a dead peer cannot hang the GPU.

Launched with programmatic dependent launch (`pdl`), it lets the next kernel start at once: that
kernel's weight loads overlap the wait and the sum, which is most of what an all-reduce of a
few KB costs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stride.engine.kernels import pdl

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    triton = None

ADD_BLOCK = 1024  # columns per program without the norm (more programs: more reads in flight)
# Inbox polls after which a program stops waiting (tens of seconds): a dead peer must not hang
# this GPU; the engine's watcher fails the engine when a worker exits (`workers`).
SPINS = 1 << 26


class Push(NamedTuple):
    """Where a product's epilogue delivers this rank's rows (`layer.gemv`): element `at` of
    every other rank's inbox (`inbox_ptrs`), whose empty places hold `empty`."""

    inbox_ptrs: torch.Tensor
    at: int
    rank: int
    world: int
    empty: int


def sentinel(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(the integers of `dtype`'s width, negative zero's bits as one): what an empty inbox holds."""
    bits = torch.finfo(dtype).bits
    return {16: torch.int16, 32: torch.int32}[bits], -(1 << (bits - 1))


def peer_sum(
    stage: torch.Tensor,
    inbox_ptrs: torch.Tensor,
    rank: int,
    residual: torch.Tensor,
    inbox_at: int,
    slot: int,
    norm: torch.nn.Module | None = None,
    pushed: bool = False,
) -> torch.Tensor | None:
    """residual += the sum over ranks of their staged rows (`stage`: this rank's rows;
    `inbox_ptrs`: every rank's inbox, where rank r's rows arrive `inbox_at + r * slot` elements
    in); with `norm`, return norm(residual) too. `pushed`: the product that staged them has
    delivered them to the other ranks already (`Push`)."""
    rows, cols = residual.shape
    if norm is not None:
        block, programs = triton.next_power_of_2(cols), 1
        out = torch.empty_like(residual)
    else:
        block = min(ADD_BLOCK, triton.next_power_of_2(cols))
        programs, out = triton.cdiv(cols, block), residual
    _peer_sum_kernel[(rows, programs)](
        stage,
        inbox_ptrs,
        residual,
        norm.weight if norm is not None else residual,
        out,
        cols,
        norm.eps if norm is not None else 0.0,
        inbox_at,
        slot,
        RANK=rank,
        WORLD=len(inbox_ptrs),
        BLOCK=block,
        NORM=norm is not None,
        EMPTY=sentinel(residual.dtype)[1],
        PUSHED=pushed,
        SPINS=SPINS,
        num_warps=4 if block <= 2048 else 8,
        **pdl.launch_options(residual.device),
    )
    return out if norm is not None else None


if triton is not None:

    @triton.jit
    def as_bits(values, EMPTY: tl.constexpr):
        """`values` as integers of their width, negative zeros as positive ones: never EMPTY."""
        if EMPTY == -32768:
            bits = values.to(tl.int16, bitcast=True)
        else:
            bits = values.to(tl.int32, bitcast=True)
        return tl.where(bits == EMPTY, tl.zeros_like(bits), bits)

    @triton.jit
    def push_rows(bits, inbox_ptrs, at, ok, RANK: tl.constexpr, WORLD: tl.constexpr):
        """Store `bits` (`as_bits`) at `at` in every other rank's inbox."""
        for p in tl.static_range(WORLD):
            if p != RANK:
                theirs = tl.load(inbox_ptrs + p).to(tl.pointer_type(bits.dtype))
                tl.store(theirs + at, bits, mask=ok)

    @triton.jit
    def _peer_sum_kernel(
        stage_ptr,
        inbox_ptrs,
        res_ptr,
        norm_ptr,
        out_ptr,
        cols,
        eps,
        inbox_at,
        slot,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        BLOCK: tl.constexpr,
        NORM: tl.constexpr,
        EMPTY: tl.constexpr,
        PUSHED: tl.constexpr,
        PDL: tl.constexpr,
        SPINS: tl.constexpr,
    ):
        """Columns [BLOCK * program_id(1), + BLOCK) of row program_id(0)."""
        dtype = res_ptr.dtype.element_ty
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < cols
        at = row.to(tl.int64) * cols + c
        if PDL:  # the staged rows are the kernel before's output
            gdc_wait()
            gdc_launch_dependents()
        ours = as_bits(tl.load(stage_ptr + at, mask=ok, other=0.0), EMPTY)
        if not PUSHED:  # deliver our rows to every other rank's inbox
            push_rows(ours, inbox_ptrs, inbox_at + RANK * slot + at, ok, RANK, WORLD)
        empty = tl.full([BLOCK], EMPTY, ours.dtype)
        inbox = tl.load(inbox_ptrs + RANK).to(tl.pointer_type(ours.dtype)) + inbox_at + at
        tries = tl.full([], 0, tl.int32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):  # in rank order: the same bits on every rank
            if p == RANK:
                arrived = ours
            else:
                arrived = tl.load(inbox + p * slot, mask=ok, other=0, volatile=True)
                missing = tl.max((arrived == empty).to(tl.int32), axis=0)
                while (missing > 0) & (tries < SPINS):
                    arrived = tl.load(inbox + p * slot, mask=ok, other=0, volatile=True)
                    missing = tl.max((arrived == empty).to(tl.int32), axis=0)
                    tries += 1
                tl.store(inbox + p * slot, empty, mask=ok)  # ready for the sum after next
            total += arrived.to(dtype, bitcast=True).to(tl.float32)
        x = (total.to(dtype) + tl.load(res_ptr + at, mask=ok, other=0.0)).to(dtype)
        tl.store(res_ptr + at, x, mask=ok)
        if NORM:  # as `layer._rms_norm_kernel` rounds
            xf = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / cols + eps)
            w = tl.load(norm_ptr + c, mask=ok, other=0.0)
            tl.store(out_ptr + at, (w * (xf * rstd).to(dtype)).to(dtype), mask=ok)
