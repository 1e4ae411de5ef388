"""A batch's draws, and their logprobs where rows ask for them, in two Triton kernels.

As plain tensor ops a sampled draw (`sampling.device_sample`) is 20 to 60 kernels (torch's
multi-block top-k alone is about 40), each reading or writing a [rows, vocab] array: at one row
their launches set its cost, at 256 rows their memory traffic does. Here each row's logits are
read once, a chunk per program, by `_chunk_kernel`, which keeps what the row needs of its chunk:
its `TOP` largest logits (top-k, top-p, min-p and logprobs pick among those), its best
logit / T + Gumbel noise (a draw over the whole row), and its log-sum-exp terms (logprobs).
`_row_kernel`, a program per row, merges a row's chunks, draws, and takes the logprobs.

A row with a top-p or min-p and no top-k keeps every token above some point of its order, which
may lie past its `TOP` candidates (a flat row keeps thousands). Its candidates are weighed
against its whole row's mass (each chunk's sum of exp(logit / T - max)); where all of them are
kept, its draw over the whole row stands if that token is kept, and else the draw is the best
among the tokens above it: `_beyond` walks the row once per such refused draw, never sorting it.

The arithmetic is the plain ops' (`sampling.ops_sample`): IEEE division by the temperature,
`counter`'s hash and Gumbel transform (bit for bit), softmax and the mass before each candidate
in rank order for top-p, and the first of equal values for an argmax. The sums (softmax,
cumulative mass) may round differently, which can move a top-p boundary that falls within a
rounding error of `top_p`; which of several tokens tied at a top-k boundary stay is torch's own
choice there, the lower ids here. A row's draw depends only on its own logits, settings and
key, never on the rows beside it.
"""

from __future__ import annotations

import os

import torch

from stride.decoders import counter

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None

TOP_MAX = 64  # the largest top-k drawn here (a batch's k_max above it takes the plain ops)
LOGPROBS_MAX = 32  # the most alternatives `logprobs` takes (the API allows 20)
CHUNK = 2048  # logits per `_chunk_kernel` program


def available(where: torch.Tensor | torch.device) -> bool:
    """Can these kernels run on this tensor's (this) device? On the GPU, where Triton is."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return triton is not None and device.type == "cuda"


def draw(
    logits: torch.Tensor,
    floats: torch.Tensor,
    keys: torch.Tensor,
    top: bool,
    whole: bool,
    top_p: bool,
) -> torch.Tensor:
    """Each row's token [B] (int64): greedy rows their argmax, sampled rows argmax(logits / T
    + Gumbel noise) over what they keep. `floats` [B, 5]: `DrawSettings.floats`; `keys` [B, 1]:
    the rows' keys for this draw. `top`: the rows' TOP_MAX best are their candidates (every
    top-k is at most TOP_MAX); `whole`: some sampled row has no top-k, and draws over its whole
    row (with `top` too: over the part of it that its top-p and min-p keep); `top_p`: whether
    some row has one (a row's min-p, -inf without one, is applied wherever there are candidates).
    One compiled variant per flags whatever the k: `warm` compiles them."""
    return _launch(logits, floats, keys, top, whole, top_p, None)[0]


def draw_scored(
    logits: torch.Tensor,
    floats: torch.Tensor,
    keys: torch.Tensor,
    top: bool,
    whole: bool,
    top_p: bool,
    n: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`draw`, and in the same pass the drawn tokens' logprobs under log-softmax(logits): each
    row's [B], and its `n` (<= LOGPROBS_MAX) most likely tokens' [B, n] with their ids [B, n]
    (int64), most likely first."""
    return _launch(logits, floats, keys, top, whole, top_p, n)


def _launch(
    logits: torch.Tensor,
    floats: torch.Tensor,
    keys: torch.Tensor,
    top: bool,
    whole: bool,
    top_p: bool,
    n: int | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Both kernels, with their buffers; `n` None: no logprobs (empty tensors in their place)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    width = TOP_MAX if top else (0 if n is None else LOGPROBS_MAX)
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    top_part = torch.empty(rows, chunks, max(width, 1), dtype=torch.int64, device=device)
    sums = torch.empty(5, rows, chunks, dtype=torch.float32, device=device)
    best, peak, mass, scaled_peak, scaled_mass = sums.unbind()
    at = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    chosen = torch.empty(rows, dtype=torch.float32, device=device)
    vals = torch.empty(rows, n or 0, dtype=torch.float32, device=device)
    ids = torch.empty(rows, n or 0, dtype=torch.int64, device=device)
    common = dict(WHOLE=whole, TOP=width, CANDIDATES=top, LOGPROBS=n is not None,
                  MIX0=counter.MIX[0], MIX1=counter.MIX[1], SALT=counter.TOKEN)  # fmt: skip
    args = (logits, logits.stride(0), floats, floats.stride(0), keys, keys.stride(0), vocab,
            top_part, best, at, peak, mass, scaled_peak, scaled_mass)  # fmt: skip
    _chunk_kernel[(rows, chunks)](*args, CHUNK=CHUNK, num_warps=4, **common)
    # One program per row merges its chunks and, where top-p refuses a draw, walks the whole
    # row alone: sixteen warps walk it four times as wide (and at one stream that walk is the
    # draw's critical path).
    _row_kernel[(rows,)](*args, chunks, tokens, chosen, vals, ids, n or 0,
                         CHUNKS=triton.next_power_of_2(chunks), CHUNK=CHUNK, TOP_P=top_p,
                         num_warps=16, **common)  # fmt: skip
    return tokens, (chosen, vals, ids)


def warm(device: torch.device, vocab: int) -> None:
    """Compile every variant of the kernels now (Triton compiles a variant on its first launch,
    and keeps it on disk for later processes), so that no request waits for a compiler."""
    logits = torch.zeros(1, vocab, device=device)
    floats = torch.tensor([[1.0, 0.5, 0.0, 0.0, 1.0]], device=device)
    keys = torch.zeros(1, 1, dtype=torch.int64, device=device)
    flags = [(True, whole, top_p) for whole in (False, True) for top_p in (False, True)]
    for route in [(False, True, False), *flags]:
        draw(logits, floats, keys, *route)
        draw_scored(logits, floats, keys, *route, 1)


if triton is not None:
    _LOWEST = tl.constexpr(-0x7FFFFFFFFFFFFFFF)  # below every packed (logit, id) key

    if os.environ.get("TRITON_INTERPRET") == "1":  # (no libdevice there: the tests' CPU runs)

        @triton.jit
        def _log(x):
            return tl.log(x)

        @triton.jit
        def _exp(x):
            return tl.exp(x)

    else:  # CUDA's logf and expf, as torch's kernels call them (tl.exp is an approximation)

        @triton.jit
        def _log(x):
            return libdevice.log(x)

        @triton.jit
        def _exp(x):
            return libdevice.exp(x)

    @triton.jit
    def _mix32(x, MIX0: tl.constexpr, MIX1: tl.constexpr):
        """`counter.mix32` on uint32 (whose products wrap as `& MASK` does)."""
        x = x ^ (x >> 15)
        x = x * MIX0
        x = x ^ (x >> 12)
        x = x * MIX1
        return x ^ (x >> 15)

    @triton.jit
    def _gumbel(key, ids, MIX0: tl.constexpr, MIX1: tl.constexpr, SALT: tl.constexpr):
        """`counter.gumbel` for one row's `key` (uint32) and token `ids`."""
        code = _mix32(_mix32(ids.to(tl.uint32), MIX0, MIX1) ^ SALT, MIX0, MIX1)
        unit = ((_mix32(key ^ code, MIX0, MIX1) >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        return -_log(-_log(unit))

    @triton.jit
    def _pack(x, ids, vocab):
        """(logit, id) as one int64 that orders as the logit, then the lower id first."""
        bits = x.to(tl.int32, bitcast=True)
        order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (order.to(tl.int64) << 32) | (vocab - 1 - ids).to(tl.int64)

    @triton.jit
    def _unpack(packed, vocab):
        order = (packed >> 32).to(tl.int32)
        bits = tl.where(order < 0, order ^ 0x7FFFFFFF, order)
        return bits.to(tl.float32, bitcast=True), vocab - 1 - (packed & 0xFFFFFFFF).to(tl.int32)

    @triton.jit
    def _chunk_kernel(
        logits, logits_stride, floats, floats_stride, keys, keys_stride, vocab,
        top_out, best_out, at_out, peak_out, mass_out, scaled_peak_out, scaled_mass_out,
        CHUNK: tl.constexpr, TOP: tl.constexpr, WHOLE: tl.constexpr, CANDIDATES: tl.constexpr,
        LOGPROBS: tl.constexpr, MIX0: tl.constexpr, MIX1: tl.constexpr, SALT: tl.constexpr,
    ):  # fmt: skip
        """One (row, chunk): its TOP best logits as packed keys; with WHOLE its best draw
        value and where (a greedy row's: the raw logit), and with CANDIDATES too the max of
        logit / T and the sum of exp(logit / T - max) (a whole row's mass, for top-p); with
        LOGPROBS its max logit and sum of exp(logit - max)."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        chunks = tl.num_programs(1)
        ids = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = ids < vocab
        x = tl.load(logits + row.to(tl.int64) * logits_stride + ids, mask=inside,
                    other=-float("inf"))  # fmt: skip
        x = x.to(tl.float32)
        here = row * chunks + chunk
        if TOP > 0:
            packed = tl.where(inside, _pack(x, ids, vocab), _LOWEST)
            tl.store(top_out + here * TOP + tl.arange(0, TOP), tl.topk(packed, TOP))
        if WHOLE:
            temperature = tl.load(floats + row * floats_stride)
            greedy = tl.load(floats + row * floats_stride + 3) > 0
            key = tl.load(keys + row * keys_stride).to(tl.uint32)
            noise = _gumbel(key, ids, MIX0, MIX1, SALT)
            scaled = tl.div_rn(x, tl.zeros_like(x) + temperature)
            value = tl.where(inside, tl.where(greedy, x, scaled + noise), -float("inf"))
            best = tl.max(value, 0)
            tl.store(best_out + here, best)
            tl.store(at_out + here, tl.min(tl.where(value == best, ids, vocab), 0))
            if CANDIDATES:
                scaled_peak = tl.max(scaled, 0)
                tl.store(scaled_peak_out + here, scaled_peak)
                shift = tl.where(scaled_peak == -float("inf"), 0.0, scaled_peak)
                tl.store(scaled_mass_out + here, tl.sum(_exp(scaled - shift), 0))
        if LOGPROBS:
            peak = tl.max(x, 0)
            tl.store(peak_out + here, peak)
            shift = tl.where(peak == -float("inf"), 0.0, peak)  # (a chunk all masked: mass 0)
            tl.store(mass_out + here, tl.sum(_exp(x - shift), 0))

    @triton.jit
    def _beyond(
        logits, vocab, token, last, temperature, key, peak, total, top_p, floor,
        CHUNK: tl.constexpr, TOP_P: tl.constexpr,
        MIX0: tl.constexpr, MIX1: tl.constexpr, SALT: tl.constexpr,
    ):  # fmt: skip
        """The draw over what a row keeps where that may go past its candidates (whose lowest
        packed key is `last`), from `token`, its draw over the whole row. What top-p and min-p
        keep is every token above some key, so while the drawn token is not kept, the draw is
        among the tokens above it: the best of those is drawn next, one pass over the row
        each, which also sums the mass above the token drawn. A token among the candidates is
        kept (all of them are)."""
        x = tl.load(logits + token).to(tl.float32)
        mark = _pack(x, token, vocab)
        done = (mark >= last).to(tl.int32)
        while done == 0:
            above = 0.0
            next_best = -float("inf")
            next_at = vocab
            start = 0
            while start < vocab:  # (a `for` over a runtime range fails in the interpreter)
                ids = start + tl.arange(0, CHUNK)
                inside = ids < vocab
                xs = tl.load(logits + ids, mask=inside, other=-float("inf")).to(tl.float32)
                scaled = tl.div_rn(xs, tl.zeros_like(xs) + temperature)
                higher = inside & (_pack(xs, ids, vocab) > mark)
                if TOP_P:
                    above += tl.sum(tl.where(higher, _exp(scaled - peak), 0.0), 0)
                value = tl.where(higher, scaled + _gumbel(key, ids, MIX0, MIX1, SALT),
                                 -float("inf"))  # fmt: skip
                best = tl.max(value, 0)
                at = tl.min(tl.where(value == best, ids, vocab), 0)
                next_at = tl.where(best > next_best, at, next_at)
                next_best = tl.maximum(best, next_best)
                start += CHUNK
            kept = tl.div_rn(x, temperature) >= floor
            if TOP_P:
                kept = kept & (tl.div_rn(above, total) < top_p)
            if kept:
                done = 1
            else:
                token = next_at
                x = tl.load(logits + token).to(tl.float32)
                mark = _pack(x, token, vocab)
                done = (mark >= last).to(tl.int32)
        return token

    @triton.jit
    def _row_kernel(
        logits, logits_stride, floats, floats_stride, keys, keys_stride, vocab,
        top_in, best_in, at_in, peak_in, mass_in, scaled_peak_in, scaled_mass_in,
        chunks, tokens, chosen_out, vals_out, ids_out, n,
        CHUNKS: tl.constexpr, CHUNK: tl.constexpr, TOP: tl.constexpr, WHOLE: tl.constexpr,
        CANDIDATES: tl.constexpr, TOP_P: tl.constexpr, LOGPROBS: tl.constexpr,
        MIX0: tl.constexpr, MIX1: tl.constexpr, SALT: tl.constexpr,
    ):  # fmt: skip
        """One row: merge its chunks into its token; with LOGPROBS, the token's logprob and the
        `n` best. With CANDIDATES the draw is among the TOP best; with WHOLE too, a row without
        a top-k whose candidates are all kept draws past them (`_beyond`)."""
        row = tl.program_id(0)
        lane = tl.arange(0, CHUNKS)
        mine = lane < chunks
        if TOP > 0:
            place = tl.arange(0, CHUNKS * TOP)
            packed = tl.load(top_in + row * chunks * TOP + place, mask=place < chunks * TOP,
                             other=_LOWEST)  # fmt: skip
            packed = tl.topk(packed, TOP)
            raw, ids = _unpack(packed, vocab)  # largest first
            rank = tl.arange(0, TOP)
        if WHOLE:
            best = tl.load(best_in + row * chunks + lane, mask=mine, other=-float("inf"))
            at = tl.load(at_in + row * chunks + lane, mask=mine, other=vocab)
            token = tl.min(tl.where(best == tl.max(best, 0), at, vocab), 0)
        if CANDIDATES:
            temperature = tl.load(floats + row * floats_stride)
            greedy = tl.load(floats + row * floats_stride + 3) > 0
            top_k = tl.load(floats + row * floats_stride + 4)
            key = tl.load(keys + row * keys_stride).to(tl.uint32)
            scaled = tl.div_rn(raw, tl.zeros_like(raw) + temperature)
            keep = (rank.to(tl.float32) < top_k) & (rank < vocab)
            peak = tl.max(tl.where(rank == 0, scaled, -float("inf")), 0)  # (the most likely)
            total = 1.0
            if TOP_P:
                kept = tl.where(keep, scaled, -float("inf"))
                e = _exp(kept - peak)
                total = tl.sum(e, 0)
                if WHOLE:  # a row without a top-k: the whole row's mass
                    peaks = tl.load(scaled_peak_in + row * chunks + lane, mask=mine,
                                    other=-float("inf"))  # fmt: skip
                    masses = tl.load(scaled_mass_in + row * chunks + lane, mask=mine, other=0.0)
                    whole_mass = tl.sum(masses * _exp(peaks - peak), 0)
                    total = tl.where(top_k > TOP, whole_mass, total)
                p = tl.div_rn(e, tl.zeros_like(e) + total)
                keep = keep & (tl.cumsum(p, 0) - p < tl.load(floats + row * floats_stride + 1))
            floor = peak + tl.load(floats + row * floats_stride + 2)  # (min-p; -inf without)
            keep = keep & (scaled >= floor)
            value = tl.where(keep, scaled, -float("inf")) + _gumbel(key, ids, MIX0, MIX1, SALT)
            pick = tl.min(tl.where(value == tl.max(value, 0), rank, TOP), 0)
            picked = tl.max(tl.where(rank == pick, ids, -1), 0)
            if WHOLE:
                # Every candidate kept and no top-k: what it keeps may go on past them.
                beyond = (top_k > TOP) & (tl.sum(keep.to(tl.int32), 0) == TOP)
                if beyond & ~greedy:
                    picked = _beyond(logits + row.to(tl.int64) * logits_stride, vocab, token,
                                     tl.min(packed, 0), temperature, key, peak, total,
                                     tl.load(floats + row * floats_stride + 1), floor,
                                     CHUNK, TOP_P, MIX0, MIX1, SALT)  # fmt: skip
            token = tl.where(greedy, tl.max(tl.where(rank == 0, ids, -1), 0), picked)
        tl.store(tokens + row, token.to(tl.int64))
        if LOGPROBS:
            peak = tl.load(peak_in + row * chunks + lane, mask=mine, other=-float("inf"))
            mass = tl.load(mass_in + row * chunks + lane, mask=mine, other=0.0)
            top = tl.max(peak, 0)
            log_sum = _log(tl.sum(mass * _exp(peak - top), 0))
            x = tl.load(logits + row.to(tl.int64) * logits_stride + token).to(tl.float32)
            tl.store(chosen_out + row, x - top - log_sum)
            tl.store(vals_out + row * n + rank, raw - top - log_sum, mask=rank < n)
            tl.store(ids_out + row * n + rank, ids.to(tl.int64), mask=rank < n)
