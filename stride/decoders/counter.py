"""A counter-based random generator: every uniform is a pure function of (seed, stream,
position, token id), so no generator state travels with a sequence.

A sample then depends only on the request's seed and the place of the token being drawn, never
on what else shares the batch, on whether the draw ran on the host or on the device, or on how
many draws came before it: a seeded request is reproducible whatever the batch, the path or
the burst. Streams keep draws at one position independent of each other (the target's sample,
a drafter's, the rejection rule's uniform).

The hash is integer arithmetic on values below 2^32 held in int64 (products stay below 2^62,
so nothing overflows): numpy arrays on the host (per-row keys, built with a launch) and torch
tensors on any device (per-token uniforms) run the same code and give bit-identical results.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

MASK = 0xFFFFFFFF
TARGET, DRAFT, ACCEPT = range(3)  # streams: the token kept, a drafter's guess, a rejection test
_GOLDEN = 0x9E3779B9  # spreads stream ids apart (none of them zero) before they are hashed
TOKEN = 0x5BD1E995  # what token ids are mixed with, so that token codes and keys differ
MIX = (0x2C1B3C6D, 0x297A2D39)  # `mix32`'s multipliers (the Triton draws hash with them too)

Ints = TypeVar("Ints", np.ndarray, torch.Tensor)


def mix32(x: Ints) -> Ints:
    """A 32-bit integer hash (Wellons' `prospector32`: two xorshift-multiply rounds whose
    multipliers are below 2^31), for int64 arrays or tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 15)
    x = (x * MIX[0]) & MASK
    x = x ^ (x >> 12)
    x = (x * MIX[1]) & MASK
    return x ^ (x >> 15)


def bases(seeds: Sequence[int], stream: int = TARGET) -> np.ndarray:
    """What rows with `seeds` (each in [0, 2^64)) key their draws in `stream` from, whatever
    the position: [rows] int64."""
    words = np.array(seeds, dtype=np.uint64)
    lo, hi = (words & MASK).astype(np.int64), (words >> 32).astype(np.int64)
    return mix32(mix32(hi ^ (((stream + 1) * _GOLDEN) & MASK)) ^ lo)


def keys_at(bases: Ints, positions: Ints) -> Ints:
    """Row keys (int64, below 2^32) for draws at `positions` (int64, [..., rows]: each row's
    position in its sequence, broadcast against the rows' `bases`): numpy arrays on the host,
    or tensors where the positions are only known on the device (the speculation loop)."""
    return mix32(bases ^ (positions & MASK))


def keys(seeds: Sequence[int], positions: np.ndarray, stream: int = TARGET) -> np.ndarray:
    """Row keys for draws at `positions` by rows with `seeds` in `stream` (see `keys_at`)."""
    return keys_at(bases(seeds, stream), np.asarray(positions, dtype=np.int64))


def unit(x: torch.Tensor) -> torch.Tensor:
    """Hashes (below 2^32) as float32 uniforms in (0, 1): the top 23 bits and a half, scaled,
    so exactly representable: at least 2^-24, at most 1 - 2^-24, never 0 or 1."""
    return ((x >> 9).to(torch.float32) + 0.5) * 2.0**-23


@functools.lru_cache(maxsize=8)
def _token_codes(vocab: int, device: torch.device) -> torch.Tensor:
    """Each token id hashed, by another function than keys are (a key and a token code must
    not cancel out along a pattern of positions and ids): [vocab] int64."""
    return mix32(mix32(torch.arange(vocab, dtype=torch.int64, device=device)) ^ TOKEN)


def uniforms(keys: torch.Tensor, tokens: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """float32 uniforms for rows `keys` ([B, 1] int64) and `tokens` ([B, C] int64 ids below
    `vocab`), or, with `tokens` None, for every token id below `vocab` ([B, vocab])."""
    codes = _token_codes(vocab, keys.device)
    codes = codes[None, :] if tokens is None else codes[tokens]
    return unit(mix32(keys ^ codes))


def gumbel(keys: torch.Tensor, tokens: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise per (row, token): argmax(log p + noise) draws exactly from p."""
    return uniforms(keys, tokens, vocab).log_().neg_().log_().neg_()


def pick(
    probs: torch.Tensor, keys: torch.Tensor, tokens: torch.Tensor | None = None, vocab: int = 0
) -> torch.Tensor:
    """Each row's draw from `probs` [B, C] with its key (`keys` [B] int64): the column that
    argmax(log p + `gumbel` noise) picks, over every token id (C the vocabulary) or over the
    ids `tokens` [B, C] below `vocab`."""
    noise = gumbel(keys[:, None], tokens, vocab if tokens is not None else probs.shape[-1])
    return (probs.log() + noise).argmax(-1)
