"""Automatic prefix caching: the block hash chain and LRU eviction, and, fp32 on the CPU, the
same outputs with caching on and off over every causal decoder, n > 1, chunked prefill, forced
preemption and eviction, while no step ever writes into a sealed block."""

from __future__ import annotations

import pytest
import torch

from stride.engine.engine import Engine, EngineConfig
from stride.engine.kv_cache import KVCache, OutOfBlocks
from stride.engine.sequence import SamplingParams, Sequence
from stride.scheduler.client import child
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig
from stride.server.cli import build_parser, server_config

BS = 4  # block size of the unit tests' caches


def small_cache(num_blocks: int = 9, prefix_caching: bool = True, model: str = "m") -> KVCache:
    return KVCache(1, 1, 2, num_blocks, BS, torch.float32, torch.device("cpu"),
                   prefix_caching=prefix_caching, model_key=model)  # fmt: skip


def seq(tokens: list[int], name: str = "s", salt: str = "") -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(), cache_salt=salt)


def computed(cache: KVCache, s: Sequence) -> Sequence:
    """`s` as if its whole prompt but the last token had been prefilled and committed."""
    cache.reserve(s, s.num_tokens)
    s.num_cached = s.num_tokens - 1
    cache.seal(s)
    return s


def admit(cache: KVCache, s: Sequence) -> int:
    """What the scheduler does first: take the cached prefix; returns the tokens it covers."""
    cache.take_prefix(s, cache.cached_prefix(s))
    return s.num_cached


def audit(cache: KVCache, holders: list[Sequence]) -> None:
    """The cache's own accounting (hashes, evictable LRU, reference counts) against the
    allocator's (free list, the block tables of the sequences that hold blocks)."""
    held: dict[int, int] = {}
    for s in holders:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    usable = set(range(1, cache.num_blocks))
    free, evictable = set(cache._free), set(cache._evictable)
    assert len(free) == len(cache._free) and not free & evictable
    assert free | evictable | set(held) == usable and not (free | evictable) & set(held)
    assert [cache._refs[b] for b in range(cache.num_blocks)] == [
        held.get(b, 0) for b in range(cache.num_blocks)
    ]
    assert cache.num_free_blocks == len(usable) - len(held)
    assert {b: h for h, b in cache._block_of.items()} == cache._hash_of
    assert evictable <= set(cache._hash_of) and not free & set(cache._hash_of)
    for s in holders:  # a shared block is sealed in every table that holds it
        bs = cache.block_size
        assert s.num_sealed <= min(s.num_cached, s.num_tokens) // bs
        for i, b in enumerate(s.block_table):
            if held[b] > 1:
                assert i < s.num_sealed, (s.request_id, i, b)


# ---- the hash chain ---------------------------------------------------------------------------


def test_block_hashes_chain_over_tokens_model_and_salt():
    cache = small_cache()
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    ha = cache.block_hashes(a, 2)
    assert len(ha) == 2 and len(set(ha)) == 2
    assert cache.block_hashes(seq([1, 2, 3, 4, 5, 6, 7, 9]), 2)[0] == ha[0]
    assert cache.block_hashes(seq([1, 2, 3, 4, 5, 6, 7, 9]), 2)[1] != ha[1]
    # The same second block after another first block: another hash (chained).
    assert cache.block_hashes(seq([0, 2, 3, 4, 5, 6, 7, 8]), 2)[1] != ha[1]
    assert cache.block_hashes(seq(a.token_ids, salt="adapter"), 2)[0] != ha[0]
    assert small_cache(model="other").block_hashes(seq(a.token_ids), 1)[0] != ha[0]
    assert a.block_hashes == ha  # memoised: the tokens are only appended to


def test_sealed_blocks_are_shared_and_ref_counted():
    cache = small_cache()
    a = computed(cache, seq(range(10), "a"))  # 9 tokens computed: blocks 0 and 1 sealed
    assert a.num_sealed == 2 and len(cache._block_of) == 2
    b, c = seq([*range(9), 50], "b"), seq([*range(8), 60, 61], "c")
    assert admit(cache, b) == 8 and b.block_table == a.block_table[:2]
    assert admit(cache, c) == 8
    assert cache._refs[a.block_table[0]] == 3
    audit(cache, [a, b, c])
    cache.free(a)
    cache.free(b)
    assert cache._refs[c.block_table[0]] == 1 and not cache._evictable  # c still holds them
    audit(cache, [c])
    cache.free(c)
    assert len(cache._evictable) == 2 and cache.num_free_blocks == cache.num_usable_blocks
    audit(cache, [])
    d = seq([*range(8), 70])  # cached blocks nobody held come back from the evictable pool
    assert admit(cache, d) == 8 and not cache._evictable
    audit(cache, [d])


def test_a_hit_leaves_the_last_token_to_compute():
    cache = small_cache()
    computed(cache, seq(range(9), "a"))  # 8 computed: two full blocks sealed
    exact = seq(range(8), "b")  # its whole prompt is cached: the last block is recomputed
    assert admit(cache, exact) == 4
    longer = seq(range(9), "c")
    assert admit(cache, longer) == 8


def test_a_second_copy_of_a_block_stays_private():
    cache = small_cache()
    a, b = seq(range(6), "a"), seq(range(6), "b")
    computed(cache, a)
    cache.reserve(b, 6)  # computed side by side, before a's blocks were sealed
    b.num_cached = 5
    cache.seal(b)
    copy = b.block_table[0]
    assert b.num_sealed == 1 and cache._block_of[b.block_hashes[0]] == a.block_table[0]
    cache.free(b)
    assert copy in cache._free  # not cached: the registered block holds the same K/V
    audit(cache, [a])


def test_eviction_is_least_recently_released_and_tails_first():
    cache = small_cache(num_blocks=7)  # 6 usable blocks
    a = computed(cache, seq(range(100, 109), "a"))  # 3 blocks, the first 2 sealed
    b = computed(cache, seq(range(200, 209), "b"))
    a_head, a_tail = a.block_table[:2]
    b_head, b_tail = b.block_table[:2]
    cache.free(a)  # released first; a table is released last block first
    cache.free(b)
    assert list(cache._evictable) == [a_tail, a_head, b_tail, b_head]
    audit(cache, [])
    c = seq(range(300, 320), "c")
    cache.reserve(c, 12)  # the 2 unregistered blocks first, then the LRU one: a's tail
    assert list(cache._evictable) == [a_head, b_tail, b_head]
    a2 = seq(range(100, 109), "a2")
    assert admit(cache, a2) == 4  # a's head is still cached, its tail is gone
    cache.reserve(c, 20)  # two more: b's chain, tail first
    assert not cache._evictable and admit(cache, seq(range(200, 209), "b2")) == 0
    audit(cache, [a2, c])
    with pytest.raises(OutOfBlocks):
        cache.reserve(c, 24)  # the one cached block left is held by a2


def test_held_blocks_are_never_evicted():
    cache = small_cache(num_blocks=5)  # 4 usable
    a = computed(cache, seq(range(9), "a"))  # 3 blocks, the first 2 sealed
    b = seq([*range(8), 99], "b")
    assert admit(cache, b) == 8
    with pytest.raises(OutOfBlocks):
        cache.reserve(b, 9 + 2 * BS)  # 3 more: 1 is free, the cached ones are all held
    cache.free(a)
    cache.reserve(b, 9 + BS)  # a's private block and the free one
    assert [cache._refs[x] for x in b.block_table] == [1, 1, 1, 1]
    assert b.block_hashes[0] in cache._block_of and b.block_hashes[1] in cache._block_of
    audit(cache, [b])


def test_caching_off_shares_nothing():
    cache = small_cache(prefix_caching=False)
    a = computed(cache, seq(range(10), "a"))
    assert a.num_sealed == 0 and not cache._block_of
    cache.free(a)
    assert cache.cached_prefix(seq(range(10))) == [] and not cache._evictable


def test_the_flag_and_its_variable(monkeypatch):
    def caching(*flags: str) -> bool:
        args = build_parser().parse_args(["serve", *flags])  # reads STRIDE_* when built
        return server_config(args).engine.enable_prefix_caching

    assert caching() and not caching("--no-enable-prefix-caching")
    monkeypatch.setenv("STRIDE_ENABLE_PREFIX_CACHING", "0")
    assert not caching() and caching("--enable-prefix-caching")
