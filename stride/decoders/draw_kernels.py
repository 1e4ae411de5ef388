"""A batch's draws, and their logprobs where rows ask for them, in two Triton kernels.

As plain tensor ops a sampled draw (`sampling.device_sample`) is 20 to 60 kernels (torch's
multi-block top-k alone is about 40), each reading or writing a [rows, vocab] array: at one row
their launches set its cost, at 256 rows their memory traffic does. Here each row's logits are
read once, a chunk per program, by `_chunk_kernel`, which keeps what the row needs of its chunk:
its `TOP` largest logits (top-k, top-p, min-p and logprobs pick among those), its best
logit / T + Gumbel noise (a draw over the whole row), and its log-sum-exp terms (logprobs).
`_row_kernel`, a program per row, merges a row's chunks, draws, and takes the logprobs.

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
    top_p: bool,
    min_p: bool,
) -> torch.Tensor:
    """Each row's token [B] (int64): greedy rows their argmax, sampled rows argmax(logits / T
    + Gumbel noise) over what they keep. `floats` [B, 5]: `DrawSettings.floats`; `keys` [B, 1]:
    the rows' keys for this draw. `top`: every sampled row has a top-k of at most TOP_MAX (the
    candidates are the row's TOP_MAX best), and `top_p`, `min_p` say whether some row has one;
    else no row truncates (no top-k, top-p or min-p) and the draw is over the whole row. One
    compiled variant per (`top`, `top_p`, `min_p`) whatever the k: `warm` compiles them."""
    return _launch(logits, floats, keys, top, top_p, min_p, None)[0]


def draw_scored(
    logits: torch.Tensor,
    floats: torch.Tensor,
    keys: torch.Tensor,
    top: bool,
    top_p: bool,
    min_p: bool,
    n: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`draw`, and in the same pass the drawn tokens' logprobs under log-softmax(logits): each
    row's [B], and its `n` (<= LOGPROBS_MAX) most likely tokens' [B, n] with their ids [B, n]
    (int64), most likely first."""
    return _launch(logits, floats, keys, top, top_p, min_p, n)


def _launch(
    logits: torch.Tensor,
    floats: torch.Tensor,
    keys: torch.Tensor,
    top: bool,
    top_p: bool,
    min_p: bool,
    n: int | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Both kernels, with their buffers; `n` None: no logprobs (empty tensors in their place)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    width = TOP_MAX if top else (0 if n is None else LOGPROBS_MAX)
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    top_part = torch.empty(rows, chunks, max(width, 1), dtype=torch.int64, device=device)
    best, peak, mass = torch.empty(3, rows, chunks, dtype=torch.float32, device=device).unbind()
    at = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    chosen = torch.empty(rows, dtype=torch.float32, device=device)
    vals = torch.empty(rows, n or 0, dtype=torch.float32, device=device)
    ids = torch.empty(rows, n or 0, dtype=torch.int64, device=device)
    common = dict(WHOLE=not top, TOP=width, LOGPROBS=n is not None, MIX0=counter.MIX[0],
                  MIX1=counter.MIX[1], SALT=counter.TOKEN, num_warps=4)  # fmt: skip
    args = (logits, logits.stride(0), floats, floats.stride(0), keys, keys.stride(0), vocab,
            top_part, best, at, peak, mass)  # fmt: skip
    _chunk_kernel[(rows, chunks)](*args, CHUNK=CHUNK, **common)
    _row_kernel[(rows,)](*args, chunks, tokens, chosen, vals, ids, n or 0,
                         CHUNKS=triton.next_power_of_2(chunks), TOP_P=top_p, MIN_P=min_p,
                         **common)  # fmt: skip
    return tokens, (chosen, vals, ids)


def warm(device: torch.device, vocab: int) -> None:
    """Compile every variant of the kernels now (Triton compiles a variant on its first launch,
    and keeps it on disk for later processes), so that no request waits for a compiler."""
    logits = torch.zeros(1, vocab, device=device)
    floats = torch.tensor([[1.0, 0.5, 0.0, 0.0, 1.0]], device=device)
    keys = torch.zeros(1, 1, dtype=torch.int64, device=device)
    tops = [(True, top_p, min_p) for top_p in (False, True) for min_p in (False, True)]
    for top, top_p, min_p in [(False, False, False), *tops]:
        draw(logits, floats, keys, top, top_p, min_p)
        draw_scored(logits, floats, keys, top, top_p, min_p, 1)


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
        top_out, best_out, at_out, peak_out, mass_out,
        CHUNK: tl.constexpr, TOP: tl.constexpr, WHOLE: tl.constexpr, LOGPROBS: tl.constexpr,
        MIX0: tl.constexpr, MIX1: tl.constexpr, SALT: tl.constexpr,
    ):  # fmt: skip
        """One (row, chunk): its TOP best logits as packed keys; with WHOLE its best draw
        value and where (a greedy row's: the raw logit); with LOGPROBS its max logit and sum of
        exp(logit - max)."""
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
            noisy = tl.div_rn(x, tl.zeros_like(x) + temperature) + noise
            value = tl.where(inside, tl.where(greedy, x, noisy), -float("inf"))
            best = tl.max(value, 0)
            tl.store(best_out + here, best)
            tl.store(at_out + here, tl.min(tl.where(value == best, ids, vocab), 0))
        if LOGPROBS:
            peak = tl.max(x, 0)
            tl.store(peak_out + here, peak)
            shift = tl.where(peak == -float("inf"), 0.0, peak)  # (a chunk all masked: mass 0)
            tl.store(mass_out + here, tl.sum(_exp(x - shift), 0))

    @triton.jit
    def _row_kernel(
        logits, logits_stride, floats, floats_stride, keys, keys_stride, vocab,
        top_in, best_in, at_in, peak_in, mass_in,
        chunks, tokens, chosen_out, vals_out, ids_out, n,
        CHUNKS: tl.constexpr, TOP: tl.constexpr, WHOLE: tl.constexpr, TOP_P: tl.constexpr,
        MIN_P: tl.constexpr, LOGPROBS: tl.constexpr,
        MIX0: tl.constexpr, MIX1: tl.constexpr, SALT: tl.constexpr,
    ):  # fmt: skip
        """One row: merge its chunks into its token; with LOGPROBS, the token's logprob and the
        `n` best."""
        row = tl.program_id(0)
        lane = tl.arange(0, CHUNKS)
        mine = lane < chunks
        if TOP > 0:
            place = tl.arange(0, CHUNKS * TOP)
            packed = tl.load(top_in + row * chunks * TOP + place, mask=place < chunks * TOP,
                             other=_LOWEST)  # fmt: skip
            raw, ids = _unpack(tl.topk(packed, TOP), vocab)  # largest first
            rank = tl.arange(0, TOP)
        if WHOLE:
            best = tl.load(best_in + row * chunks + lane, mask=mine, other=-float("inf"))
            at = tl.load(at_in + row * chunks + lane, mask=mine, other=vocab)
            token = tl.min(tl.where(best == tl.max(best, 0), at, vocab), 0)
        else:
            temperature = tl.load(floats + row * floats_stride)
            greedy = tl.load(floats + row * floats_stride + 3) > 0
            top_k = tl.load(floats + row * floats_stride + 4)
            key = tl.load(keys + row * keys_stride).to(tl.uint32)
            scaled = tl.div_rn(raw, tl.zeros_like(raw) + temperature)
            keep = (rank.to(tl.float32) < top_k) & (rank < vocab)
            if TOP_P:
                kept = tl.where(keep, scaled, -float("inf"))
                e = _exp(kept - tl.max(kept, 0))
                p = tl.div_rn(e, tl.zeros_like(e) + tl.sum(e, 0))
                keep = keep & (tl.cumsum(p, 0) - p < tl.load(floats + row * floats_stride + 1))
            if MIN_P:
                floor = tl.max(scaled, 0) + tl.load(floats + row * floats_stride + 2)
                keep = keep & (scaled >= floor)
            value = tl.where(keep, scaled, -float("inf")) + _gumbel(key, ids, MIX0, MIX1, SALT)
            pick = tl.min(tl.where(value == tl.max(value, 0), rank, TOP), 0)
            token = tl.where(greedy, tl.max(tl.where(rank == 0, ids, -1), 0),
                             tl.max(tl.where(rank == pick, ids, -1), 0))  # fmt: skip
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
