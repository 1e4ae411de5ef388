"""Automatic prefix caching: the block hash chain and LRU eviction; fp32 on the CPU (and on a GPU,
through CUDA graphs), the same outputs with caching on and off over every causal decoder, n > 1,
chunked prefill, forced preemption (resuming on cached blocks) and eviction, while no step ever
writes into a sealed block and the cache's accounting matches the block tables after every step;
what clients (`usage.prompt_tokens_details.cached_tokens`) and Prometheus see."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.kv_cache import KVCache, OutOfBlocks
from stride.engine.sequence import SamplingParams, Sequence
from stride.scheduler.client import child
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig
from stride.server.app import ServerConfig
from stride.server.cli import build_parser, server_config
from tests.helpers.servers import LiveServer

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


# ---- the engine: the same outputs with caching on and off ---------------------------------------

SYSTEM = [(7 * i + 3) % 330 + 20 for i in range(50)]  # a shared "system prompt": 3 full blocks
DECODERS = [
    ("ar", {}),
    ("speculative", {"draft": "ngram", "num_speculative_tokens": 3, "adaptive": False}),
    ("speculative", {"draft": "early_exit", "num_speculative_tokens": 2, "adaptive": False,
                     "exit_layer": 1}),
    ("refine", {"method": "jacobi", "window": 4}),
    ("refine", {"method": "lookahead", "window": 4}),
]  # fmt: skip
PER_BLOCK = KVCache.bytes_per_block(2, 2, 16, 16, torch.float32)  # the tiny model's


def user(i: int, n: int = 6) -> list[int]:
    return [(31 * i + 11 * j) % 300 + 40 for j in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# On a GPU (fp32) the same runs also go through CUDA graphs: a tail after a hit replayed as
# decode rows, fused greedy bursts and their chained continuations reserving blocks ahead.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


def make_core(model_dir, caching: bool, blocks: int, device: str = "cpu", **sched) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        device=device,
        dtype="float32",
        kv_cache_memory=blocks * PER_BLOCK,
        enable_prefix_caching=caching,
    )
    return EngineCore(Engine(config), SchedulerConfig(**sched))


class Watch:
    """Checks around every step: the accounting (`audit`), and that no slot of a sealed block
    changes while it stays cached (a block evicted in the step may be rewritten)."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.cache = core, core.engine.cache
        self.evictions = 0
        self.resumed_on_cached = 0  # preempted sequences that resumed on cached blocks
        self._evicted: set[int] = set()
        evict, take = self.cache._evict, self.cache.take_prefix

        def evicting() -> int:
            block = evict()
            self._evicted.add(block)
            self.evictions += 1
            return block

        def taking(seq: Sequence, blocks: list[int]) -> None:
            self.resumed_on_cached += bool(seq.num_preemptions and blocks)
            take(seq, blocks)

        self.cache._evict, self.cache.take_prefix = evicting, taking

    def kv(self, block: int) -> torch.Tensor:
        bs = self.cache.block_size
        return torch.stack([self.cache.k[:, block * bs : (block + 1) * bs],
                            self.cache.v[:, block * bs : (block + 1) * bs]])  # fmt: skip

    def step(self):
        cache = self.cache
        before = {b: (h, self.kv(b)) for b, h in cache._hash_of.items()}  # (stack copies)
        self._evicted.clear()
        outs = self.core.step()
        for b, (h, kv) in before.items():
            if b not in self._evicted and cache._hash_of.get(b) == h:
                assert torch.equal(self.kv(b), kv), f"sealed block {b} was written"
        assert all(not s.block_table for s in self.core.scheduler.waiting)
        audit(cache, self.core.scheduler.running)
        return outs


def run(core: EngineCore, arrivals: dict[int, list[GenerateRequest]], follow_up=None):
    """Add each step's arrivals, step to the end under `Watch`; per request: (tokens, finish
    reason, cached prompt tokens). `follow_up(request, tokens)` may answer a finished request
    with a next one (a conversation's next turn), added before the next step."""
    watch = Watch(core)
    prompts = {r.request_id: r.prompt_ids for rs in arrivals.values() for r in rs}
    arrivals = {k: list(v) for k, v in arrivals.items()}
    results: dict[str, tuple[list[int], str | None, int]] = {}
    step = 0
    while arrivals or core.has_work:
        for req in arrivals.pop(step, []):
            core.add(req)
            prompts[req.request_id] = req.prompt_ids
        for out in watch.step():
            tokens, _, _ = results.get(out.request_id, ([], None, 0))
            tokens = tokens + out.token_ids
            results[out.request_id] = (tokens, out.finish_reason, out.num_cached_tokens)
            nxt = follow_up and out.finished and follow_up(out.request_id, prompts, tokens)
            if nxt:
                arrivals.setdefault(step + 1, []).append(nxt)
        step += 1
    cache = core.engine.cache
    audit(cache, [])  # nothing referenced any more, everything accounted for
    assert not any(cache._refs) and cache.num_free_blocks == cache.num_usable_blocks
    return results, watch


def mixed_workload() -> dict[int, list[GenerateRequest]]:
    first = [
        GenerateRequest(f"w1-{j}", SYSTEM + user(j), greedy(14), name, options)
        for j, (name, options) in enumerate(DECODERS)
    ]
    sampled = GenerateRequest("n3", SYSTEM + user(9), SamplingParams(max_tokens=10, seed=5))
    spec = dict(DECODERS[1][1])
    spec_sampled = GenerateRequest(
        "spec-sampled", SYSTEM + user(8), SamplingParams(max_tokens=10, seed=3), "speculative",
        spec,
    )  # fmt: skip
    second = [
        GenerateRequest(f"w2-{j}", SYSTEM + user(j), greedy(14), *DECODERS[(j + 1) % 5])
        for j in range(len(DECODERS))
    ]
    return {
        0: first + [child(sampled, f"n3-{k}", k) for k in range(3)],
        3: [spec_sampled, GenerateRequest("long", SYSTEM + user(10, 40), greedy(8))],
        8: second,
    }


def next_turn(request_id: str, prompts: dict, tokens: list[int]) -> GenerateRequest | None:
    if not request_id.startswith("w1-"):
        return None
    j = int(request_id[3:])
    return GenerateRequest(f"turn2-{j}", prompts[request_id] + tokens + user(20 + j), greedy(6),
                           *DECODERS[j])  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_decoders_n_chunked_prefill_and_preemption_match_caching_off(tiny_dir, device):
    """13 usable blocks of 16 tokens for up to 8 sequences of 60-100 tokens, a budget of 24
    tokens a step: prefills are chunked and sequences preempted, with caching on and off."""
    runs = {}
    for caching in (False, True):
        core = make_core(tiny_dir, caching, 14, device, max_num_batched_tokens=24, max_num_seqs=8)
        results, watch = run(core, mixed_workload(), next_turn)
        runs[caching] = (results, core.scheduler)
    assert watch.resumed_on_cached and watch.evictions  # resumed on cached blocks; evictions
    (off, off_sched), (on, on_sched) = runs[False], runs[True]
    assert {r: (t, f) for r, (t, f, _) in on.items()} == {r: (t, f) for r, (t, f, _) in off.items()}
    assert len(on) == 3 * len(DECODERS) + 3 + 2
    assert off_sched.num_preemptions and on_sched.num_preemptions
    assert not any(c for _, _, c in off.values()) and off_sched.prefix_cache_queries == 0
    cached = {r: c for r, (_, _, c) in on.items()}
    assert on_sched.prefix_cache_hits == sum(cached.values())
    assert sum(c > 0 for c in cached.values()) >= len(cached) // 2
    assert all(c % 16 == 0 for c in cached.values())


@pytest.mark.parametrize("device", DEVICES)
def test_n_samples_compute_their_prompt_once(tiny_dir, device):
    """Four samples of one 40-token prompt: the first computes it, the others wait a step for
    its two full blocks and compute only their last 8 tokens."""
    prompt = SYSTEM[:40]
    req = GenerateRequest("n", prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=1))
    runs = {}
    for caching in (False, True):
        core = make_core(tiny_dir, caching, 64, device)
        runs[caching] = run(core, {0: [child(req, f"n-{k}", k) for k in range(4)]})[0]
        if caching:
            assert core.scheduler.prefix_cache_queries == 4 * 40
            assert core.scheduler.prefix_cache_hits == 3 * 32
    assert [runs[True][f"n-{k}"][2] for k in range(4)] == [0, 32, 32, 32]
    assert {r: t for r, (t, _, _) in runs[True].items()} == {
        r: t for r, (t, _, _) in runs[False].items()
    }


def test_the_next_turn_reads_the_conversation_so_far(tiny_dir):
    """A conversation's next turn (the last prompt, its answer, a new message) finds every full
    block of the last turn cached, generated tokens included."""
    core = make_core(tiny_dir, True, 64)
    first = GenerateRequest("t1", SYSTEM + user(1), greedy(20))
    results, _ = run(core, {0: [first]})
    answer = results["t1"][0]
    history = first.prompt_ids + answer
    results, _ = run(core, {0: [GenerateRequest("t2", history + user(2), greedy(4))]})
    assert results["t2"][2] == 16 * ((len(history) - 1) // 16) > len(first.prompt_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_under_memory_pressure_keeps_serving(tiny_dir, device):
    """8 usable blocks for four 2-block system prompts and their users: cached prefixes are
    evicted (least recently used first) to make room, and some are found again."""
    systems = [user(100 + i, 32) for i in range(4)]
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1), (0, 2), (3, 2)]
    arrivals = {
        2 * i: [GenerateRequest(f"s{s}-u{u}", systems[s] + user(u, 5), greedy(8))]
        for i, (s, u) in enumerate(order)
    }
    runs = {}
    for caching in (False, True):
        core = make_core(tiny_dir, caching, 9, device)
        runs[caching], watch = run(core, arrivals)
        if caching:
            assert watch.evictions > 0 and core.scheduler.prefix_cache_hits > 0
    assert {r: t for r, (t, _, _) in runs[True].items()} == {
        r: t for r, (t, _, _) in runs[False].items()
    }
    assert runs[True]["s0-u1"][2] == 32 and runs[True]["s3-u2"][2] == 32


# ---- what clients and Prometheus see -----------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20)
    live = LiveServer(ServerConfig(engine=engine))
    yield live
    live.stop()


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def test_usage_and_prometheus_count_cached_tokens(server):
    """Completions and chat, streamed and not: `usage.prompt_tokens_details.cached_tokens`
    says how much of the prompt came from the cache, and Prometheus counts queries and hits in
    tokens (each sample of n > 1 on its own, as `stride_prompt_tokens_total` does)."""
    client = server.openai()
    model = client.models.list().data[0].id
    assert _counter(server.url, "stride_prefix_cache_queries_total") == 0
    engine_tokens = {"queries": 0, "hits": 0}

    def count(usage, samples: int = 1) -> int:
        cached = usage.prompt_tokens_details.cached_tokens
        assert 0 <= cached < usage.prompt_tokens and cached % 16 == 0
        engine_tokens["queries"] += samples * usage.prompt_tokens
        engine_tokens["hits"] += samples * cached
        return cached

    def complete(prompt: list[int], **kw):
        return client.completions.create(model=model, prompt=prompt, max_tokens=3, **kw)

    assert count(complete(SYSTEM + user(1)).usage) == 0
    assert count(complete(SYSTEM + user(2)).usage) == 48
    stream = complete(SYSTEM + user(3), stream=True, stream_options={"include_usage": True})
    assert count([c for c in stream][-1].usage) == 48
    assert count(complete(SYSTEM + user(4), n=3).usage, samples=3) == 48

    system = "You are a terse assistant who answers in one line. " * 4  # 140 tokens

    def chat(text: str, **kw):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        return client.chat.completions.create(model=model, messages=messages, max_tokens=3, **kw)

    assert count(chat("hi").usage) == 0
    assert count(chat("hello there").usage) >= 128
    stream = chat("good day", stream=True, stream_options={"include_usage": True})
    assert count([c for c in stream][-1].usage) >= 128

    server.wait_idle()
    assert _counter(server.url, "stride_prefix_cache_queries_total") == engine_tokens["queries"]
    assert _counter(server.url, "stride_prefix_cache_hits_total") == engine_tokens["hits"]


def test_caching_off_reports_nothing_cached(tiny_dir):
    engine = EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20,
                          enable_prefix_caching=False)  # fmt: skip
    live = LiveServer(ServerConfig(engine=engine))
    try:
        for i in range(2):
            r = live.post("/v1/completions", {"prompt": SYSTEM + user(i), "max_tokens": 2})
            assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert _counter(live.url, "stride_prefix_cache_queries_total") == 0
        assert _counter(live.url, "stride_prefix_cache_hits_total") == 0
    finally:
        live.stop()
