"""Structured outputs: the output follows a grammar, enforced as a token mask in the sampler.

A request's `Constraint` (a JSON schema, a regex, a list of choices, a Lark or GBNF grammar) is
compiled by llguidance against the model's tokenizer (bench/bench_grammar.py compares it with
xgrammar and outlines-core; the README says why it was chosen). Compiled grammars are cached
(`Grammars`, least recently used out), up to one compilation per thread of the mask pool while
that many sequences use a constraint at once; each sequence gets its own `Matcher`, a copy of
one of them (10 µs), which follows the sequence's committed output tokens.

How every decoder keeps to it:
- Sampling: `sampling.adjust`, which every draw and every verification goes through (`ar`'s
  draw, speculative verification greedy or sampled, Jacobi and lookahead verification, a draft
  model's or early exit's own draws), sets the logits of the tokens the grammar forbids to -inf
  (`mask_logits`). A row's mask is the grammar's state after the sequence's committed tokens
  plus the row's pending tokens (the drafts before it): one bitmask row per logits row, filled
  on llguidance's thread pool for the whole batch at once (a chain of drafts in one call),
  copied to the device in one transfer and applied there. A draw whose only adjustment is the
  grammar (greedy, or sampled without truncation: `sampling.checked_alone`) asks for a mask
  only where the token drawn from the raw logits is not surely allowed (`Matcher.allows`):
  most tokens of a constrained answer are what the model writes anyway, and checking one token
  is far cheaper than filling a row of the vocabulary (docs/BENCHMARKS.md, "Greedy draws
  under a grammar").
- Drafts: tokens a drafter proposes that the grammar forbids are cut before they are scored
  (`valid_prefix`; trees keep the nodes whose path the grammar allows, `allowed_nodes`).
- State: a matcher advances only on committed tokens (`EngineCore._apply`), never on a draft,
  so a rejected draft leaves nothing to undo: the grammar state rolls back with the KV for free.
  When the grammar can go no further, the sequence finishes with "stop".
- Bursts and launches kept in flight: a sequence whose draws the check serves
  (`sampling.checked_alone`) is drawn from the raw logits on the device like a free one,
  several passes in a row, the next launch continuing from its tokens before they are
  committed (`sampling.drawn_then_checked`); its tokens are checked as they are committed
  (`EngineCore._apply`), and the first refused one is dropped with all after it, and with what
  launches still in flight made from it (they are `Sequence.void`, no longer pending). Where
  the grammar forces text, the mask allows one token, which takes the refused one's place
  (`Matcher.instead`); elsewhere that token is drawn again under the mask at once, from the
  raw logits its launch kept (`sampling.redrawn`), the draw a launch would make there; a row
  with logprobs (which a kept row's draw would not give) draws it on the host in its next
  step (`refused`). Nothing constrained rides EAGLE's device cycles (`sampling.on_device`).
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.numpy import (
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from stride.decoders.numbers import Digits, Scan
from stride.engine.sequence import Constraint

# JSON as models write it ({"a": 1, "b": [2, 3]}), one way only: with flexible whitespace a
# small model can emit newlines forever where the grammar would have let it close the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "regex", "choice", "grammar")
THREADS = min(32, max(1, (os.cpu_count() or 1) * 4 // 5))  # the mask pool's (llguidance's default)
LANES = THREADS  # compilations of a constraint in use by many sequences at once (`_Roots`)


class GrammarError(ValueError):
    """A constraint that cannot be compiled (a bad schema, regex or grammar); the server
    answers 400."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
        except Exception as e:  # the GBNF converter's own errors
            raise GrammarError(f"invalid grammar: {e}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}; valid: {', '.join(KINDS)}")


def check(constraint: Constraint) -> None:
    """Raise GrammarError unless the constraint compiles (no tokenizer needed: the HTTP edge
    checks a request with it before submitting anything)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint))
    if error:
        raise GrammarError(_first_line(error))


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:500] if error.strip() else "invalid grammar"


class Matcher:
    """One sequence's position in its grammar: after its committed output tokens (and, for a
    JSON grammar, where its text stands, so that numbers stay bounded: `numbers`)."""

    __slots__ = ("ll", "digits", "scan", "stopped", "refused", "instead", "__weakref__")

    def __init__(self, ll: llguidance.LLMatcher, digits: Digits | None = None) -> None:
        self.ll = ll
        self.digits = digits
        self.scan = None if digits is None else Scan()
        self.stopped = ll.is_stopped()  # the grammar allows nothing more (but EOS)
        self.refused = False  # a token drawn without the mask was refused here (`take`)
        self.instead: int | None = None  # and the token the mask allows alone here, if any

    def scan_after(self, pending: list[int]) -> Scan | None:
        """The JSON text's state after the committed tokens and then `pending`."""
        if self.scan is None or not pending:
            return self.scan
        return self.scan.feed(b"".join(self.digits.token_bytes[t] for t in pending))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (nothing consumed)."""
        return self.ll.validate_tokens(tokens) if tokens else 0

    def forced(self) -> list[int]:
        """The canonical tokens of the text the grammar forces from here (none: it forces
        nothing). Where it forces text, its mask allows the first of them and no other token.
        (The forced bytes first: where there are none, as inside a free string, they cost a
        fraction of tokenizing them.)"""
        return self.ll.compute_ff_tokens() if self.ll.compute_ff_bytes() else []

    def allows(self, token: int, forced: list[int]) -> bool:
        """True if the mask (`bitmask`) surely allows `token` next, checked for that token
        alone (`forced`: what `forced` says here): the matcher accepts it, it is the first
        forced token if the grammar forces text (the one-token check would take any token
        that spells the text's start), and a number stays bounded. False: only the mask can
        tell."""
        if forced and forced[0] != token or self.ll.validate_tokens([token]) != 1:
            return False
        return self._fits(token)

    def take(self, token: int) -> bool:
        """Consume `token`, drawn without the mask, if the mask surely allows it (`allows`:
        checked and consumed in one call). Else consume nothing and return False: the next draw
        is masked (`refused`, until a token is committed), unless the grammar forces text here:
        its mask then allows the forced text's first token alone, which is what any draw under
        it gives (`instead`)."""
        forced = self.forced()
        if (
            not self.stopped
            and (not forced or forced[0] == token)
            and self._fits(token)
            and self.ll.try_consume_tokens([token]) == 1  # (consumed)
        ):
            self._consumed(token)
            return True
        only = forced[0] if forced else None
        self.refused = True
        self.instead = only if only is not None and self._fits(only) else None
        return False

    def advance(self, token: int) -> bool:
        """Consume a committed token drawn under the mask; True once the grammar allows nothing
        more (but EOS).

        A grammar that allows nothing at all from the start (a regex of no string) offers EOS
        only: taking it ends the sequence as any end of the grammar does."""
        if not self.ll.consume_token(token):
            if self.stopped:
                return True
            raise GrammarError(f"token {token} breaks the grammar: {self.ll.get_error()}")
        self._consumed(token)
        return self.stopped

    def _fits(self, token: int) -> bool:
        """A number stays bounded with `token` (JSON grammars; anything else: always)."""
        return self.scan is None or self.digits.fits(self.scan, token)

    def _consumed(self, token: int) -> None:
        self.refused = False
        if self.scan is not None:
            self.scan = self.scan.feed(self.digits.token_bytes[token])
        self.stopped = self.ll.is_stopped()


class Grammars:
    """Compiles constraints against one tokenizer, and keeps the most recent ones compiled.

    llguidance's view of the tokenizer (a token trie: about 1 s for a 49k vocabulary) is built
    on a thread as the engine starts, so that neither the start nor the first constrained
    request waits for it in full.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_ids: set[int], capacity: int = 256
    ) -> None:
        self.capacity = capacity
        self._compiled: OrderedDict[Constraint, _Roots] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._digits: Digits | None = None
        self._error: Exception | None = None
        backend = tokenizer.backend_tokenizer  # what llguidance.hf.from_tokenizer reads
        self._builder = threading.Thread(
            target=self._build,
            args=(backend, vocab_size, sorted(eos_ids)),
            name="stride-grammar-tokenizer",
            daemon=True,
        )
        self._builder.start()

    def _build(self, backend: Any, vocab_size: int, eos: list[int]) -> None:
        try:
            import copy

            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
            ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
            self._digits = Digits([ll.decode_bytes([t]) for t in range(vocab_size)])
            self._ll_tokenizer = ll
        except Exception as e:  # reported on the first constrained request
            self._error = e

    def tokenizer(self) -> llguidance.LLTokenizer:
        self._builder.join()
        if self._ll_tokenizer is None:
            raise GrammarError(f"structured outputs are unavailable: {self._error}")
        return self._ll_tokenizer

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for `constraint`, or GrammarError: a copy of one of its compiled
        roots, taken in turn (see `_Roots`)."""
        roots = self._compiled.get(constraint)
        if roots is None:
            roots = self._compiled[constraint] = _Roots(self._compile(constraint))
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        ll, lane = roots.copy(lambda: self._compile(constraint))
        matcher = Matcher(ll, self._digits if constraint.kind == "json_schema" else None)
        weakref.finalize(matcher, roots.released, lane)
        return matcher

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        compiled = llguidance.LLMatcher(self.tokenizer(), grammar_text(constraint), log_level=0)
        if compiled.is_error():
            raise GrammarError(_first_line(compiled.get_error()))
        return compiled


class _Roots:
    """A constraint's compilations, at most `LANES`, and how many live matchers each has.

    Copies of one compiled matcher share its lexer's cache behind one lock, so their masks are
    filled one at a time however many threads ask; copies of separate compilations fill in
    parallel on the pool's threads. A matcher is copied from the compilation with the fewest
    live ones, and the constraint is compiled again (a few ms) only while every compilation has
    a live matcher: a constraint used by one sequence at a time is compiled once."""

    def __init__(self, first: llguidance.LLMatcher) -> None:
        self.compiled = [first]
        self.live = [0]

    def copy(self, compile: Callable[[], llguidance.LLMatcher]) -> tuple[llguidance.LLMatcher, int]:
        """A copy of the least used compilation (a new one if all are used), and its lane."""
        lane = min(range(len(self.live)), key=self.live.__getitem__)
        if self.live[lane] and len(self.compiled) < LANES:
            self.compiled.append(compile())
            self.live.append(0)
            lane = len(self.compiled) - 1
        self.live[lane] += 1
        return self.compiled[lane].deep_copy(), lane

    def released(self, lane: int) -> None:
        """A matcher of `lane` is gone (its sequence ended)."""
        self.live[lane] -= 1


_executor: llguidance.LLExecutor | None = None


def _pool() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor(THREADS)
    return _executor


def bitmask(jobs: list[tuple[Matcher, list[int]]], vocab_size: int) -> np.ndarray:
    """One row per job: the tokens allowed after the matcher's state plus the job's pending
    tokens, as bits (int32 words, token t at bit t % 32 of word t // 32); inside a JSON number,
    not the tokens that would make it longer than a double (`numbers`). A row whose pending
    tokens the grammar refuses allows everything: no committed path runs through it.

    Consecutive jobs of one matcher whose pending tokens form a chain ([], [a], [a, b], ...: the
    rows of a speculative or Jacobi proposal) take one call with the chain as draft tokens. All
    calls run together on llguidance's thread pool, except a matcher's second row with pending
    tokens of its own (a draft tree's node, a lookahead path), which runs alone.
    """
    out = np.full((len(jobs), (vocab_size + 31) // 32), -1, dtype=np.int32)
    plain: list[tuple[llguidance.LLMatcher, int]] = []
    chains: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
    after: list[tuple[int, Matcher, list[int]]] = []  # rows after drafts of their own
    same: list[tuple[int, int]] = []  # (row, an earlier row of the same state)
    first: dict[int, int] = {}  # id(matcher) -> its row with no pending tokens
    i = 0
    while i < len(jobs):
        matcher, pending = jobs[i]
        end = i + 1
        if pending:
            after.append((i, matcher, pending))
        elif id(matcher) in first:
            same.append((i, first[id(matcher)]))
        else:
            first[id(matcher)] = i
            while (
                end < len(jobs)
                and jobs[end][0] is matcher
                and len(jobs[end][1]) == end - i
                and jobs[end][1][:-1] == jobs[end - 1][1]
            ):
                end += 1
            if end == i + 1:
                plain.append((matcher.ll, i))
            else:
                chains.append((matcher.ll, i, jobs[end - 1][1]))
        i = end
    if plain:
        fill_next_token_bitmask_par(_pool(), plain, out)
    if chains:
        fill_next_token_bitmask_par_with_draft_tokens(_pool(), chains, out)
    advanced: dict[int, tuple[llguidance.LLMatcher, int]] = {}  # id -> (matcher, tokens)
    lone: list[tuple[int, llguidance.LLMatcher, list[int]]] = []
    together: list[tuple[llguidance.LLMatcher, int]] = []
    for row, matcher, pending in after:
        ll = matcher.ll
        if id(ll) in advanced:
            lone.append((row, ll, pending))
        elif ll.validate_tokens(pending) == len(pending) and ll.consume_tokens(pending):
            advanced[id(ll)] = (ll, len(pending))
            together.append((ll, row))
    if together:
        fill_next_token_bitmask_par(_pool(), together, out)
    for ll, n in advanced.values():
        ll.rollback(n)
    for row, ll, pending in lone:
        if ll.validate_tokens(pending) == len(pending) and ll.consume_tokens(pending):
            fill_next_token_bitmask(ll, out, row)
            ll.rollback(len(pending))
    for row, earlier in same:
        out[row] = out[earlier]
    for row, (matcher, pending) in enumerate(jobs):
        scan = matcher.scan_after(pending)
        allowed = None if scan is None else matcher.digits.allowed(scan)
        if allowed is not None:
            kept = out[row] & allowed[: out.shape[1]]
            if kept.any():  # unless the grammar itself asks for a longer number
                out[row] = kept
    return out


_SHIFTS: dict[torch.device, torch.Tensor] = {}
_STAGING: dict[torch.device, tuple[torch.Tensor, torch.cuda.Event]] = {}


def mask_logits(logits: torch.Tensor, rows: list[int], jobs: list[tuple[Matcher, list[int]]]):
    """Set the logits the grammar forbids to -inf, in place: `rows[j]` of `logits` by `jobs[j]`
    (see `bitmask`)."""
    vocab = logits.shape[-1]
    bits = torch.from_numpy(bitmask(jobs, vocab))
    device = logits.device
    if device.type == "cuda":  # one asynchronous copy, queued behind the forward pass
        bits = _to_device(bits, device)
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]
    if len(rows) == len(logits):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _to_device(bits: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`bits` on `device` through a pinned buffer kept per device (pinning a fresh tensor every
    step costs more than the copy), reused once its last copy has left."""
    staging, copied = _STAGING.get(device, (None, None))
    if staging is None or staging.numel() < bits.numel():
        staging, copied = torch.empty(bits.numel() * 2, dtype=bits.dtype).pin_memory(), None
    if copied is not None:
        copied.synchronize()
    host = staging[: bits.numel()].view(bits.shape)
    host.copy_(bits)
    out = host.to(device, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    _STAGING[device] = (staging, event)
    return out


def valid_prefix(grammar: Matcher | None, tokens: list[int]) -> int:
    """How many leading `tokens` a sequence's grammar allows (all of them without one)."""
    return len(tokens) if grammar is None else grammar.valid_prefix(tokens)


def allowed_nodes(grammar: Matcher, tokens: list[int], parents: list[int]) -> list[int]:
    """The nodes of a draft tree (parents first, -1: the root) whose path from the root the
    grammar allows, in order: a node whose parent is cut is cut too."""
    paths: list[list[int] | None] = []
    kept: list[int] = []
    for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        before = [] if parent < 0 else paths[parent]
        path = None if before is None else [*before, token]
        if path is not None and grammar.valid_prefix(path) < len(path):
            path = None
        paths.append(path)
        if path is not None:
            kept.append(i)
    return kept
