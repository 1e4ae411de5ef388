"""Paged KV cache with automatic prefix caching: blocks handed out through per-sequence block
tables, and full blocks kept, under the hash of what they hold, for whoever starts the same way.

Keys and values live in two flat tensors of slots (`num_blocks * block_size` slots per layer), so
a forward pass writes with one index_copy per layer and reads a sequence's context through a
gather of its slots. Growing, rolling back, sharing and freeing only move block ids around.

Prefix caching (vLLM's automatic prefix caching). A block is *sealed* once all of its slots hold
committed K/V (its positions all lie below its sequence's `num_cached`, see `seal`). Its hash is
chained over every token up to its end, from a root that names the model and the sequence's
`cache_salt` (an adapter, say: whatever else changes K/V), so equal hashes mean equal contents.
The first block sealed under a hash is registered under it. Blocks are ref-counted: a sequence
being admitted takes the registered blocks of its longest cached prefix (`cached_prefix`,
`take_prefix`) and computes only the rest. A registered block that nobody holds keeps its K/V
and its hash; it is free to be reused, but reuse takes never-registered blocks first, then evicts
the least recently released registered one. A sequence releases its blocks last-first, so the
tail of a chain goes before its head (a chain is only usable from its start).

Ownership rules (block-aligned, so nothing is ever copied on write):
1. A sealed block is immutable: no slot of it is written again, in any layer, by anyone.
2. A sequence writes K/V only at positions >= its `num_cached`. Only sealed blocks are shared,
   and they lie wholly below `num_cached`, so every write lands in a block its writer holds
   alone. Everything that writes ahead and takes it back stays there: speculative drafts and
   their rollback (`kv_keep`), refine windows and branches, early-exit drafting, fused bursts
   and their chained continuations, and `trim`, which gives back blocks past `num_cached`.
3. `num_cached` never drops below a sequence's committed tokens while it holds its blocks (a
   rollback undoes writes past them; early-exit drafting moves it ahead and back within a step);
   only `free` (finish, abort, preemption) resets it, and the sequence's blocks with it.
4. A hit is whole blocks and leaves at least the sequence's last token to compute, so after a
   hit `num_cached` is block-aligned and the first write opens a block of the sequence's own.
   (A fully cached prompt recomputes its last block rather than write into a shared one.)
A cache of another model that shares these block tables (a draft head's own KV) follows the
same rules, and two more. A hash vouches for the target's K/V only: the writer of a block may
never have run that other model (an `ar` request), so a sequence that took cached blocks must
track for itself which of that cache's slots hold values, as the draft model's cursor does in
`decoders.drafters`. And its values in a shared block must be a function of the tokens the hash
covers: K/V at position t that depend on token t + 1 break that at the last slot of a block
(that token is in the next block, which sharers need not have), so such a cache must keep that
slot's value out of shared blocks (recompute it privately).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

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
        prefix_caching: bool = True,
        model_key: str = "",
    ) -> None:
        """`model_key` names whatever makes this cache's K/V what they are (model, dtype): the
        root of every block hash."""
        if num_blocks < 2:
            raise ValueError("the KV cache budget is too small for even two blocks")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._root = hashlib.sha256(model_key.encode()).digest()
        self._refs = [0] * num_blocks  # how many block tables hold each block
        # Block 0 is never handed out: padded gathers point at it, so it must stay harmless.
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # held by none, unregistered
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none; LRU
        self._block_of: dict[bytes, int] = {}  # hash -> the registered block
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: never used, emptied, or cached and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """The share of blocks that sequences hold (cached blocks nobody holds count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # ---- growing and shrinking a sequence's table --------------------------------------------

    def reserve(self, seq: Sequence, num_slots: int) -> None:
        """Grow `seq`'s block table to cover `num_slots` slots, or raise OutOfBlocks."""
        if num_slots <= len(seq.block_table) * self.block_size:
            return  # most steps: no block boundary crossed
        need = -(-num_slots // self.block_size) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            block = self._free.pop() if self._free else self._evict()
            self._refs[block] = 1
            seq.block_table.append(block)

    def trim(self, seq: Sequence) -> None:
        """Give back blocks beyond what `seq.num_cached` needs (after a rollback), or, while
        launches in flight sample its pending tokens, beyond the K/V they write (up to the
        last pending token's predecessor)."""
        used = len(seq.token_ids) - 1 + seq.pending if seq.pending else seq.num_cached
        keep = -(-used // self.block_size)
        table = seq.block_table
        if len(table) > keep:
            for block in reversed(table[keep:]):
                self._release(block)
            del table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks, last first; the sealed ones stay cached."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table.clear()
        seq.num_cached = 0
        seq.num_sealed = 0

    def move(self, seq: Sequence, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of positions `src` to positions `dst` (every layer); all
        sources are read before any destination is written."""
        bs, table = self.block_size, seq.block_table
        frm = [table[p // bs] * bs + p % bs for p in src]
        self.copy_slots(frm, [table[p // bs] * bs + p % bs for p in dst])

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of flat slots `src` to slots `dst` (every layer)."""
        frm = torch.tensor(src, device=self.k.device)
        to = torch.tensor(dst, device=self.k.device)
        self.k[:, to] = self.k[:, frm]
        self.v[:, to] = self.v[:, frm]

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat slot ids of positions [start, end) of `seq`'s cache."""
        bs, table = self.block_size, seq.block_table
        if end - start == 1:
            return [table[start // bs] * bs + start % bs]
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    # ---- prefix caching -----------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes of `seq`'s first `num_blocks` full blocks of tokens (memoised on `seq`:
        its tokens are only ever appended to)."""
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            tokens = seq.token_ids
            parent = hashes[-1] if hashes else self._salted_root(seq)
            for i in range(len(hashes), num_blocks):
                block = array("i", tokens[i * bs : (i + 1) * bs]).tobytes()
                parent = hashlib.sha256(parent + block).digest()
                hashes.append(parent)
        return hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks of `seq`'s longest cached prefix, leaving its last token out
        (the next forward must score it). Takes nothing: see `take_prefix`."""
        if not self.prefix_caching:
            return []
        most = (seq.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        if most == 0 or not self._block_of:
            return blocks
        for h in self.block_hashes(seq, most):
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Start `seq` (holding no blocks) on cached `blocks`: their K/V count as computed."""
        assert not seq.block_table
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table.extend(blocks)
        seq.num_cached = len(blocks) * self.block_size
        seq.num_sealed = len(blocks)

    def seal(self, seq: Sequence) -> None:
        """Register the blocks that `seq`'s committed K/V now fill (call after every commit).

        A hash registered already keeps its block; this copy stays private to `seq`."""
        bs = self.block_size
        if seq.num_cached < (seq.num_sealed + 1) * bs or not self.prefix_caching:
            return  # most commits fill no block
        full = min(seq.num_cached, seq.num_tokens, len(seq.block_table) * bs) // bs
        if full <= seq.num_sealed:
            return
        hashes = self.block_hashes(seq, full)
        for i in range(seq.num_sealed, full):
            h, block = hashes[i], seq.block_table[i]
            if h not in self._block_of:
                self._block_of[h] = block
                self._hash_of[block] = h
        seq.num_sealed = full

    def _salted_root(self, seq: Sequence) -> bytes:
        if not seq.cache_salt:
            return self._root
        return hashlib.sha256(self._root + seq.cache_salt.encode()).digest()

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None  # the most recently released: evicted last
            else:
                self._free.append(block)

    def _evict(self) -> int:
        """The least recently released cached block, unregistered for reuse."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block
