"""Who runs this step: queues, budgets, chunked prefill and preemption.

Running sequences go first (in priority, then arrival order): each takes its uncached tail plus
whatever its decoder wants to add, under two budgets, sequences and query tokens. Waiting
sequences then fill what is left, their prompts chunked to fit. When the KV cache cannot hold a
running sequence's next tokens, the latest arrival is preempted: its blocks are freed and it
goes back to the waiting queue, to be recomputed from its tokens later.

With prefix caching, a waiting sequence is admitted on the cached blocks of its longest cached
prefix (its own, after a preemption, if they were not evicted meanwhile) and schedules only the
rest. One whose next block a running prefill is computing right now waits for it instead of
computing it too: the n samples of one prompt, and requests that arrive together with one
system prompt, compute the shared blocks once. It waits only while that prefill advances.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

from stride.engine.kv_cache import KVCache, OutOfBlocks
from stride.engine.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    # Decode steps one engine step may run back to back for a small all-greedy batch (see
    # `EngineCore._fused_steps`); None: 8 with CUDA graphs, else 1 (off).
    fused_decode_steps: int | None = None


@dataclass
class Plan:
    """A step's work, and the sequences scheduling it preempted (back in the waiting queue)."""

    items: list[Scheduled]
    preempted: list[Sequence]


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    num_tail: int  # how many tail tokens are scored this step
    extra: int  # tokens the decoder adds after the tail (only when the whole tail fits)
    completes_tail: bool  # the whole uncached tail is scored this step
    fed: bool = False  # its tail is its last pending token, fed on the device


class Decoders(Protocol):
    """What scheduling asks of the decoders (`decoder_set.DecoderSet`)."""

    def extra_tokens(self, seq: Sequence, cap: int) -> int: ...

    def preempted(self, seq: Sequence) -> None: ...


def _order(seq: Sequence) -> tuple[int, float]:
    return (seq.priority, seq.arrival_time)


def _remove(seqs: list[Sequence], seq: Sequence) -> bool:
    """Remove `seq` by identity (`list.remove` would compare dataclass fields of every other)."""
    for i, s in enumerate(seqs):
        if s is seq:
            del seqs[i]
            return True
    return False


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCache, max_model_len: int) -> None:
        self.config = config
        self.cache = cache
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []  # sorted by (priority, arrival)
        self._fed: dict[str, Scheduled] = {}  # each pending sequence's fed row
        self.num_preemptions = 0  # since start
        # First admissions since start: prompt tokens looked up, and found, in the prefix cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort_right(self.waiting, seq, key=_order)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out and free its KV at once."""
        self._fed.pop(seq.request_id, None)
        if not _remove(self.running, seq):
            _remove(self.waiting, seq)
        self.cache.free(seq)
        seq.status = Status.FINISHED

    def schedule(self, decoders: Decoders, admit: bool = True) -> Plan:
        """Pick this step's work; `decoders` says what each sequence's decoder adds; waiting
        sequences join only if `admit`.

        A sequence with pending tokens (a launch still in flight samples them) runs as a fed
        row: one plain step from its last pending token, as its decoder promised. It is never
        preempted (the launch in flight writes its blocks); where its row does not fit, it sits
        this step out. Tokens in flight after one its grammar refused are not pending but void
        (`Sequence.void`): the sequence is scheduled from its committed tokens meanwhile, and may
        be preempted, since the void launch's K/V writes come first in stream order, into slots
        that nothing reads before writing them again."""
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        block_size = self.cache.block_size
        plan: list[Scheduled] = []
        preempted: list[Sequence] = []

        queue = [s for s in self.running if not s.pending]  # victims come from its end
        for seq in self.running if len(queue) < len(self.running) else ():
            if not seq.pending or budget <= 0 or len(plan) >= max_seqs:
                continue
            # Its fed row, unless its pending tokens end it (max_tokens, the context) or the
            # row's K/V slot (the last of those tokens') cannot be had.
            made = len(seq.token_ids) + seq.pending
            if made - len(seq.prompt_ids) >= seq.params.max_tokens or made >= self.max_model_len:
                continue
            if made > len(seq.block_table) * block_size and not self._reserve(seq, made):
                continue
            item = self._fed.get(seq.request_id)  # (the same item, step after step)
            if item is None or item.seq is not seq:
                item = self._fed[seq.request_id] = Scheduled(seq, 1, 0, True, fed=True)
            plan.append(item)
            budget -= 1
        i, end = 0, len(queue)
        while i < end and budget > 0 and len(plan) < max_seqs:
            seq = queue[i]
            i += 1
            item: Scheduled | None = self._fit(seq, budget, decoders)
            while not self._try_reserve(item):
                if end > i:
                    end -= 1
                    victim = queue[end]
                else:
                    victim = seq
                self._preempt(victim, decoders)
                preempted.append(victim)
                if victim is seq:
                    item = None
                    break
            if item is not None:
                plan.append(item)
                budget -= item.num_tail + item.extra

        pending: set[bytes] | None = None  # blocks that running prefills compute, when needed
        i = 0
        while admit and i < len(self.waiting) and budget > 0 and len(plan) < max_seqs:
            seq = self.waiting[i]
            caching = self.cache.prefix_caching and not seq.wants_prompt_rows
            if caching:
                cached = self.cache.cached_prefix(seq)
                next_block = self._next_block(seq, len(cached))
                if next_block is not None:
                    if pending is None:  # (sequences admitted above are running already)
                        pending = {h for s in self.running for h in self._computing(s)}
                    if next_block in pending:  # computed right now: wait for it
                        i += 1
                        continue
                self.cache.take_prefix(seq, cached)
            item = self._fit(seq, budget, decoders)
            if not self._try_reserve(item):
                self.cache.free(seq)  # the cached prefix it took stays cached
                break
            del self.waiting[i]
            seq.status = Status.RUNNING
            bisect.insort_right(self.running, seq, key=_order)
            plan.append(item)
            budget -= item.num_tail + item.extra
            if pending is not None:
                pending.update(self._computing(seq))
            if caching and seq.num_preemptions == 0:  # its first admission
                seq.cached_prompt_tokens = seq.num_cached
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += seq.num_cached
        return Plan(plan, preempted)

    def _reserve(self, seq: Sequence, slots: int) -> bool:
        try:
            self.cache.reserve(seq, slots)
        except OutOfBlocks:
            return False
        return True

    def _fit(self, seq: Sequence, budget: int, decoders: Decoders) -> Scheduled:
        num_tokens = len(seq.token_ids)
        tail = num_tokens - seq.num_cached
        if tail > budget:
            return Scheduled(seq, budget, 0, False)
        cap = min(
            budget - tail,
            seq.params.max_tokens - (num_tokens - len(seq.prompt_ids)) - 1,
            self.max_model_len - num_tokens - 1,
        )
        cap = max(cap, 0)
        return Scheduled(seq, tail, min(cap, decoders.extra_tokens(seq, cap)), True)

    def _try_reserve(self, item: Scheduled) -> bool:
        return self._reserve(item.seq, item.seq.num_cached + item.num_tail + item.extra)

    def _preempt(self, seq: Sequence, decoders: Decoders) -> None:
        _remove(self.running, seq)
        self.cache.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        decoders.preempted(seq)
        self.enqueue(seq)

    def _next_block(self, seq: Sequence, num_cached_blocks: int) -> bytes | None:
        """The hash of the block after `seq`'s cached prefix, if a hit could cover it."""
        if num_cached_blocks >= (seq.num_tokens - 1) // self.cache.block_size:
            return None
        return self.cache.block_hashes(seq, num_cached_blocks + 1)[-1]

    def _computing(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks that a running sequence is prefilling and not sealed yet."""
        if seq.num_tokens - seq.num_cached <= 1:  # decoding: nothing to share soon
            return []
        full = seq.num_tokens // self.cache.block_size
        return self.cache.block_hashes(seq, full)[seq.num_sealed :]
