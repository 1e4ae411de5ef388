"""Introspective strided decoding: one causal forward verifies the last pass's guesses and makes
the next ones at MASK slots (I-DLM), losslessly.

A pass scores, for a sequence, its tail, the m proposals the previous pass made, and MASK slots
(`engine.adapter`): a set of k slots after every real row that could end the accepted prefix, so
that whatever the verification keeps, the next proposals were made from it (a tree under an
attention mask, like a draft tree; k slots when there is nothing to verify):

    rows       tail… d1 … dm | set 0: M … M | set 1: M … M | … | set m: M … M
    set a      sees the tail and d1..da, sits at the positions after da, and guesses the
               tokens after the one real row a predicts (the bonus token: slot j of set a, at
               position p(da) + j, predicts the token at p(da) + j + 1)

Real rows run the base model untouched (the slots come after them and the adapter acts on the
slots' rows only), so their logits are AR's: greedy requests accept proposals while they equal
the argmax, sampled ones by the speculative rejection rule (`speculative.verify`) with q the
distributions the proposals were drawn from, the slots' of the previous pass. Then the real row
after the accepted prefix gives one more token, and the slot set after that row gives the next
proposals. Slots' KV is never kept: the accepted proposals' rows lie right after the tail.

A request with default options is adaptive, as Jacobi's are: it makes passes only while they
pay on this hardware and at this batch size (`payoff`), and takes plain steps otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field

from stride.decoders import counter, sampling
from stride.decoders.base import (
    Commit,
    Decoder,
    Options,
    Proposal,
    Scored,
    StepContext,
    causal_mask,
    parse_options,
)
from stride.decoders.catalog import INTROSPECTIVE
from stride.decoders.payoff import Adaptive, Payoff
from stride.decoders.speculative.drafters import Draft
from stride.decoders.speculative.tree import Tree
from stride.decoders.speculative.verify import verify_greedy, verify_sampled
from stride.engine.adapter import MASK_TOKEN, MaskAdapter
from stride.engine.sequence import SamplingParams, Sequence

MAX_SLOTS = 16


class IntrospectiveOptions(Options):
    slots: int | None = Field(
        None, ge=1, le=MAX_SLOTS, description="introspective: MASK slots per set (k)"
    )


@dataclass
class IntrospectiveState:
    proposals: list[int] = field(default_factory=list)  # guesses for the tokens after the tail
    q: torch.Tensor | None = None  # [len(proposals), vocab]: what they were drawn from (sampled)
    drafts: int = 0  # proposals scored this step
    slots: int = 0  # slots per set this step


class Introspective(Adaptive, Decoder):
    """MASK-slot proposals verified by the next pass; needs a `MaskAdapter` for the model."""

    name = INTROSPECTIVE
    options_model = IntrospectiveOptions

    def __init__(self, adapter: MaskAdapter) -> None:
        self.adapter = adapter
        # (adaptive requests have the adapter's slots: a pass commits at most those proposals
        # and the token after them)
        self.payoff = Payoff(most=adapter.config.slots + 1)

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        slots = parse_options(IntrospectiveOptions, options, "refine method 'introspective'").slots
        slots = self.adapter.config.slots if slots is None else slots
        return {"slots": slots, "adaptive": not options}  # default options: see `payoff`

    def state(self, seq: Sequence) -> IntrospectiveState:
        if seq.decoder_state is None:
            seq.decoder_state = IntrospectiveState()
        return seq.decoder_state

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        """m proposals and m + 1 sets of k slots; under a tighter `cap` (a request's last tokens,
        a full step) the proposals first, which pay now, then as many slots as fit."""
        st = self.state(seq)
        if self.plain(seq):  # (proposals from before the plain steps are stale)
            st.proposals, st.q, st.drafts, st.slots = [], None, 0, 0
            return 0
        st.drafts = min(len(st.proposals), cap)
        st.slots = min(seq.decoder_options["slots"], (cap - st.drafts) // (st.drafts + 1))
        return st.drafts + (st.drafts + 1) * st.slots

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        return [self.plain_proposal() if self.plain(s) else self._proposal(s) for s in seqs]

    def _proposal(self, seq: Sequence) -> Proposal:
        st = self.state(seq)
        m, k = st.drafts, st.slots
        tokens = st.proposals[:m] + [MASK_TOKEN] * ((m + 1) * k)
        if not m:  # the tail, then one set of slots: plainly causal
            return Proposal(tokens)
        t, base = len(seq.tail), seq.num_tokens  # base: the first proposal's position
        positions = list(range(base, base + m))
        n = t + len(tokens)
        mask = causal_mask(n)
        for a in range(m + 1):
            start = t + m + a * k
            positions += range(base + a, base + a + k)
            mask[start : start + k, t + a : start] = False  # sees the tail, d1..da and its set
        return Proposal(tokens, positions, mask)

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        scored: Scored,
        ctx: StepContext,
    ) -> list[Commit]:
        if scored.tokens is not None:
            return self.commit_plain(scored, ctx)
        logits = scored.logits
        assert logits is not None
        states = [self.state(s) for s in seqs]
        if all(sampling.plain_greedy(sampling.Row(s)) for s in seqs):
            commits = self._commit_argmax(seqs, states, logits)
            self.measure(seqs, proposals, commits, ctx)
            return commits
        drafts = [Draft(st.proposals[: st.drafts], _rows(st.q, st.drafts)) for st in states]
        real = torch.cat([lg[: st.drafts + 1] for lg, st in zip(logits, states, strict=True)])
        rows = [
            sampling.Row(s, d.tokens[:r])
            for s, d in zip(seqs, drafts, strict=True)
            for r in range(len(d.tokens) + 1)
        ]
        adjusted = sampling.adjust(real, rows, ctx.eos_ids)
        if all(s.params.greedy for s in seqs):
            trees = [Tree.chain(d.tokens) for d in drafts]
            paths, last = verify_greedy(adjusted, trees)
            accepted = [len(p) for p in paths]
        else:
            accepted, last = verify_sampled(adjusted, rows, seqs, drafts)

        commits, offset, chosen = [], 0, []
        for seq, st, draft, lg, n_acc, token in zip(
            seqs, states, drafts, logits, accepted, last, strict=True
        ):
            tokens = draft.tokens[:n_acc] + [token]
            picked = list(range(offset, offset + n_acc + 1))
            lps = sampling.logprobs(real[picked], tokens, [rows[r] for r in picked])
            offset += len(draft.tokens) + 1
            _record(seq, len(draft.tokens), n_acc)
            start = 1 + st.drafts + n_acc * st.slots  # the slot set after the last accepted row
            chosen.append(lg[start : start + st.slots])
            commits.append(Commit(tokens, lps, kv_keep=n_acc))
        self._next_proposals(seqs, states, chosen, [c.tokens for c in commits], ctx.eos_ids)
        self.measure(seqs, proposals, commits, ctx)
        return commits

    def _commit_argmax(
        self, seqs: list[Sequence], states: list[IntrospectiveState], logits: list[torch.Tensor]
    ) -> list[Commit]:
        """Greedy rows with nothing to adjust (`sampling.plain_greedy`), the common case: every
        row's argmax in one copy to the host, the real rows' to verify (the proposals accepted
        while they equal them, then the real row's token), the chosen slot set's as the next
        proposals. What `commit` does for them with one wait for the device instead of two."""
        best = torch.cat(logits).argmax(-1).tolist()
        commits, offset = [], 0
        for seq, st, rows in zip(seqs, states, logits, strict=True):
            drafted = st.proposals[: st.drafts]
            n_acc = 0
            while n_acc < len(drafted) and drafted[n_acc] == best[offset + n_acc]:
                n_acc += 1
            tokens = drafted[:n_acc] + [best[offset + n_acc]]
            _record(seq, len(drafted), n_acc)
            start = offset + 1 + st.drafts + n_acc * st.slots  # the set after the last accepted
            st.proposals, st.q = best[start : start + st.slots], None
            commits.append(Commit(tokens, [None] * len(tokens), kv_keep=n_acc))
            offset += len(rows)
        return commits

    def _next_proposals(
        self,
        seqs: list[Sequence],
        states: list[IntrospectiveState],
        slots: list[torch.Tensor],
        committed: list[list[int]],
        eos_ids: set[int],
    ) -> None:
        """Each sequence's guesses from its chosen slot set. Greedy: the argmax. Sampled: a draw
        from each slot's distribution, which the rejection rule needs as q. Both under the
        request's adjustments (bias, penalties, as if this pass's tokens were out already) and
        truncation: the closer to p, the more pass. One batched pass over all the slots."""
        rows = [
            sampling.Row(seq, tokens, ahead=i)  # slot i guesses the token i places on
            for seq, tokens, s in zip(seqs, committed, slots, strict=True)
            for i in range(len(s))
        ]
        for st in states:
            st.proposals, st.q = [], None
        if not rows:
            return
        adjusted = sampling.adjust(torch.cat(slots), rows, eos_ids)
        sampled = [not seq.params.greedy for seq in seqs]
        best = [] if all(sampled) else adjusted.argmax(-1).tolist()
        probs = sampling.probabilities(adjusted, rows) if any(sampled) else None
        draws = [] if probs is None else sampling.draw(probs, rows, counter.DRAFT)
        offset = 0
        for st, s, is_sampled in zip(states, slots, sampled, strict=True):
            n = len(s)
            if is_sampled:
                st.q, st.proposals = probs[offset : offset + n], draws[offset : offset + n]
            else:
                st.proposals = best[offset : offset + n]
            offset += n


def _rows(q: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if q is None else q[:n]


def _record(seq: Sequence, drafted: int, accepted: int) -> None:
    """A verification's counts in the request's stats (as speculative decoding counts them)."""
    stats = seq.stats
    stats.drafts += 1 if drafted else 0
    stats.draft_tokens += drafted
    stats.accepted_tokens += accepted
    per_position = stats.accepted_per_position
    per_position.extend([0] * (drafted - len(per_position)))
    for i in range(accepted):
        per_position[i] += 1
