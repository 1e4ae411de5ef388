"""The decoder protocol: propose tokens to score, then commit from what the target made of them.

A step of the scheduler, for every running sequence whose uncached tail fits in the batch:

1. `extra_tokens(seq, cap)` says how many tokens the decoder will add after the tail (0 for plain
   decoding, K for K drafts, W for a Jacobi window), so the scheduler can budget and reserve KV.
2. `propose(seqs)` returns those tokens (with positions or a mask if not plainly causal), for
   all of the decoder's sequences at once so that drafting can be batched. A proposal of no
   tokens is a plain step (score the tail, sample one token, as `ar` does); its `plain_steps`
   promises that many plain steps from this one on, so the executor may run them without asking
   the decoder in between (several steps per launch on the device, the next launched before this
   one is committed).
3. The engine scores tails and proposals of all sequences in one forward pass (`Scored`): each
   sequence gets logits for its last tail token and every proposed token, or, for plain steps
   run on the device, the tokens those steps sampled.
4. `commit(seqs, proposals, scored)` returns, per sequence, the tokens it accepts and how many
   proposed tokens keep their KV (`kv_keep`, a prefix, or the ones `kv_from` names, moved to
   the front: a draft tree keeps one path of its nodes); the rest is rolled back.

`admit(seq)` runs once when a request is admitted, before its first pass (e.g. to ask the
engine for the sequence's hidden states: `Sequence.features`). `release(seq)` drops what the
decoder keeps for a sequence that finished or was preempted (it is rebuilt from the tokens).
A decoder that runs passes of its own on the device with no host round trip between them (the
speculation loop) offers them through `burst(seqs, passes)`; a decoder whose sequences run on a
model of their own (diffusion) names it in `model_group`.

A plain step's commits are every decoder's to make, not only `ar`'s: `commit_plain` takes the
tokens sampled on the device (`plain_commits`), or samples one per sequence from its logits row.

Adding a strategy is one new module implementing `Decoder` plus one line in the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from stride.decoders import sampling
from stride.decoders.drawn_logprobs import Logprobs
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence


class DecoderError(ValueError):
    """A request asked a decoder for something it cannot do; the server answers 400."""


class Options(BaseModel):
    """A decoder's request options: their names, types and ranges, checkable without an engine.

    The HTTP edge checks a request's `decoder` against them (a bad option is a 400 before the
    engine sees it, and the OpenAPI schema lists them); `Decoder.validate` checks them again at
    admission, then what depends on the server (its draft model, the model's layers, the
    request's sampling). Strict: `"4"` is no integer and `true` no number. None: the default.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


OptionsT = TypeVar("OptionsT", bound=Options)


def parse_options(model: type[OptionsT], options: dict[str, Any], what: str) -> OptionsT:
    """`options` as `model`, or a DecoderError that names the bad option (and the valid ones)."""
    try:
        return model.model_validate(options)
    except ValidationError as e:
        error = e.errors()[0]
        key = ".".join(str(x) for x in error["loc"])
        if error["type"] == "extra_forbidden":
            valid = ", ".join(model.model_fields) or "none"
            raise DecoderError(f"{what} has no option {key!r}; valid options: {valid}") from None
        raise DecoderError(f"{what}: option {key!r}: {error['msg']}") from None


@dataclass(frozen=True)
class Variants:
    """A decoder's options told apart by one key (refine's `method`): each value has a model of
    its own, and a request may leave the key out for `default`."""

    key: str
    what: str  # how errors name a value's options: f"{what} {value!r}"
    models: dict[str, type[Options]]
    default: str

    def split(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The value `options` name (a known one, or DecoderError), and their other options."""
        value = options.get(self.key, self.default)
        if not isinstance(value, str) or value not in self.models:
            raise DecoderError(f"unknown {self.what} {value!r}; valid: {', '.join(self.models)}")
        return value, {k: v for k, v in options.items() if k != self.key}


def check_options(decoder: type[Decoder], options: dict[str, Any]) -> Options:
    """A request's options for `decoder` (`Decoder.options_model`): their names, types and
    ranges, checked without an engine, or DecoderError."""
    model = decoder.options_model
    if isinstance(model, Variants):
        value, rest = model.split(options)
        return parse_options(model.models[value], rest, f"{model.what} {value!r}")
    return parse_options(model, options, f"decoder {decoder.name!r}")


def options_schemas(decoder: type[Decoder]) -> list[dict[str, Any]]:
    """JSON schemas of `decoder`'s options object, one per variant, for the OpenAPI document."""
    model = decoder.options_model
    if not isinstance(model, Variants):
        return [model.model_json_schema()]
    out = []
    for value, variant in model.models.items():
        schema = variant.model_json_schema()
        schema["properties"] = {model.key: {"const": value}, **schema["properties"]}
        if value != model.default:
            schema["required"] = [model.key, *schema.get("required", [])]
        out.append(schema)
    return out


UNLIMITED = 1 << 30  # plain steps for good (`ar`)


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] | None = None  # default: consecutive after the tail
    mask: torch.Tensor | None = None  # [n, n] over tail + tokens; default causal
    # No tokens: plain steps promised from this one on (see the module docstring).
    plain_steps: int = 1

    @property
    def plain(self) -> bool:
        return not self.tokens and self.positions is None


PLAIN = Proposal()  # one plain step (shared: nobody mutates a proposal)


def causal_mask(n: int) -> torch.Tensor:
    """The [n, n] causal mask a masked proposal starts from (positions compared: `tril` of a
    boolean tensor takes far longer on the CPU, on a decoder's critical path every step)."""
    at = torch.arange(n)
    return at[:, None] >= at


@dataclass
class Scored:
    """What the target made of a decoder's sequences in one launch: each sequence's logits rows
    (its last tail token's, then one per proposed token), or, where the launch sampled plain
    steps on the device, the tokens each sequence's steps made (`plain_commits`)."""

    logits: list[torch.Tensor] | None = None
    tokens: list[list[int]] | None = None
    logprobs: list[Logprobs] | None = None  # of `tokens`, where drawn so
    drawn_from: list[torch.Tensor | None] | None = None  # the raw logits of `tokens`, kept


@dataclass
class Commit:
    tokens: list[int]
    logprobs: Logprobs
    kv_keep: int = 0  # how many tokens scored after the tail keep their KV
    # Which scored tokens (indices after the tail) those are, in order; None: the first kv_keep.
    kv_from: list[int] | None = None
    forward_passes: int = 1  # target passes that made these tokens (a burst: several)
    per_pass: list[int] | None = None  # tokens each pass made (default: 1 each, or all in one)
    # False: drawn on the device without a grammar's mask (`sampling.drawn_then_checked`); each
    # token is checked as it is committed, and the first refused one ends the commit.
    masked: bool = True
    # Such tokens' raw logits [tokens, V], where the launch kept them: a refused one is drawn
    # again from its row under the mask at once (`sampling.redrawn`).
    drawn_from: torch.Tensor | None = None


@dataclass
class StepContext:
    """What a decoder may need from the engine beyond its sequences' logits. `timing`: the wall
    time of the launch being committed, from the end of the launch before it (the host's work
    in between, the step's own proposals and launch, then the device: what the launch costs
    whether or not it overlapped), for the policies that price steps by measurement; None where
    the launch is no measure of its decode steps (it held prefill rows). `waiting`: requests
    wait to be admitted this step (a burst's commit then launches no burst ahead: `Burst`).
    `bursts`: decoders' own bursts run (`--fused-decode-steps` above 1)."""

    eos_ids: set[int]
    device: torch.device
    timing: float | None = None
    waiting: bool = False
    bursts: bool = False


def plain_commits(scored: Scored) -> list[Commit]:
    """The commits of plain steps sampled on the device: each sequence's tokens, all but the
    last with their KV kept (the last is the next step's tail)."""
    assert scored.tokens is not None
    lps = scored.logprobs or [[None] * len(t) for t in scored.tokens]
    kept = scored.drawn_from or [None] * len(scored.tokens)
    return [
        Commit(t, lp, len(t) - 1, forward_passes=len(t), masked=False, drawn_from=k)
        for t, lp, k in zip(scored.tokens, lps, kept, strict=True)
    ]


def commit_plain(seqs: list[Sequence], scored: Scored, ctx: StepContext) -> list[Commit]:
    """Plain steps' commits: the tokens sampled on the device, or one token per sequence
    sampled here from its single logits row."""
    if scored.tokens is not None:
        return plain_commits(scored)
    assert scored.logits is not None
    return sample_one_each(seqs, scored.logits, ctx)


def sample_one_each(
    seqs: list[Sequence], logits: list[torch.Tensor], ctx: StepContext
) -> list[Commit]:
    """One token per sequence from its single logits row, in one batched draw."""
    rows = [sampling.Row(s) for s in seqs]
    stacked = torch.cat(logits)
    tokens = sampling.sample(stacked, rows, ctx.eos_ids)  # synchronises with the device
    lps = sampling.logprobs(stacked, tokens, rows)
    return [Commit([t], [lp]) for t, lp in zip(tokens, lps, strict=True)]


@dataclass
class DecodersConfig:
    """Server-wide decoder settings (command-line flags); per-request options come on top."""

    default: str | dict[str, Any] = "ar"
    draft_model: str | None = None  # speculative: a causal LM sharing the target's tokenizer
    draft_head: str | None = None  # speculative: an EAGLE head directory for the target
    num_speculative_tokens: int = 4  # speculative: default K (the adaptive policy may lower it)
    diffusion_model: str | None = None  # refine/diffusion: a masked diffusion LM
    mask_adapter: str | None = None  # refine/introspective (None: the one shipped for the model)
    trust_remote_code: bool = False  # diffusion models loaded through AutoModel need it


class Decoder:
    name: str = ""
    # What `{"type": name, ...}` may add (`check_options`, `options_schemas`).
    options_model: ClassVar[type[Options] | Variants] = Options

    @classmethod
    def from_config(cls, engine: Engine, config: DecodersConfig) -> Decoder:
        """The server's instance; decoders with models or settings of their own override this."""
        return cls()

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        """Check a request's options at admission; return them normalised or raise DecoderError.

        Never raises anything else: what the schema let through (`check_options`) plus what
        depends on this server is checked here, before the request reaches a step.
        """
        return check_options(type(self), options).model_dump()

    def admit(self, seq: Sequence) -> None:
        """`seq` was admitted: set up what must exist before its first forward pass."""

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        """How many tokens to propose after `seq`'s tail this step, at most `cap`."""
        return 0

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        return [PLAIN] * len(seqs)

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        scored: Scored,
        ctx: StepContext,
    ) -> list[Commit]:
        raise NotImplementedError

    def release(self, seq: Sequence, ctx: StepContext) -> None:
        """The sequence finished or was preempted: drop whatever state the decoder kept for it."""
        seq.decoder_state = None

    def burst(self, seqs: list[Sequence], passes: int, ctx: StepContext) -> Burst | None:
        """Run up to `passes` passes of `seqs` on the device, started now; None: not this step.

        Asked instead of `propose` when every scheduled sequence is one of this decoder's and
        decodes (its tail is its last token), and nobody waits."""
        return None

    def model_group(self, seq: Sequence) -> ModelGroup | None:
        """The model group that runs `seq` instead of the target (a diffusion LM), if any."""
        return None


class Burst:
    """Passes a decoder started on the device (`Decoder.burst`)."""

    # Set by `commits`: the decoder launched its sequences' next burst at this one's commit,
    # into the KV slots reserved past their tokens, which the core then keeps; and the next
    # step admits nobody, so that the burst in flight is that step's (requests that arrive
    # meanwhile wait for it either way: it holds the device). Never while requests wait
    # (`StepContext.waiting`), so an arrival waits one burst at most.
    followed: bool = False

    def commits(self, since: float) -> list[Commit]:
        """One commit per sequence of the burst, in order (waits for the device). `since`: when
        the launch before it finished (`time.perf_counter()`), where the host's work for this
        burst began; a burst that prices itself counts from there, as the executor counts every
        launch (the host's work between bursts is the burst's cost too)."""
        raise NotImplementedError


class ModelGroup:
    """A model of a decoder's own that steps its sequences beside the target forward.

    Its sequences never enter the target's scheduler or KV cache: every engine step the core
    hands it all of them at once, and applies the returned commits under the usual stop rules.
    """

    def step(self, seqs: list[Sequence], ctx: StepContext) -> list[Commit]:
        raise NotImplementedError
