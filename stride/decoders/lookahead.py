"""Lookahead decoding: Jacobi iteration plus n-gram guesses verified in the same forward pass.

Beside its Jacobi window, a sequence keeps a pool of n-grams harvested from its own text (prompt
and output) and from the Jacobi trajectory (a guess followed by what the model predicted after
it). Candidates that start after the current last token are appended to the proposal as branches:
each branch sits at the same positions as the window, and a custom attention mask lets it see the
context and its own earlier tokens only. The longest path greedy decoding agrees with wins.

KV slots are laid out contiguously after the cached tokens whatever the positions say, so when a
branch wins only the part it shares with the window keeps its KV; the rest of its tokens are
committed and fed again as the next tail.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from stride.decoders import grammar
from stride.decoders.base import (
    Commit,
    Proposal,
    Scored,
    StepContext,
    causal_mask,
    parse_options,
)
from stride.decoders.catalog import LOOKAHEAD
from stride.decoders.jacobi import (
    Jacobi,
    JacobiOptions,
    JacobiState,
    Verdict,
    check_greedy,
    verify,
)
from stride.engine.sequence import SamplingParams, Sequence


class LookaheadOptions(JacobiOptions):
    ngram: int | None = Field(None, ge=2, le=16, description="length of the n-grams guessed")
    candidates: int | None = Field(None, ge=0, le=32, description="n-grams verified per pass")


class NgramPool:
    """n-grams by first token, most recent first, at most `per_key` continuations a key."""

    def __init__(self, n: int, per_key: int) -> None:
        self.n = n
        self.per_key = per_key
        self._pool: dict[int, list[tuple[int, ...]]] = defaultdict(list)

    def add(self, key: int, continuation: list[int] | tuple[int, ...]) -> None:
        cont = tuple(continuation)
        bucket = self._pool[key]
        if cont in bucket:
            bucket.remove(cont)
        bucket.insert(0, cont)
        del bucket[self.per_key :]

    def add_text(self, tokens: list[int]) -> None:
        """Every n-gram of `tokens` (all of them must be known text, not guesses)."""
        for i in range(len(tokens) - self.n + 1):
            self.add(tokens[i], tokens[i + 1 : i + self.n])

    def lookup(self, key: int) -> list[tuple[int, ...]]:
        return list(self._pool.get(key, ()))


@dataclass
class LookaheadState(JacobiState):
    pool: NgramPool | None = None
    harvested: int = 0  # token_ids before this index are in the pool already
    candidates: list[tuple[int, ...]] = field(default_factory=list)


class Lookahead(Jacobi):
    """Jacobi window (`window`) plus up to `candidates` n-grams of length `ngram` a pass."""

    name = LOOKAHEAD
    default_window = 6
    default_ngram = 4
    default_candidates = 4

    options_model = LookaheadOptions

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        check_greedy(params, self.name)
        opts = parse_options(LookaheadOptions, options, "refine method 'lookahead'")
        return {
            "window": self.default_window if opts.window is None else opts.window,
            "ngram": self.default_ngram if opts.ngram is None else opts.ngram,
            "candidates": self.default_candidates if opts.candidates is None else opts.candidates,
            "adaptive": not options,
        }

    def state(self, seq: Sequence) -> LookaheadState:
        if seq.decoder_state is None:
            opts = seq.decoder_options
            n, g = opts.get("ngram", self.default_ngram), opts.get("candidates", 0)
            seq.decoder_state = LookaheadState(pool=NgramPool(n, max(2 * g, 1)))
        return seq.decoder_state

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        st = self.state(seq)
        st.pool.add_text(seq.token_ids[max(st.harvested - st.pool.n + 1, 0) :])
        st.harvested = seq.num_tokens
        size = super().extra_tokens(seq, cap)
        st.candidates = []
        if self.plain(seq):  # (the pool still learns the text: see above)
            return 0
        window = self.window(seq)
        room = cap - size
        for cand in st.pool.lookup(seq.token_ids[-1]):
            if len(st.candidates) == seq.decoder_options.get("candidates", 0):
                break
            cand = cand[:room]  # a prefix of a candidate is a candidate too
            cand = cand[: grammar.valid_prefix(seq.grammar, list(cand))]
            if cand and list(cand) != window[: len(cand)]:
                st.candidates.append(cand)
                room -= len(cand)
        return size + sum(len(c) for c in st.candidates)

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        return [self.plain_proposal() if self.plain(s) else self._proposal(s) for s in seqs]

    def _proposal(self, seq: Sequence) -> Proposal:
        st = self.state(seq)
        window = self.window(seq)
        if not st.candidates:
            return Proposal(window)
        base, t = seq.num_tokens, len(seq.tail)
        tokens, positions = list(window), [base + i for i in range(len(window))]
        n = t + len(window) + sum(len(c) for c in st.candidates)
        mask = causal_mask(n)
        for cand in st.candidates:
            start = t + len(tokens)
            mask[start : start + len(cand), t:start] = False  # a branch sees no other guesses
            tokens.extend(cand)
            positions.extend(base + j for j in range(len(cand)))
        return Proposal(tokens, positions, mask)

    def _paths(self, seq: Sequence) -> list[list[int]]:
        st = self.state(seq)
        paths, start = [list(range(st.size))], st.size
        for cand in st.candidates:
            paths.append(list(range(start, start + len(cand))))
            start += len(cand)
        return paths

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        scored: Scored,
        ctx: StepContext,
    ) -> list[Commit]:
        if scored.tokens is not None:
            return self.commit_plain(scored, ctx)
        paths = [self._paths(s) for s in seqs]
        verdicts, lps = verify(seqs, proposals, paths, scored.logits, ctx)
        commits = []
        for seq, prop, v, lp in zip(seqs, proposals, verdicts, lps, strict=True):
            self._harvest(seq, prop, v)
            self.refine(seq, prop, v)
            commits.append(Commit(v.tokens, lp, kv_keep=self._contiguous(seq, prop, v)))
        self.measure(seqs, proposals, commits, ctx)
        return commits

    def _contiguous(self, seq: Sequence, prop: Proposal, v: Verdict) -> int:
        """Accepted tokens whose KV is valid: a prefix the winning path shares with the window."""
        if v.path == 0:
            return v.accepted
        window = prop.tokens[: self.state(seq).size]
        keep = 0
        for token, guess in zip(v.tokens[: v.accepted], window, strict=False):
            if token != guess:
                break
            keep += 1
        return keep

    def _harvest(self, seq: Sequence, prop: Proposal, v: Verdict) -> None:
        """Pool each window guess with the predictions that followed it (the Jacobi trajectory)."""
        st = self.state(seq)
        n, size = st.pool.n, st.size
        for r in range(1, size - n + 3):
            st.pool.add(prop.tokens[r - 1], v.preds[r : r + n - 1])
