"""Drafters for speculative decoding: guess the next tokens of many sequences at once, cheaply.

A drafter turns `(sequence, k)` pairs into `Draft`s: up to k tokens that should follow the
sequence's last token, plus the distribution `q` each was drawn from (None for deterministic
drafters, which the verifier treats as one-hot). Model drafters run one batched forward per draft
position for all their sequences, and draw with the request's own logit adjustments, temperature
and top-k/top-p, so that `q` is comparable with the target's `p`.

- `NgramDrafter`: prompt lookup, copies what followed the latest earlier occurrence of the
  sequence's last n tokens. No model, no state.
- `EarlyExitDrafter`: the target's first L layers, its final norm and its head. It shares the
  target's KV cache: for committed tokens, layers < L hold exactly the keys and values the early
  exit would compute, and the slots it writes for draft tokens lie after the cached ones, inside
  the blocks the scheduler reserved for this step, where the target's verification forward
  overwrites them (every layer, every scored token). Nothing needs rolling back.
- `DraftModelDrafter`: a separate small causal LM with the same tokenizer and its own KV cache
  (as many blocks as the target's, so it can never run out first). It keeps a per-sequence cursor
  of how many of the sequence's tokens it has cached, catches up on whatever was committed since
  (in the same batched forward as the first draft position) and rolls back to the accepted prefix
  after verification.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from stride.decoders import counter, sampling
from stride.decoders.catalog import EARLY_EXIT, NGRAM
from stride.engine import loader
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.kv_cache import KVCache, OutOfBlocks
from stride.engine.sequence import Sequence
from stride.engine.spans import Span


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), vocab] draw distributions; None: one-hot


_TOKEN_BYTES = array("i").itemsize


class Drafter:
    name: str = ""
    cost: float = 0.0  # one draft position for a batch, relative to one target forward

    def admit(self, seq: Sequence) -> None:
        """A sequence that this drafter will draft for was admitted (before its first pass)."""

    def available(self, seq: Sequence, k: int) -> int:
        """How many of k drafts this drafter can offer `seq` now (prompt lookup may find none)."""
        return k

    def draft(self, seqs: list[Sequence], ks: list[int], eos_ids: set[int]) -> list[Draft]:
        raise NotImplementedError

    def accepted(self, seq: Sequence, num_accepted: int, path: list[int] | None = None) -> None:
        """Verification kept `num_accepted` of the sequence's last draft (`path`: which of a
        tree's nodes, in order; default the first ones): roll back the rest."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: free whatever the drafter holds for it."""


class NgramDrafter(Drafter):
    """Prompt lookup: the longest suffix n-gram (n ≤ max_n) seen before predicts what follows."""

    name = NGRAM

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def available(self, seq: Sequence, k: int) -> int:
        return len(self.lookup(seq.token_ids, k)) if k else 0

    def draft(self, seqs: list[Sequence], ks: list[int], eos_ids: set[int]) -> list[Draft]:
        return [
            Draft(self.lookup(s.token_ids, k) if k else []) for s, k in zip(seqs, ks, strict=True)
        ]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix n-gram."""
        n_tok = len(tokens)
        data = array("i", tokens).tobytes()  # byte search runs in C; matches must be aligned
        width = _TOKEN_BYTES
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = data[(n_tok - n) * width :]
            end = (n_tok - 1) * width  # the occurrence must end before the last token
            while (at := data.rfind(pattern, 0, end)) >= 0:
                if at % width == 0:
                    start = at // width + n
                    return tokens[start : start + k]
                end = at + len(pattern) - 1
        return []


def _draw(
    logits: torch.Tensor, rows: list[sampling.Row], eos_ids: set[int], vocab: int
) -> tuple[list[int], torch.Tensor]:
    """Draw one token per row with the rows' own sampling rules; returns tokens and q rows."""
    adjusted = sampling.adjust(logits, rows, eos_ids)
    if any(r.seq.grammar is not None for r in rows):
        # A draft vocabulary (EAGLE's) may hold none of the tokens a grammar allows: such a
        # row drafts uniformly (its draft is then cut) rather than from no distribution at all.
        dead = torch.isneginf(adjusted).all(-1, keepdim=True)
        adjusted = torch.where(dead, 0.0, adjusted)
    q = sampling.probabilities(adjusted, rows)
    if q.shape[-1] != vocab:  # a draft head wider than the target's vocabulary
        q = q[:, :vocab] / q[:, :vocab].sum(-1, keepdim=True)
    return sampling.draw(q, rows, counter.DRAFT), q


def run_drafts(
    seqs: list[Sequence],
    ks: list[int],
    first_feeds: list[list[int]],
    forward,
    eos_ids: set[int],
    vocab: int,
) -> list[Draft]:
    """The shared draft loop: position 0 scores `first_feeds`, later positions the last draft.

    `forward(index_list, token_lists)` scores one span per listed sequence (sequence i at its
    i-th draft position) and returns one logits row each.
    """
    tokens: list[list[int]] = [[] for _ in seqs]
    qs: list[list[torch.Tensor]] = [[] for _ in seqs]
    # Every drafting row plain greedy (and so at every position): each draw is the argmax, its
    # q one-hot, which a Draft without q stands for; no distribution is made.
    greedy = all(sampling.plain_greedy(sampling.Row(s)) for s, k in zip(seqs, ks, strict=True) if k)
    for pos in range(max(ks, default=0)):
        live = [i for i, k in enumerate(ks) if k > pos]
        feed = [first_feeds[i] if pos == 0 else [tokens[i][-1]] for i in live]
        logits = forward(pos, live, feed)
        if greedy:
            drawn = logits[:, :vocab].argmax(-1).tolist()  # (a drafter's vocabulary may be wider)
        else:
            rows = [sampling.Row(seqs[i], pending=list(tokens[i])) for i in live]
            drawn, q = _draw(logits, rows, eos_ids, vocab)
            for j, i in enumerate(live):
                qs[i].append(q[j])
        for j, i in enumerate(live):
            tokens[i].append(drawn[j])
    return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs, strict=True)]


class EarlyExitDrafter(Drafter):
    """The target's first `num_layers` layers as the drafter, over the target's own KV cache."""

    name = EARLY_EXIT

    def __init__(self, engine: Engine, num_layers: int) -> None:
        total = engine.model.num_layers
        if not 1 <= num_layers <= total:
            raise ValueError(f"early exit needs 1..{total} layers, got {num_layers}")
        self.engine, self.num_layers = engine, num_layers
        self.cost = num_layers / total

    def draft(self, seqs: list[Sequence], ks: list[int], eos_ids: set[int]) -> list[Draft]:
        cached = [s.num_cached for s in seqs]
        tails = [s.tail for s in seqs]

        def forward(pos: int, live: list[int], feed: list[list[int]]) -> torch.Tensor:
            # Draft position `pos` of sequence i sits at cached + len(tail) + pos - 1; the
            # runner writes a span after `num_cached`, so move the cursor there for the call.
            for i in live:
                seqs[i].num_cached = cached[i] + (len(tails[i]) + pos - 1 if pos else 0)
            spans = [Span(seqs[i], f, 1) for i, f in zip(live, feed, strict=True)]
            return torch.cat(self.engine.runner.forward(spans, num_layers=self.num_layers))

        try:
            return run_drafts(seqs, ks, tails, forward, eos_ids, self.engine.hf_config.vocab_size)
        finally:
            for s, c in zip(seqs, cached, strict=True):
                s.num_cached = c


@dataclass
class _DraftCursor:
    kv: Sequence  # the draft cache's view of the sequence: num_cached and block_table only
    base: int = 0  # the sequence's length when it was last drafted


class DraftModelDrafter(Drafter):
    """A separate causal LM with the target's tokenizer, with its own paged KV cache."""

    def __init__(self, target: Engine, model: str) -> None:
        # As many blocks as the target's: whatever the target can hold, the draft can too.
        config = AutoConfig.from_pretrained(loader.resolve(model))
        heads = config.num_attention_heads
        per_block = KVCache.bytes_per_block(
            config.num_hidden_layers,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
            target.cache.block_size,
            target.dtype,
        )
        engine = Engine(
            EngineConfig(
                model=model,
                device=str(target.device),
                dtype=str(target.dtype).removeprefix("torch."),
                kv_cache_memory=per_block * target.cache.num_blocks,
                block_size=target.cache.block_size,
                max_model_len=target.max_model_len,
            )
        )
        if engine.hf_config.vocab_size < target.hf_config.vocab_size:
            raise ValueError(
                f"draft model {model!r} has a smaller vocabulary "
                f"({engine.hf_config.vocab_size}) than the target ({target.hf_config.vocab_size})"
            )
        self.engine = engine
        self.name = model
        self.target_vocab = target.hf_config.vocab_size
        self.cost = engine.num_params / target.num_params
        self.cursors: dict[str, _DraftCursor] = {}  # by request id: what it has cached

    def _cursor(self, seq: Sequence) -> _DraftCursor:
        cur = self.cursors.get(seq.request_id)
        if cur is None:
            cur = _DraftCursor(Sequence(seq.request_id, [], seq.params))
            self.cursors[seq.request_id] = cur
        return cur

    def draft(self, seqs: list[Sequence], ks: list[int], eos_ids: set[int]) -> list[Draft]:
        cache = self.engine.cache
        ks = list(ks)
        cursors = [self._cursor(s) for s in seqs]
        for i, (s, cur, k) in enumerate(zip(seqs, cursors, ks, strict=True)):
            cur.base = s.num_tokens
            if k:
                try:  # the drafted tokens but the last get KV here
                    cache.reserve(cur.kv, s.num_tokens + k - 1)
                except OutOfBlocks:
                    ks[i] = 0
        catch_up = [s.token_ids[c.kv.num_cached :] for s, c in zip(seqs, cursors, strict=True)]

        def forward(pos: int, live: list[int], feed: list[list[int]]) -> torch.Tensor:
            spans = [Span(cursors[i].kv, f, 1) for i, f in zip(live, feed, strict=True)]
            logits = torch.cat(self.engine.runner.forward(spans))
            for i, f in zip(live, feed, strict=True):
                cursors[i].kv.num_cached += len(f)
            return logits

        drafts = run_drafts(seqs, ks, catch_up, forward, eos_ids, self.target_vocab)
        for cur in cursors:
            cache.trim(cur.kv)  # blocks reserved but not written (a sequence that drafted 0)
        return drafts

    def accepted(self, seq: Sequence, num_accepted: int, path: list[int] | None = None) -> None:
        cur = self.cursors.get(seq.request_id)
        if cur is None:
            return
        cur.kv.num_cached = min(cur.kv.num_cached, cur.base + num_accepted)
        self.engine.cache.trim(cur.kv)

    def release(self, seq: Sequence) -> None:
        cur = self.cursors.pop(seq.request_id, None)
        if cur is not None:
            self.engine.cache.free(cur.kv)
