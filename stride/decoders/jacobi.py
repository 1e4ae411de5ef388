"""Jacobi decoding: guess a window of future tokens, let one forward pass refine them all.

Greedy decoding is the fixed point of `y_i = argmax p(. | x, y_<i)`. Jacobi iteration guesses all
W positions at once, scores them in the shared causal forward (each row sees the guesses before
it) and keeps the longest prefix of guesses that equal the model's own predictions, plus the
prediction after it: at least one token per pass, and exactly the tokens greedy AR would produce.
The predictions at the rejected positions become the next pass's guesses.

`verify` is shared with lookahead decoding, which scores several candidate paths in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field

from stride.decoders import sampling
from stride.decoders.base import (
    Commit,
    Decoder,
    DecoderError,
    Options,
    Proposal,
    Scored,
    StepContext,
    parse_options,
)
from stride.decoders.catalog import JACOBI
from stride.decoders.payoff import Adaptive, Payoff
from stride.engine.sequence import SamplingParams, Sequence

MAX_WINDOW = 64


@dataclass
class Verdict:
    """Greedy verification of one sequence's proposal."""

    preds: list[int]  # the greedy prediction of every logits row (row 0: the last tail token)
    path: int  # index of the winning path
    accepted: int  # proposed tokens of the winning path that match the predictions
    rows: list[int]  # the logits row that predicted each committed token

    @property
    def tokens(self) -> list[int]:
        """The committed tokens: the accepted ones plus the model's next prediction."""
        return [self.preds[r] for r in self.rows]


def verify(
    seqs: list[Sequence],
    proposals: list[Proposal],
    paths: list[list[list[int]]],
    logits: list[torch.Tensor],
    ctx: StepContext,
) -> tuple[list[Verdict], list[list[sampling.TokenLogprob | None]]]:
    """Pick, per sequence, the path (indices into its proposed tokens) greedy decoding agrees
    with longest; returns the verdicts and the logprobs of the committed tokens.

    Row `1 + i` holds the logits after proposed token `i`. Each row is adjusted (penalties, bias,
    min_tokens) as if the tokens of its path before it were already output, as AR would see them.
    """
    rows: list[sampling.Row] = []
    for seq, prop, seq_paths in zip(seqs, proposals, paths, strict=True):
        pending: list[list[int]] = [[] for _ in range(1 + len(prop.tokens))]
        for path in seq_paths:
            for j, i in enumerate(path):
                pending[1 + i] = [prop.tokens[x] for x in path[: j + 1]]
        rows.extend(sampling.Row(seq, p) for p in pending)
    stacked = torch.cat(logits)
    preds_all = sampling.adjust(stacked, rows, ctx.eos_ids).argmax(-1).tolist()

    verdicts: list[Verdict] = []
    offset = 0
    for prop, seq_paths in zip(proposals, paths, strict=True):
        preds = preds_all[offset : offset + 1 + len(prop.tokens)]
        best = Verdict(preds, 0, 0, [0])
        for p, path in enumerate(seq_paths):
            committed = [0]  # row 0 predicts the first proposed position
            for i in path:
                if prop.tokens[i] != preds[committed[-1]]:
                    break
                committed.append(1 + i)
            if len(committed) - 1 > best.accepted:
                best = Verdict(preds, p, len(committed) - 1, committed)
        verdicts.append(best)
        offset += 1 + len(prop.tokens)

    if all(s.params.logprobs is None for s in seqs):
        return verdicts, [[None] * len(v.rows) for v in verdicts]
    starts = [0]
    for prop in proposals:
        starts.append(starts[-1] + 1 + len(prop.tokens))
    flat_rows = [starts[s] + r for s, v in enumerate(verdicts) for r in v.rows]
    flat_tokens = [t for v in verdicts for t in v.tokens]
    owners = [rows[starts[s]] for s, v in enumerate(verdicts) for _ in v.rows]
    lps = sampling.logprobs(stacked[flat_rows], flat_tokens, owners)
    grouped, k = [], 0
    for v in verdicts:
        grouped.append(lps[k : k + len(v.rows)])
        k += len(v.rows)
    return verdicts, grouped


def check_greedy(params: SamplingParams, method: str) -> None:
    if not params.greedy:
        raise DecoderError(
            f"refine method {method!r} is lossless only for greedy decoding; send temperature 0 "
            "or use the 'diffusion' method or another decoder for sampling"
        )


class JacobiOptions(Options):
    window: int | None = Field(None, ge=1, le=MAX_WINDOW, description="guesses per pass")


@dataclass
class JacobiState:
    guesses: list[int] = field(default_factory=list)  # refined guesses after the tail
    size: int = 0  # window size reserved this step


class Jacobi(Adaptive, Decoder):
    """Jacobi iteration over a window of `window` guesses (option), greedy only. A request with
    default options is adaptive: it refines only while refining pays (`payoff`)."""

    name = JACOBI
    default_window = 8

    options_model = JacobiOptions

    def __init__(self) -> None:
        # (adaptive requests have default options: a refining step commits at most a window
        # and the token after it; a lookahead branch is no longer than the window)
        self.payoff = Payoff(most=self.default_window + 1)

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        check_greedy(params, self.name)
        window = parse_options(JacobiOptions, options, "refine method 'jacobi'").window
        window = self.default_window if window is None else window
        return {"window": window, "adaptive": not options}  # default options: see `payoff`

    def state(self, seq: Sequence) -> JacobiState:
        if seq.decoder_state is None:
            seq.decoder_state = JacobiState()
        return seq.decoder_state

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        """The window's size; with a grammar, only its guesses the grammar allows (a window
        that strays from it would be scored for nothing)."""
        st = self.state(seq)
        if self.plain(seq):
            st.size, st.guesses = 0, []  # (guesses from before the plain steps are stale)
            return 0
        st.size = min(seq.decoder_options.get("window", self.default_window), cap)
        if seq.grammar is not None:
            st.size = seq.grammar.valid_prefix(self.window(seq))
        return st.size

    def window(self, seq: Sequence) -> list[int]:
        """The current guesses, padded with the last known token (a cheap, common first guess)."""
        st = self.state(seq)
        guesses = st.guesses[: st.size]
        pad = guesses[-1] if guesses else seq.token_ids[-1]
        return guesses + [pad] * (st.size - len(guesses))

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        return [self.plain_proposal() if self.plain(s) else Proposal(self.window(s)) for s in seqs]

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        scored: Scored,
        ctx: StepContext,
    ) -> list[Commit]:
        if scored.tokens is not None:
            return self.commit_plain(scored, ctx)
        paths = [[list(range(len(p.tokens)))] for p in proposals]
        verdicts, lps = verify(seqs, proposals, paths, scored.logits, ctx)
        commits = []
        for seq, prop, v, lp in zip(seqs, proposals, verdicts, lps, strict=True):
            self.refine(seq, prop, v)
            commits.append(Commit(v.tokens, lp, kv_keep=v.accepted))
        self.measure(seqs, proposals, commits, ctx)
        return commits

    def refine(self, seq: Sequence, prop: Proposal, v: Verdict) -> None:
        """Keep the window's predictions past the committed tokens as the next guesses."""
        size = self.state(seq).size
        self.state(seq).guesses = v.preds[v.accepted + 1 : size + 1]
