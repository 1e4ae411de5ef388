"""The one-shot all-reduce of tensor parallelism's decode steps, with the residual add (and the
next RMSNorm) in the same kernel (`collectives.PeerSum` owns its buffers).

Every rank has written its partial product into its own staging buffer, which every other rank
maps (CUDA IPC). Each program of the kernel meets the same program of every other rank at a
flag barrier, then reads its columns of every rank's staging buffer, sums them in rank order (so
every rank holds the same bits, as the replicated residual stream needs), adds the sum into the
residual stream and, with NORM, writes the RMSNorm of the new residual for the next product.

The flags reset themselves: a sender sets a peer's flag to 1, and the waiter takes it back from 1
to 0, so the kernel replays in a CUDA graph with nothing reset from the host. The kernel has no
barrier at its end; consecutive sums take turns between two halves of the buffers, so a rank
that races ahead to stage the next one writes the half nobody reads (it cannot pass that next
barrier before every peer has started it, i.e. finished this one). For the same reason a sender
neither waits for its flag to arrive nor checks that the last one was taken: it sets a flag again
two sums later, after every peer has finished the sum in between. A program gives up waiting
after `SPINS` polls, so that a dead peer cannot hang the GPU.

Launched with programmatic dependent launch (`pdl`), it lets the next kernel start at once: that
kernel's weight loads overlap the barrier and the sum, which is most of what an all-reduce of a
few KB costs.
"""

from __future__ import annotations

import torch

from stride.engine.kernels import pdl

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    triton = None

ADD_BLOCK = 1024  # columns per program without the norm (more programs: more reads in flight)
# Flag polls after which a program stops waiting (tens of seconds): a dead peer must not hang this
# GPU; the engine's watcher fails the engine when a worker exits (`workers`).
SPINS = 1 << 26


def blocks(cols: int) -> tuple[int, int]:
    """(block, programs per row) of a sum without the norm over rows of `cols` columns."""
    block = min(ADD_BLOCK, triton.next_power_of_2(cols))
    return block, triton.cdiv(cols, block)


def peer_sum(
    stage_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    rank: int,
    residual: torch.Tensor,
    stage_at: int,
    flag_at: int,
    norm: torch.nn.Module | None = None,
) -> torch.Tensor | None:
    """residual += the sum over ranks of their staged rows (`stage_ptrs`: each rank's staging
    buffer, `stage_at` elements in; `flag_ptrs`: each rank's flags, `flag_at` in); with `norm`,
    return norm(residual) too."""
    rows, cols = residual.shape
    if norm is not None:
        block, programs = triton.next_power_of_2(cols), 1
        out = torch.empty_like(residual)
    else:
        (block, programs), out = blocks(cols), residual
    _peer_sum_kernel[(rows, programs)](
        stage_ptrs,
        flag_ptrs,
        residual,
        norm.weight if norm is not None else residual,
        out,
        cols,
        norm.eps if norm is not None else 0.0,
        stage_at,
        flag_at,
        RANK=rank,
        WORLD=len(stage_ptrs),
        BLOCK=block,
        NORM=norm is not None,
        SPINS=SPINS,
        num_warps=4 if block <= 2048 else 8,
        **pdl.launch_options(residual.device),
    )
    return out if norm is not None else None


if triton is not None:

    @triton.jit
    def _peer_sum_kernel(
        stage_ptrs,
        flag_ptrs,
        res_ptr,
        norm_ptr,
        out_ptr,
        cols,
        eps,
        stage_at,
        flag_at,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        BLOCK: tl.constexpr,
        NORM: tl.constexpr,
        PDL: tl.constexpr,
        SPINS: tl.constexpr,
    ):
        """Columns [BLOCK * program_id(1), + BLOCK) of row program_id(0)."""
        row = tl.program_id(0)
        program = row * tl.num_programs(1) + tl.program_id(1)
        if PDL:  # the staged rows are the kernel before's output
            gdc_wait()
            gdc_launch_dependents()
        slot = flag_at + program * WORLD
        for p in tl.static_range(WORLD):  # tell every rank that our rows are staged (a store
            # that nobody waits for: the result unused, one thread sends it and goes on)
            theirs = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32)) + slot + RANK
            tl.atomic_xchg(theirs, 1, sem="release", scope="sys")
        tries = tl.full([], 0, tl.int32)
        mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32)) + slot
        for p in tl.static_range(WORLD):  # and wait until every rank has told us
            told = mine + p
            while (tl.atomic_cas(told, 1, 0, sem="acquire", scope="sys") != 1) & (tries < SPINS):
                tries += 1
        tl.debug_barrier()
        dtype = res_ptr.dtype.element_ty
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < cols
        at = row.to(tl.int64) * cols + c
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):  # in rank order: the same bits on every rank
            stage = tl.load(stage_ptrs + p).to(tl.pointer_type(dtype))
            total += tl.load(stage + stage_at + at, mask=ok, other=0.0, cache_modifier=".cg").to(
                tl.float32
            )
        x = (total.to(dtype) + tl.load(res_ptr + at, mask=ok, other=0.0)).to(dtype)
        tl.store(res_ptr + at, x, mask=ok)
        if NORM:  # as `layer._rms_norm_kernel` rounds
            xf = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / cols + eps)
            w = tl.load(norm_ptr + c, mask=ok, other=0.0)
            tl.store(out_ptr + at, (w * (xf * rstd).to(dtype)).to(dtype), mask=ok)
