"""Plain records shared by every room: what a request asks for and where its sequence stands.

A `Sequence` keeps one invariant that the whole design leans on: `token_ids[:num_cached]` have
their keys and values in the KV cache, and the rest (`tail`) must be fed to the next forward pass.
A decoder extends a step by proposing extra tokens after the tail and, on commit, says how many of
the scored tokens keep their KV; anything it rejected is rolled back by lowering `num_cached`
(never below the tokens committed before the step).
With prefix caching, a sequence may start with `num_cached > 0`: the K/V of its first blocks were
computed for another sequence with the same leading tokens (see `engine.kv_cache`).
"""

from __future__ import annotations

import enum
import math
import random
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

NO_TOP_K = 1 << 40  # a rank past any vocabulary: a row without top-k
_SEEDS = random.SystemRandom()  # unseeded sequences' seeds (not torch's global generator)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (structured outputs), as plain data: `kind` is
    "json_schema" (`spec`: the schema as JSON text), "regex", "choice" (`spec`: a JSON list of
    strings) or "grammar" (Lark, or GBNF as vLLM clients send it). `decoders.grammar` compiles
    it against the tokenizer; the engine never reads it."""

    kind: str
    spec: str


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules (OpenAI/vLLM semantics)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the chosen token plus k alternatives
    prompt_logprobs: int | None = None  # as logprobs, for every prompt token but the first
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # structured outputs: the grammar the output follows

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @cached_property
    def unbiased(self) -> bool:
        """No logit bias or penalties: the distribution is the model's, whatever the tokens
        before (what lets a draw run on the device, several steps in a row)."""
        return not self.logit_bias and not self.has_penalties

    @cached_property
    def plain(self) -> bool:
        """Nothing to change the distribution or report about it: no logprobs, logit bias or
        penalties (a sequence adds its grammar and min_tokens: `sampling.on_device`). Read for
        every row of every launch, so cached: the engine never changes params."""
        return self.logprobs is None and self.unbiased

    @cached_property
    def draw_row(self) -> tuple[float, float, float, float, float]:
        """(temperature, top_p, log min_p, greedy, top_k) as the sampler's per-row tensors hold
        them: greedy rows (1, 1, -inf, 1, NO_TOP_K), no min-p -inf, no top-k NO_TOP_K. Cached
        like `plain`: a launch packs one per row."""
        if self.greedy:
            return (1.0, 1.0, -math.inf, 1.0, NO_TOP_K)
        log_min_p = math.log(self.min_p) if self.min_p > 0 else -math.inf
        top_k = min(self.top_k, NO_TOP_K) if self.top_k > 0 else NO_TOP_K
        return (self.temperature, self.top_p, log_min_p, 0.0, top_k)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DecodeStats:
    """What a decoder bought for one request; returned to the client and counted in metrics."""

    forward_passes: int = 0  # target forwards that produced tokens for this request
    drafts: int = 0  # speculative: verification passes that checked a draft
    draft_tokens: int = 0  # speculative: tokens proposed by the drafter
    accepted_tokens: int = 0  # speculative: drafted tokens the target accepted
    accepted_per_position: list[int] = field(default_factory=list)
    committed_per_pass: list[int] = field(default_factory=list)  # tokens committed per pass

    def as_dict(self) -> dict[str, Any]:
        passes = max(self.forward_passes, 1)
        committed = sum(self.committed_per_pass)
        out: dict[str, Any] = {
            "forward_passes": self.forward_passes,
            "tokens_per_pass": round(committed / passes, 4),
        }
        if self.draft_tokens:
            out.update(
                drafts=self.drafts,
                draft_tokens=self.draft_tokens,
                accepted_tokens=self.accepted_tokens,
                acceptance_rate=round(self.accepted_tokens / self.draft_tokens, 4),
                mean_accepted_length=round(committed / passes, 4),
                accepted_per_position=list(self.accepted_per_position),
            )
        return out


@dataclass
class Sequence:
    """One generation stream: prompt plus output, its KV bookkeeping and its decoder's state."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decoder: str = "ar"
    decoder_options: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    deadline: float | None = None  # time.monotonic() after which the request fails
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str = ""  # what else, besides the model and tokens, shapes its K/V (an adapter)

    token_ids: list[int] = field(init=False)
    num_cached: int = 0
    # Tokens that launches still in flight sample on the device (not in token_ids yet; their
    # K/V slots are reserved), and the plain steps its decoder promised beyond them.
    pending: int = 0
    promised: int = 0
    # Tokens that launches still in flight sample from a token its grammar refused since they
    # were launched: dropped when those launches finish (`DecoderSet.live`), not pending.
    void: int = 0
    refusals: int = 0  # tokens its grammar refused when they were committed (`redraw`)
    block_table: list[int] = field(default_factory=list)
    num_sealed: int = 0  # leading blocks of block_table that are full, committed and immutable
    block_hashes: list[bytes] = field(default_factory=list)  # of token_ids' full blocks, memo
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    status: Status = Status.WAITING
    # What its draws are keyed by (`decoders.counter`), in [0, 2^64): the request's seed, else a
    # random one, so every sample is a function of (seed, position, token) alone.
    seed: int = field(init=False)
    decoder_state: Any = None
    grammar: Any = None  # structured outputs: a `decoders.grammar.Matcher` at the output's end
    # Prompt logprobs (SamplingParams.prompt_logprobs): one per prompt token scored so far, the
    # first token's None; sent with the sequence's first output.
    prompt_logprobs: list[Any] | None = None
    # Set to a list by decoders that read the target's hidden states (EAGLE): the engine
    # appends one [tokens, width] tensor per pass that scored tokens of this sequence.
    features: list[torch.Tensor] | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        seed = self.params.seed
        self.seed = _SEEDS.getrandbits(64) if seed is None else seed & ((1 << 64) - 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def wants_prompt_rows(self) -> bool:
        """Prompt logprobs asked for and not all scored: its prompt is computed, not cached."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def redraw(self, known: int | None) -> int | None:
        """Its grammar refused the token drawn after its committed ones, and what launches in
        flight made from that one is void. `known`: the token a draw under the grammar's mask
        gives there, where it is known without scoring again (`sampling.redrawn`), which it
        returns. Else None: that token is drawn again, from its last committed token re-scored
        (the tail)."""
        self.refusals += 1
        self.void += self.pending
        self.pending = 0
        self.num_cached = len(self.token_ids) - (known is None)
        return known

    @property
    def fed_offset(self) -> int:
        """Where the next decode row sits past `num_cached`: at its last token, the last
        pending one if any (its predecessors' K/V are written or being written)."""
        return self.num_tokens - 1 + self.pending - self.num_cached

    @property
    def tail(self) -> list[int]:
        """Tokens not yet in the KV cache; the next forward must score them."""
        return self.token_ids[self.num_cached :]
