"""Paged KV cache: fixed-size blocks handed out to sequences through per-sequence block tables.

Keys and values live in two flat tensors of slots (`num_blocks * block_size` slots per layer), so
a forward pass writes with one index_copy per layer and reads a sequence's context through a
gather of its slots. Growing, rolling back and freeing a sequence only moves block ids around.
"""

from __future__ import annotations

import torch

from stride.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    """Raised when the cache cannot hold a sequence's next tokens; the scheduler preempts."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache budget is too small for even two blocks")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Block 0 is never handed out: padded gathers point at it, so it must stay harmless.
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        """Extra blocks `seq` needs so that it can hold `num_slots` slots."""
        want = -(-num_slots // self.block_size)
        return max(0, want - len(seq.block_table))

    def reserve(self, seq: Sequence, num_slots: int) -> None:
        """Grow `seq`'s block table to cover `num_slots` slots, or raise OutOfBlocks."""
        if num_slots <= len(seq.block_table) * self.block_size:
            return  # most steps: no block boundary crossed
        need = self.blocks_needed(seq, num_slots)
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            seq.block_table.append(self._free.pop())

    def trim(self, seq: Sequence) -> None:
        """Return blocks beyond what `seq.num_cached` needs (after a rollback)."""
        keep = -(-seq.num_cached // self.block_size)
        table = seq.block_table
        if len(table) > keep:
            self._free.extend(reversed(table[keep:]))
            del table[keep:]

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table.clear()
        seq.num_cached = 0

    def move(self, seq: Sequence, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of positions `src` to positions `dst` (every layer); all
        sources are read before any destination is written."""
        bs, table = self.block_size, seq.block_table
        device = self.k.device
        frm = torch.tensor([table[p // bs] * bs + p % bs for p in src], device=device)
        to = torch.tensor([table[p // bs] * bs + p % bs for p in dst], device=device)
        self.k[:, to] = self.k[:, frm]
        self.v[:, to] = self.v[:, frm]

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat slot ids of positions [start, end) of `seq`'s cache."""
        bs, table = self.block_size, seq.block_table
        if end - start == 1:
            return [table[start // bs] * bs + start % bs]
        return [table[i // bs] * bs + i % bs for i in range(start, end)]
