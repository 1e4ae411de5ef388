"""One forward pass of the target model over everything the scheduler picked this step.

Each `Chunk` is one sequence's share of the ragged batch: the tokens to score (its uncached tail,
or a prefix of it during chunked prefill, then whatever its decoder proposed), their positions,
an optional mask among them, and how many trailing rows need logits. Keys and values of every
scored token are written to the slots right after the sequence's cached ones; the decoder's
commit decides how many of them stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stride.engine.attention import AttentionMetadata
from stride.engine.kv_cache import KVCache
from stride.engine.model import CausalLM
from stride.engine.sequence import Sequence


@dataclass
class Chunk:
    seq: Sequence
    token_ids: list[int]
    num_logits: int  # logits for the last `num_logits` tokens (0 = none, mid-prefill)
    positions: list[int] | None = None  # default: num_cached, num_cached + 1, ...
    mask: torch.Tensor | None = None  # [n, n] bool among this chunk's tokens; default causal


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], num_layers: int | None = None) -> list[torch.Tensor]:
        """Score all chunks in one pass; returns each chunk's [num_logits, vocab] fp32 logits."""
        meta, tokens, positions, rows = self._prepare(chunks)
        hidden = self.model(tokens, positions, (self.cache.k, self.cache.v), meta, num_layers)
        logits = self.model.logits(hidden[rows])
        return list(logits.split([c.num_logits for c in chunks]))

    def _prepare(self, chunks: list[Chunk]):
        cache, bs = self.cache, self.cache.block_size
        n_q = [len(c.token_ids) for c in chunks]
        starts = [c.seq.num_cached for c in chunks]
        n_ctx = [s + n for s, n in zip(starts, n_q)]
        b, q_max, l_max = len(chunks), max(n_q), max(n_ctx)

        tokens, positions, slots, rows = [], [], [], []
        offset = 0
        for c, start, n in zip(chunks, starts, n_q):
            tokens.extend(c.token_ids)
            positions.extend(c.positions or range(start, start + n))
            slots.extend(cache.slots(c.seq, start, start + n))
            rows.extend(range(offset + n - c.num_logits, offset + n))
            offset += n

        n_blocks = -(-l_max // bs)
        table = torch.zeros(b, n_blocks, dtype=torch.long)
        for i, c in enumerate(chunks):
            used = c.seq.block_table[: -(-n_ctx[i] // bs)]
            table[i, : len(used)] = torch.tensor(used, dtype=torch.long)
        kv_slots = (table[:, :, None] * bs + torch.arange(bs)).view(b, -1)[:, :l_max]

        n_q_t = torch.tensor(n_q)
        starts_t = torch.tensor(starts)
        q_pos = torch.arange(q_max)
        q_valid = q_pos[None, :] < n_q_t[:, None]
        first_token = torch.cumsum(n_q_t, 0) - n_q_t
        q_index = torch.where(q_valid, first_token[:, None] + q_pos[None, :], 0)

        # Causal by default: query i of a chunk sees cached slots and chunk tokens up to itself.
        k_pos = torch.arange(l_max)
        limit = starts_t[:, None] + q_pos[None, :]  # [B, Q]
        mask = k_pos[None, None, :] <= limit[:, :, None]
        for i, c in enumerate(chunks):
            if c.mask is not None:
                s, n = starts[i], n_q[i]
                mask[i, :n, s : s + n] = c.mask
        mask[~q_valid] = False
        mask[~q_valid, 0] = True  # padded rows must see something, or SDPA returns NaN

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            q_index=q_index.to(dev, non_blocking=True),
            q_valid=q_valid.to(dev, non_blocking=True),
            kv_slots=kv_slots.to(dev, non_blocking=True),
            mask=mask[:, None].to(dev, non_blocking=True),
        )
        return (
            meta,
            torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
        )
