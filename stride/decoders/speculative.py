"""Speculative decoding: a cheap drafter guesses K tokens, the target checks them in one pass.

Request options (`{"type": "speculative", ...}`):
    draft: "ngram" | "early_exit" | the server's draft model name (default: the draft model if
        the server has one, else "ngram")
    num_speculative_tokens: the most drafts per step, K (default: the server's setting)
    adaptive: let the policy below pick K per step (default true); false always drafts K
    exit_layer: early_exit only, how many target layers draft (default: half of them)
    ngram_max: ngram only, the longest suffix looked up (default 3)

Step by step: `extra_tokens` picks K for the sequence (the scheduler reserves KV for it);
`propose` drafts for all speculative sequences of the step in batched drafter forwards; the
target scores the tail's last token and the K drafts inside the step's shared ragged forward;
`commit` verifies. Verification is the exact rule of Leviathan et al. / Chen et al.: with p the
target's distribution and q the drafter's at a position (both after the request's logit
adjustments, temperature, top-k/top-p/min-p, computed by `sampling`), draft d is accepted with
probability min(1, p(d)/q(d)); the first rejection is replaced by a draw from
norm(max(0, p − q)), and when all drafts pass a bonus token is drawn from the next p. Greedy
requests have one-hot p, so this reduces to "accept while the draft equals the target's argmax";
deterministic drafters (n-gram) have one-hot q. The output distribution is the target's, token by
token. Accepted drafts keep their target KV (`kv_keep`), the drafter rolls its own state back.

Adaptive K (the policy, per sequence and step). With a_i the chance that draft i passes once
drafts 0..i-1 have, K drafts yield E(K) = 1 + a_0 + a_0·a_1 + … + a_0·…·a_(K-1) tokens per target
pass. A step with K drafts costs
T(K) = spec·(1 + B(1+K)/S) + K·draft·(1 + B/S) and a plain one T0 = plain·(1 + B/S): a forward
grows with the tokens it scores once past S "saturation" tokens (where the device turns from
memory- to compute-bound: 16 on CPU, 256 on GPU), and each draft position is one batched drafter
forward. B is the number of speculative sequences in the step (the previous step's when
reserving, the actual one when drafting). `spec` and `draft` are measured relative to `plain`
(moving averages of wall times, so that a machine whose speed drifts keeps sensible ratios):
decode-only verification steps with drafts (through their per-row commit) against those
without (they differ a lot on a GPU, where plain decode steps replay CUDA graphs and
draft-scoring steps run eagerly), and each
drafter's forward per draft position. K stays 0 until plain decoding has been timed (4 steps,
the fastest counts: the first steps at a batch size can be slow once); until a
drafting step has been timed, and again after 256 plain steps without one (so that a stale
measurement cannot pin K at 0), the costs come from sizes: scoring drafts costs what plain
decoding does, drafting what the drafter's size says (0 for n-gram, L/layers for early exit,
the parameter ratio for a draft model). Goodput relative to plain decoding is
G(K) = E(K)·T0/T(K); the policy picks the K ≤ K_max with the largest G, and K = 0 (plain
decoding, no drafter work) unless the best G beats 1 by 5 %. The a_i are measured, per position,
not one a for all (`_Runs`): per sequence, decayed counts of the drafts scored at position i
(their predecessors passed) and of those accepted there, shrunk towards a prior: the drafter's
slow average over all sequences per position (0.6 before any). Acceptance is bursty, prompt
lookup above all: its first draft often fails, but once it matches it matches long (SmolLM2
copying code: a_0 ≈ a_1 ≈ 0.5, then ≈ 1, E(4) ≈ 2.3). One a for all positions, learned from a
failed first draft or from probes of one draft, says E(4) ≈ 1.6 there and K stays 0. A
sequence held at K = 0 by low acceptance probes every 16 steps (counted from its start, so that
sequences that started together probe in the same step) if good drafts (a = 0.9) would pay at
the measured costs, so its estimate can recover. A probe drafts what good drafts would, so that
it measures how far runs go, where scoring them costs at most 10 % more than scoring one draft
(a small batch on a GPU); else one draft.

Then the step as a whole must pay. Whatever G(K) says per sequence, a step that scores any draft
is a draft-scoring forward for all B rows (eager rather than a CUDA graph replay, a drafter
forward), so `propose` drops every adaptive draft of the step unless the step's expected tokens,
B + Σ(E(K_i) − 1) over its drafting sequences (a probe priced at a = 0.9), beat B plain tokens
by 5 % at the step's cost (`StepCosts.step_gain`). A few probes in a large batch do not; at
batch 1 the check is G(K) itself. After a step dropped its drafts, K is 0 at that batch size for
16 steps (no drafter lookups, no reserved KV), then the check runs again; from batch 8 on, each
check that fails again doubles the wait (up to 256 steps). Step costs are
measured per batch-size bucket (1, 2, 3-4, …, 33-64, …: `_bucket`), since a draft-scoring step
of 64 rows and one of 1 row relate differently to their plain steps and the token-count model
misjudges how much room a 64-row step has. A bucket prices from sizes until a drafting step
there has been timed; steps that may draft there run unoverlapped, so that the first drafting
step is timed (`may_launch_ahead`).

Where speculation does not pay, a speculative request must cost what an `ar` request costs. A
step is quiet (`_quiet_at`) when the policy's answer is K = 0 for every adaptive sequence
without asking it per sequence: while plain decoding is being timed at the batch size, during
a hold, and after a step whose plans were all K = 0, until the next probe (estimates change
only when drafts are scored). Then `extra_tokens` is one check per sequence, `propose`
returns the shared empty proposal, `commit` is `ar`'s batched draw, nothing per sequence is
updated, and the core launches the next step ahead (nothing is timed against a quiet step).
Since a quiet period's end is known in advance, a small greedy batch runs its quiet steps as
fused decode steps, as `ar` does (`plain_steps`): a fused run ends before the period does, so
that the probe or re-check there happens in the step it would have happened in anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from stride import drafts
from stride.decoders import grammar, sampling
from stride.decoders.autoregressive import Autoregressive, sample_one_each
from stride.decoders.base import (
    Burst,
    Commit,
    Decoder,
    DecoderError,
    DecodersConfig,
    Options,
    Proposal,
    StepContext,
    parse_options,
)
from stride.decoders.drafters import (
    Draft,
    Drafter,
    DraftModelDrafter,
    EarlyExitDrafter,
    NgramDrafter,
)
from stride.decoders.eagle import EagleDrafter
from stride.decoders.tree import Tree
from stride.engine.eagle_cycles import CycleResult
from stride.engine.engine import Engine
from stride.engine.kv_cache import OutOfBlocks
from stride.engine.sequence import SamplingParams, Sequence

MAX_K = 16
MAX_NGRAM = 8
_NOTHING = Proposal()  # shared by all sequences of a plain step: nobody mutates a proposal
MAX_TREE_NODES = 128
MAX_TREE_TOPK = 16


class SpeculativeOptions(Options):
    """Types and ranges; which drafters exist and how many layers there are is the server's."""

    draft: str | None = Field(
        None, description="ngram, early_exit, eagle (with an EAGLE head) or the --draft-model"
    )
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_K)
    adaptive: bool = True
    exit_layer: int | None = Field(None, ge=1, description="early_exit: layers that draft")
    ngram_max: int | None = Field(None, ge=1, le=MAX_NGRAM, description="ngram: longest suffix")
    tree_nodes: int | None = Field(
        None, ge=0, le=MAX_TREE_NODES,
        description="eagle: draft a tree of this many nodes (0: a chain; greedy requests only)",
    )  # fmt: skip
    tree_topk: int | None = Field(
        None, ge=1, le=MAX_TREE_TOPK, description="eagle: children expanded per tree node"
    )


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative rejection rule for a batch of sequences.

    p: [B, K+1, V] target distributions (row i follows i drafts); q: [B, K, V] draft
    distributions; drafts: [B, K] draft tokens; num_drafts: [B] how many of the K are real;
    u: [B, K] uniform draws. Returns the number of accepted drafts per sequence and the
    distribution [B, V] to draw the one token after them from (the residual or the bonus).
    """
    b, k = drafts.shape
    pos = torch.arange(k, device=p.device)
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0]
    ok = (u * q_d < p_d) & (pos[None] < num_drafts[:, None])  # u < p/q without dividing
    accepted = ok.long().cumprod(1).sum(1)
    rows = torch.arange(b, device=p.device)
    target = p[rows, accepted]
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, accepted]
    real = (accepted < num_drafts)[:, None]  # a rejected draft: its q is subtracted
    residual = torch.where(real, (target - q_next).clamp(min=0), target)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target)
    return accepted, residual


Rates = float | tuple[float, ...]  # acceptance per draft position; a float: the same at each


def expected_tokens(alpha: Rates, k: int) -> float:
    """Tokens per target pass with k drafts: 1 + a0 + a0·a1 + … + a0·…·a(k-1), where a_i is the
    chance that draft i passes once drafts 0..i-1 have (1 + alpha + … + alpha^k for a float)."""
    if isinstance(alpha, float | int):
        return k + 1.0 if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    total = reach = 1.0
    for a in alpha[:k]:
        reach *= a
        total += reach
    return total


@dataclass
class StepCosts:
    """What a step costs, per unit of the token-count factor (1 + tokens / saturation)."""

    saturation: float  # tokens at which a forward turns from memory- to compute-bound
    plain: float = 1.0  # a verification forward in which nothing was drafted
    spec: float = 1.0  # a verification forward that scores drafts
    draft: float = 0.0  # one batched drafter forward (one draft position)

    def gain(self, alpha: Rates, batch: int, k: int) -> float:
        """Goodput with k drafts relative to plain decoding."""
        unit = 1 + batch / self.saturation
        step = self.spec * (1 + batch * (1 + k) / self.saturation) + k * self.draft * unit
        return expected_tokens(alpha, k) * self.plain * unit / step

    def step_gain(self, batch: int, drafts: list[tuple[Rates, int]]) -> float:
        """Goodput of a whole step relative to a plain one, for (alpha, k) per drafting sequence.

        `gain` prices a sequence's drafts as if every sequence drafted as many; a step pays one
        draft-scoring forward however few sequences draft in it, so a handful of drafts in a
        large batch (probes) cannot pay for it there."""
        unit = 1 + batch / self.saturation
        tokens = batch + sum(k for _, k in drafts)
        positions = max((k for _, k in drafts), default=0)
        step = self.spec * (1 + tokens / self.saturation) + positions * self.draft * unit
        extra = sum(expected_tokens(alpha, k) - 1 for alpha, k in drafts)
        return (batch + extra) / batch * self.plain * unit / step


def choose_k(alpha: Rates, batch: int, k_max: int, costs: StepCosts) -> int:
    """The goodput-maximising number of drafts (see the module docstring); 0 when none pays."""
    best_k, best_gain = 0, 1.0
    for k in range(1, k_max + 1):
        gain = costs.gain(alpha, batch, k)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k if best_gain >= 1.05 else 0


def _bucket(batch: int) -> int:
    """Batch sizes whose step costs are measured together: 1, 2, 3-4, 5-8, …, 33-64, …"""
    return (max(batch, 1) - 1).bit_length()


@dataclass
class _Timings:
    """Measured step costs at one batch-size bucket (see the module docstring)."""

    plain_s: float | None = None  # a plain step, seconds per token-count factor
    spec: float | None = None  # StepCosts.spec measured, relative to plain_s
    plain_since_spec: int = 0  # plain steps timed since a drafting step was last timed
    plain_steps: int = 0  # plain steps timed in all


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class _Runs:
    """How far runs of accepted drafts go: decayed counts, per draft position, of drafts scored
    there (those whose predecessors all passed) and of those accepted there."""

    reached: list[float] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        """One verification: drafts up to the first rejected one were scored."""
        reached, passed = self.reached, self.passed
        for i in range(min(accepted + 1, drafted)):
            if i == len(reached):
                reached.append(0.0)
                passed.append(0.0)
            reached[i] = decay * reached[i] + 1.0
            passed[i] = decay * passed[i] + (i < accepted)

    def rates(self, prior: tuple[float, ...], weight: float) -> tuple[float, ...]:
        """Acceptance per position (as many as `prior` has), shrunk towards `prior`."""
        reached, passed, n = self.reached, self.passed, len(self.reached)
        return tuple(
            (passed[i] + weight * a) / (reached[i] + weight) if i < n else a
            for i, a in enumerate(prior)
        )


@dataclass
class _State:
    """Per-sequence speculation state (kept in `seq.decoder_state`)."""

    drafter: Drafter
    runs: _Runs = field(default_factory=_Runs)  # how far this sequence's drafts go
    reserved: int = 0  # K that extra_tokens reserved for this step
    probing: bool = False  # this step's K is a probe (see _plan)
    born: int = 0  # the decoder's step count when this state was made: the probe phase
    drafts: dict[str, Any] = field(default_factory=dict)
    tree: Tree | None = None  # this step's draft tree (greedy EAGLE requests with tree_nodes)


class Speculative(Decoder):
    name = "speculative"
    DECAY = 0.8
    PRIOR_WEIGHT = 3.0
    PROBE_EVERY = 16
    PLAIN_WARMUP = 4  # plain steps timed at a batch size before anything is priced against them
    PRIOR_ALPHA = 0.6  # a drafter's acceptance per position before any draft of it was scored
    PROBE_ALPHA = 0.9  # the acceptance a probe is priced at: it asks "would good drafts pay?"
    REMEASURE_EVERY = 256
    SYNC_EVERY = 32  # with launch-ahead, one step in this many runs unoverlapped to be timed
    BACKOFF_BATCH = 8  # from this batch size on, holds double while their checks fail

    def __init__(
        self,
        engine: Engine,
        draft_model: str | None = None,
        num_speculative_tokens: int = 4,
        saturation_tokens: float | None = None,
        measure_costs: bool = True,
        draft_head: str | None = None,
    ) -> None:
        self.engine = engine
        self.default_k = num_speculative_tokens
        self.saturation = saturation_tokens or (256.0 if engine.device.type == "cuda" else 16.0)
        self.draft_model = DraftModelDrafter(engine, draft_model) if draft_model else None
        self.eagle = EagleDrafter(engine, Path(draft_head)) if draft_head else None
        self.measure_costs = measure_costs
        self._drafters: dict[tuple, Drafter] = {}
        self._prior: dict[str, list[float]] = {}  # drafter name → rates over all sequences
        self._last_batch = 1
        self._timings: dict[int, _Timings] = {}  # _bucket(batch) → its measured step costs
        self._draft_ratio: dict[int, float] = {}  # id(drafter) → StepCosts.draft measured
        self._drafted = False  # the last proposed step drafted
        self._hold: tuple[int, int] | None = None  # (bucket, step): no drafts there until then
        self._hold_steps = self.PROBE_EVERY  # the next hold's length (doubles while checks fail)
        self._idle: tuple[int, int] | None = None  # (bucket, step): every plan K = 0 until then
        self._quiet = measure_costs  # this step: K = 0 for every adaptive sequence, unplanned
        self._planned = False  # this step: some adaptive sequence's plan had K > 0
        self._next_probe: int | None = None  # this step's plans: the earliest step to probe in
        self._reserved = False  # this step: some sequence reserved drafts
        self._timing: tuple[float, int, bool, _Timings] | None = None  # this step's, if timed
        self._choices: dict[tuple, int] = {}  # choose_k's answers under the current costs
        self._launched_ahead = False  # the core launches the next step before this one ends
        self._steps = 0

    @classmethod
    def from_config(cls, engine: Engine, config: DecodersConfig) -> Speculative:
        head, model = drafts.pick(config.draft_head, config.draft_model, engine.name)
        return cls(engine, model, config.num_speculative_tokens, draft_head=head)

    # ---- admission ------------------------------------------------------------------------

    @property
    def drafter_names(self) -> list[str]:
        names = ["ngram", "early_exit"]
        names += [self.draft_model.name] if self.draft_model else []
        return names + (["eagle"] if self.eagle else [])

    options_model = SpeculativeOptions

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        opts = parse_options(SpeculativeOptions, options, "decoder 'speculative'")
        draft = opts.draft
        if draft is None:
            draft = self.draft_model.name if self.draft_model else "ngram"
            draft = "eagle" if self.eagle else draft
        if draft not in self.drafter_names:
            raise DecoderError(
                f"unknown draft {draft!r}; valid drafters: {', '.join(self.drafter_names)}"
            )
        k = self.default_k if opts.num_speculative_tokens is None else opts.num_speculative_tokens
        out: dict[str, Any] = {
            "draft": draft,
            "num_speculative_tokens": k,
            "adaptive": opts.adaptive,
        }
        layers = self.engine.model.num_layers
        if draft == "early_exit":
            exit_layer = max(1, layers // 2) if opts.exit_layer is None else opts.exit_layer
            if not exit_layer <= layers:
                raise DecoderError(f"exit_layer must be an integer in [1, {layers}]")
            out["exit_layer"] = exit_layer
        elif opts.exit_layer is not None:
            raise DecoderError("exit_layer applies to draft 'early_exit' only")
        if draft == "ngram":
            out["ngram_max"] = 3 if opts.ngram_max is None else opts.ngram_max
        elif opts.ngram_max is not None:
            raise DecoderError("ngram_max applies to draft 'ngram' only")
        if draft == "eagle":
            nodes = opts.tree_nodes or 0
            # Trees verify greedy requests; a sampled one drafts chains (exact rejection rule).
            out["tree_nodes"] = nodes if params.greedy else 0
            out["tree_topk"] = 8 if opts.tree_topk is None else opts.tree_topk
        elif opts.tree_nodes is not None or opts.tree_topk is not None:
            raise DecoderError("tree_nodes and tree_topk apply to draft 'eagle' only")
        return out

    def _drafter(self, options: dict[str, Any]) -> Drafter:
        draft = options["draft"]
        if draft == "eagle":
            assert self.eagle is not None
            return self.eagle
        if draft == "ngram":
            key: tuple = ("ngram", options["ngram_max"])
        elif draft == "early_exit":
            key = ("early_exit", options["exit_layer"])
        else:
            assert self.draft_model is not None
            return self.draft_model
        if key not in self._drafters:
            self._drafters[key] = (
                NgramDrafter(max_n=key[1])
                if draft == "ngram"
                else EarlyExitDrafter(self.engine, key[1])
            )
        return self._drafters[key]

    def admit(self, seq: Sequence) -> None:
        self._drafter(seq.decoder_options).admit(seq)

    def _state(self, seq: Sequence) -> _State:
        if seq.decoder_state is None:
            seq.decoder_state = _State(self._drafter(seq.decoder_options), born=self._steps)
        return seq.decoder_state

    # ---- the adaptive policy --------------------------------------------------------------

    def _alpha(self, state: _State, k_max: int) -> tuple[float, ...]:
        """The sequence's acceptance per draft position, on top of the drafter's (see above)."""
        prior = self._prior.get(state.drafter.name)
        prior = (self.PRIOR_ALPHA,) * k_max if prior is None else tuple(prior[:k_max])
        return state.runs.rates(prior, self.PRIOR_WEIGHT)

    def _timings_at(self, batch: int) -> _Timings:
        bucket = _bucket(batch)
        timings = self._timings.get(bucket)  # (setdefault would build a record every step)
        if timings is None:
            timings = self._timings[bucket] = _Timings()
        return timings

    def _stale(self, timings: _Timings) -> bool:
        """No drafting step measured at this batch size, or none lately: price from sizes."""
        return timings.spec is None or timings.plain_since_spec >= self.REMEASURE_EVERY

    def _costs(self, drafter: Drafter, batch: int) -> StepCosts:
        timings = self._timings_at(batch)
        if not self.measure_costs or self._stale(timings):  # sizes: drafting gets (re)measured
            return StepCosts(self.saturation, draft=drafter.cost)
        draft = self._draft_ratio.get(id(drafter), drafter.cost)
        return StepCosts(self.saturation, spec=timings.spec, draft=draft)

    def _plan(self, seq: Sequence, state: _State, batch: int) -> int:
        state.probing = False
        k_max = seq.decoder_options["num_speculative_tokens"]
        if not seq.decoder_options["adaptive"] or k_max == 0:
            return k_max
        if self.measure_costs and self._timings_at(batch).plain_steps < self.PLAIN_WARMUP:
            return 0  # measure plain decoding first: it is what speculation must beat
        if self._hold and self._hold[0] == _bucket(batch) and self._steps < self._hold[1]:
            return 0  # a step at this batch size just found its drafts would not pay
        k = self._choose(self._alpha(state, k_max), batch, k_max, state.drafter)
        good_k = self._choose(self.PROBE_ALPHA, batch, k_max, state.drafter) if k == 0 else 0
        if good_k:
            # Speculation would pay at this batch size if drafts were good: probe now and then,
            # all such sequences in the same step (one draft-scoring step, not many).
            wait = -(self._steps - state.born + 1) % self.PROBE_EVERY
            if wait == 0:
                k, state.probing = self._probe_k(batch, good_k), True
            elif self._next_probe is None or self._steps + wait < self._next_probe:
                self._next_probe = self._steps + wait
        return k

    def _probe_k(self, batch: int, good_k: int) -> int:
        """A probe drafts what good drafts would (it measures how far runs go, not only the
        first position) where scoring them costs at most 10 % more than scoring one; else 1."""
        s = self.saturation
        return good_k if 1 + batch * (1 + good_k) / s <= 1.1 * (1 + 2 * batch / s) else 1

    def _quiet_at(self, batch: int) -> bool:
        """Is the next step's K = 0 for every adaptive sequence, without asking the policy?

        While plain decoding is being timed at this batch size, while a hold is on (a step
        found its drafts would not pay), and while the last plan at this batch size gave every
        sequence K = 0 (until the next probe step: an estimate changes only when its sequence
        drafts, and a sequence new to the decoder is planned anyway). Such a step
        costs what an `ar` step does: no per-sequence policy, lookups or bookkeeping.
        """
        return self._quiet_until(batch) is not None

    def _quiet_steps(self, batch: int) -> int:
        """How many steps from this one on are quiet at `batch`: until its hold or idle period
        ends. 1 while plain decoding is being timed there: those steps run one by one."""
        until = self._quiet_until(batch)
        return 1 if until is None else until - self._steps

    def _quiet_until(self, batch: int) -> int | None:
        """The step at which the quiet run at `batch` (see `_quiet_at`) ends; None: not quiet."""
        if self.measure_costs and self._timings_at(batch).plain_steps < self.PLAIN_WARMUP:
            return self._steps + 1
        bucket = _bucket(batch)
        ends = [p[1] for p in (self._hold, self._idle) if p is not None and p[0] == bucket]
        return max((end for end in ends if end > self._steps), default=None)

    def _step_pays(self, seqs: list[Sequence], states: list[_State], ks: list[int]) -> bool:
        """Do the adaptive drafts of this step, together, pay for a draft-scoring step?"""
        if any(k and not s.decoder_options["adaptive"] for s, k in zip(seqs, ks, strict=True)):
            return True  # fixed K drafts anyway: the step scores drafts whatever we decide
        drafts: dict[int, list[tuple[Rates, int]]] = {}  # by drafter: each prices its forwards
        for st, k in zip(states, ks, strict=True):
            if k:  # a probe is priced as one draft: its others cost next to nothing (_probe_k)
                priced = (self.PROBE_ALPHA, 1) if st.probing else (self._alpha(st, k), k)
                drafts.setdefault(id(st.drafter), []).append(priced)
        by_id = {id(st.drafter): st.drafter for st in states}
        batch = len(seqs)
        return all(
            self._costs(by_id[d], batch).step_gain(batch, ds) >= 1.05 for d, ds in drafts.items()
        )

    def _choose(self, alpha: Rates, batch: int, k_max: int, drafter: Drafter) -> int:
        """choose_k, remembered until the costs change: in a large batch most sequences share
        alpha (the drafter's prior, at K = 0), so a step evaluates the policy a few times, not
        once per sequence."""
        key = (alpha, batch, k_max, id(drafter))
        k = self._choices.get(key)
        if k is None:
            k = self._choices[key] = choose_k(alpha, batch, k_max, self._costs(drafter, batch))
        return k

    def may_launch_ahead(self) -> bool:
        """May the core launch the next step's forward before this step's text is decoded?

        Outputs do not depend on it (the next plan is fixed once this step has committed), but
        the policy's timings do: a step launched ahead overlaps host work of the step before, so
        its wall time is not its cost. Steps run unoverlapped until plain decoding has been
        timed, and then one in SYNC_EVERY, so the measurements stay fresh; the others are not
        timed. Quiet steps (`_quiet_at`) all launch ahead: nothing is priced against them.
        At a batch size whose drafting cost is not measured (or stale), a step that may draft
        there runs unoverlapped, so that the first drafting step is timed (an untimed one would
        have to be repeated).
        """
        timings = self._timings_at(self._last_batch)
        if not self.measure_costs:
            ahead = True
        elif timings.plain_steps < self.PLAIN_WARMUP:
            ahead = False
        elif self._quiet:
            ahead = True  # K = 0 for a while: nothing is priced against this step's time
        else:
            # Where drafting is not measured (or stale), time the next step if it may draft: the
            # first plan at this batch size, or the next one after a drafting step. A re-check
            # after a hold or an idle period is launched ahead: it most likely drafts nothing.
            bucket = _bucket(self._last_batch)
            recheck = any(u is not None and u[0] == bucket for u in (self._hold, self._idle))
            explore = self._stale(timings) and (self._drafted or not recheck)
            ahead = self._steps % self.SYNC_EVERY != 0 and not explore
        self._launched_ahead = ahead
        return ahead

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        state = seq.decoder_state
        if self._quiet and state is not None and seq.decoder_options["adaptive"]:
            state.reserved = 0  # the O(1) path of a quiet step (see _quiet_at)
            return 0
        state = self._state(seq)
        k = self._plan(seq, state, self._last_batch)
        if k and seq.decoder_options["adaptive"]:
            self._planned = True
        k = min(k, cap)
        state.reserved = state.drafter.available(seq, k) if k else 0
        nodes = seq.decoder_options.get("tree_nodes", 0)
        if state.reserved and nodes:  # a tree of depth k: its nodes are scored
            state.reserved = min(max(nodes, k), cap)
        self._reserved = self._reserved or state.reserved > 0
        return state.reserved

    # ---- propose and commit ---------------------------------------------------------------

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        planned_at, self._last_batch = self._last_batch, max(len(seqs), 1)
        reserved, planned, next_probe = self._reserved, self._planned, self._next_probe
        self._reserved = self._planned = False
        if not planned and not self._quiet:  # the policy said K = 0 to every adaptive sequence
            until = self._steps + self.PROBE_EVERY  # re-planned at least this often
            until = until if next_probe is None else min(until, next_probe)
            self._idle = (_bucket(planned_at), until)
        if not reserved:  # nothing to draft: a plain step, as `ar` makes it
            self._next_probe = None
            self._drafted = False
            self._start_timing(seqs, len(seqs), drafted=False)
            return [_NOTHING] * len(seqs)
        states = [self._state(s) for s in seqs]
        ks = [
            min(st.reserved, self._plan(s, st, len(seqs))) if st.reserved else 0
            for s, st in zip(seqs, states, strict=True)
        ]  # (for a tree: its depth; it scores up to `reserved` nodes)
        if any(ks) and not self._step_pays(seqs, states, ks):
            ks = [0] * len(seqs)
            # No drafts at this batch size for a while. In a large batch each check that fails
            # again doubles the wait: a check there costs a lookup per sequence on the step's
            # critical path; in a small one it is cheap and a missed run of good drafts dear.
            bucket = _bucket(len(seqs))
            if self._hold is None or self._hold[0] != bucket or len(seqs) < self.BACKOFF_BATCH:
                self._hold_steps = self.PROBE_EVERY
            self._hold = (bucket, self._steps + self._hold_steps)
            self._hold_steps = min(2 * self._hold_steps, self.REMEASURE_EVERY)
        elif any(ks):  # estimates change with drafts; a passed check ends the backoff
            self._idle, self._hold_steps = None, self.PROBE_EVERY
        self._next_probe = None  # (the plans above are this step's, not the next one's)
        by_drafter: dict[int, list[int]] = {}
        for i, st in enumerate(states):
            by_drafter.setdefault(id(st.drafter), []).append(i)
        drafts: list[Draft] = [Draft([]) for _ in seqs]
        for idx in by_drafter.values():
            drafter = states[idx[0]].drafter
            positions = max(ks[i] for i in idx)
            if not positions:
                continue
            start = time.perf_counter()
            made = self._draft(drafter, [seqs[i] for i in idx], [states[i] for i in idx],
                               [ks[i] for i in idx], ctx)  # fmt: skip
            plain_s = self._timings_at(len(seqs)).plain_s
            if plain_s:
                per_position = (time.perf_counter() - start) / positions
                ratio = per_position / (1 + len(idx) / self.saturation) / plain_s
                self._draft_ratio[id(drafter)] = _ema(self._draft_ratio.get(id(drafter)), ratio)
                self._choices.clear()
            for i, d in zip(idx, made, strict=True):
                drafts[i] = d
        for i, (seq, st) in enumerate(zip(seqs, states, strict=True)):
            if seq.grammar is not None and drafts[i].tokens:
                drafts[i] = _within_grammar(seq, st, drafts[i])
            st.drafts = {"tokens": drafts[i].tokens, "q": drafts[i].q}
        self._drafted = any(d.tokens for d in drafts)
        self._start_timing(seqs, len(seqs) + sum(len(d.tokens) for d in drafts), self._drafted)
        return [self._proposal(s, st, d) for s, st, d in zip(seqs, states, drafts, strict=True)]

    def _draft(
        self,
        drafter: Drafter,
        seqs: list[Sequence],
        states: list[_State],
        ks: list[int],
        ctx: StepContext,
    ) -> list[Draft]:
        """One drafter's drafts for its sequences: chains, and EAGLE trees where asked for."""
        trees = [
            i for i, (s, k) in enumerate(zip(seqs, ks, strict=True))
            if k and s.decoder_options.get("tree_nodes")
        ]  # fmt: skip
        for st in states:
            st.tree = None
        if not trees:
            return drafter.draft(seqs, ks, ctx.eos_ids)
        assert isinstance(drafter, EagleDrafter)
        chains = [0 if i in trees else k for i, k in enumerate(ks)]
        drafts = [Draft([]) for _ in seqs]
        if any(chains):
            drafts = drafter.draft(seqs, chains, ctx.eos_ids)
        sub = [seqs[i] for i in trees]
        depths = [ks[i] for i in trees]
        budgets = [states[i].reserved for i in trees]
        # Each level's expansion rows take `topk` scratch slots past the reserved ones' start.
        room = min(b // max(d - 1, 1) for b, d in zip(budgets, depths, strict=True))
        topk = max(1, min(room, *(s.decoder_options["tree_topk"] for s in sub)))
        for i, tree in zip(trees, drafter.draft_trees(sub, depths, budgets, topk), strict=True):
            states[i].tree = tree
            drafts[i] = Draft(tree.tokens)
        return drafts

    @staticmethod
    def _proposal(seq: Sequence, state: _State, draft: Draft) -> Proposal:
        if not draft.tokens:
            return _NOTHING
        tree = state.tree
        if tree is None:
            return Proposal(list(draft.tokens))
        start = seq.num_cached  # the root's position
        positions = [start + d for d in tree.depths()]
        return Proposal(list(tree.tokens), positions, tree.mask())

    def burst(self, seqs: list[Sequence], passes: int, ctx: StepContext) -> Burst | None:
        """EAGLE's greedy chains, several cycles per host sync (`EagleCycles`): when every
        sequence drafts a chain of the same K with the head this step and decodes plainly
        greedily (acceptance is the argmax, on the device)."""
        eagle = self.eagle
        if eagle is None or passes < 2:
            return None
        states = [self._state(s) for s in seqs]
        ks = {st.reserved for st in states}
        if len(ks) != 1:
            return None
        k = ks.pop()
        for seq in seqs:
            options = seq.decoder_options
            if options["draft"] != "eagle" or options.get("tree_nodes") or not k:
                return None
            if not Autoregressive.fusable(seq):
                return None
        left = max(s.params.max_tokens - s.num_output_tokens for s in seqs)
        room = min(self.engine.max_model_len - s.num_tokens for s in seqs) // (k + 1) - 1
        cycles = min(passes, eagle.cycles.max_cycles, -(-left // (k + 1)), room)
        if cycles < 1 or not eagle.cycles.fits(seqs, cycles, k):
            return None
        try:
            for seq in seqs:
                self.engine.cache.reserve(seq, seq.num_cached + (cycles + 1) * (k + 1))
        except OutOfBlocks:
            return None  # what was reserved goes back at commit (the core trims)
        self._reserved = self._planned = False  # (what `propose` would have reset)
        self._next_probe, self._drafted, self._timing = None, True, None
        return _EagleBurst(self, seqs, states, k, eagle.burst(seqs, k, cycles))

    def plain_steps(self, seqs: list[Sequence]) -> int:
        """For how many steps, this one first, `seqs` decode exactly as `ar` (see
        `Decoder.plain_steps`): none if this step drafted; only this one if it is timed (a
        fused run's wall time is no plain step's cost) or a sequence drafts a fixed K > 0 (its
        next step may draft); else any number for sequences at a fixed K = 0, and for adaptive
        ones until their quiet period ends (`_quiet_steps`: the next plan may probe)."""
        if self._drafted:
            return 0
        if self._timing is not None:
            return 1
        adaptive = False
        for seq in seqs:
            options = seq.decoder_options
            if options["num_speculative_tokens"]:
                if not options["adaptive"]:
                    return 1
                adaptive = True
        return self._quiet_steps(len(seqs)) if adaptive else 1 << 30

    def fused(self, seqs: list[Sequence], steps: int) -> None:
        """`steps` quiet steps ran fused: count them, and see whether the next one is quiet."""
        self._steps += steps
        self._quiet = self._quiet_at(self._last_batch)

    def _start_timing(self, seqs: list[Sequence], tokens: int, drafted: bool) -> None:
        """Time the verification forward of decode-only steps (a prefill would skew it), unless
        it was launched ahead (see may_launch_ahead)."""
        self._timing = None
        ahead, self._launched_ahead = self._launched_ahead, False
        if self.measure_costs and not ahead and all(s.num_tokens - s.num_cached == 1 for s in seqs):
            self._timing = (time.perf_counter(), tokens, drafted, self._timings_at(len(seqs)))

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        logits: list[torch.Tensor],
        ctx: StepContext,
    ) -> list[Commit]:
        self._steps += 1
        if not self._drafted:  # nothing to verify: exactly what plain decoding does
            commits = sample_one_each(seqs, logits, ctx)
            self._time_step()
            self._quiet = self._quiet_at(self._last_batch)
            return commits
        states = [self._state(s) for s in seqs]
        drafts = [st.drafts["tokens"] for st in states]
        trees = [st.tree or Tree.chain(d) for st, d in zip(states, drafts, strict=True)]
        # Each row's pending tokens: the drafts on the path from the root to it.
        rows = [
            sampling.Row(s, pending)
            for s, tree in zip(seqs, trees, strict=True)
            for pending in _paths(tree)
        ]
        raw = torch.cat(logits)
        adjusted = sampling.adjust(raw, rows, ctx.eos_ids)
        if all(s.params.greedy for s in seqs):
            paths, last = self._verify_greedy(adjusted, trees)
        else:  # (sampled requests draft chains only)
            accepted, last = self._verify_sampled(adjusted, rows, seqs, states, ctx)
            paths = [list(range(n)) for n in accepted]

        commits = []
        offset = 0
        for seq, st, tree, path, token in zip(seqs, states, trees, paths, last, strict=True):
            n_acc = len(path)
            tokens = [tree.tokens[i] for i in path] + [token]
            picked = [offset] + [offset + 1 + i for i in path]
            lps = sampling.logprobs(raw[picked], tokens, [rows[r] for r in picked])
            offset += len(tree) + 1
            self._record(seq, st, len(tree) if st.tree is None else max(tree.depths()), n_acc)
            chain = st.tree is None
            st.drafter.accepted(seq, n_acc, None if chain else path)
            st.drafts, st.tree = {}, None
            commits.append(Commit(tokens, lps, kv_keep=n_acc, kv_from=None if chain else path))
        self._time_step()  # a drafting step's per-row commit is part of its cost
        self._quiet = self._quiet_at(self._last_batch)
        return commits

    def _time_step(self) -> None:
        """Fold this step's wall time (verification has synchronised by now) into the costs."""
        if self._timing is None:
            return
        start, tokens, drafted, timings = self._timing
        self._timing = None
        seconds = (time.perf_counter() - start) / (1 + tokens / self.saturation)
        if not drafted:
            # The first steps at a batch size can be slow once (allocation, kernel selection):
            # the fastest of them is the baseline, so that drafting is not judged cheap by it.
            if timings.plain_steps < self.PLAIN_WARMUP:
                timings.plain_s = min(timings.plain_s or seconds, seconds)
            else:
                timings.plain_s = _ema(timings.plain_s, seconds)
            timings.plain_steps += 1
            timings.plain_since_spec += 1
        elif timings.plain_s:
            timings.spec = _ema(timings.spec, seconds / timings.plain_s)
            timings.plain_since_spec = 0
        self._choices.clear()

    def _verify_greedy(
        self, adjusted: torch.Tensor, trees: list[Tree]
    ) -> tuple[list[list[int]], list[int]]:
        """Greedy: follow the nodes equal to the target's argmax; then take the argmax."""
        best = adjusted.argmax(-1).tolist()
        paths, last, offset = [], [], 0
        for tree in trees:
            rows = best[offset : offset + len(tree) + 1]
            path = tree.accept_greedy(rows)
            paths.append(path)
            last.append(rows[path[-1] + 1 if path else 0])
            offset += len(tree) + 1
        return paths, last

    def _verify_sampled(
        self,
        adjusted: torch.Tensor,
        rows: list[sampling.Row],
        seqs: list[Sequence],
        states: list[_State],
        ctx: StepContext,
    ) -> tuple[list[int], list[int]]:
        probs = sampling.probabilities(adjusted, rows)
        b, vocab, dev = len(seqs), probs.shape[-1], probs.device
        counts = [len(st.drafts["tokens"]) for st in states]
        k = max(max(counts), 1)
        p = probs.new_zeros(b, k + 1, vocab)
        q = probs.new_zeros(b, k, vocab)
        drafts = torch.zeros(b, k, dtype=torch.long, device=dev)
        offset = 0
        for i, (st, n) in enumerate(zip(states, counts, strict=True)):
            p[i, : n + 1] = probs[offset : offset + n + 1]
            offset += n + 1
            if n:
                tokens = torch.tensor(st.drafts["tokens"], device=dev)
                drafts[i, :n] = tokens
                if st.drafts["q"] is None:  # deterministic drafter: one-hot q
                    q[i, torch.arange(n, device=dev), tokens] = 1.0
                else:
                    q[i, :n] = st.drafts["q"].to(q.dtype)
        u = torch.rand(b, k, device=dev)
        for i, (s, n) in enumerate(zip(seqs, counts, strict=True)):
            if s.generator is not None and n:  # as many draws as drafts: batch-independent
                u[i, :n] = torch.rand(n, generator=s.generator, device=dev)
        num = torch.tensor(counts, device=dev)
        accepted, dist = verify(p, q, drafts, num, u)
        last = sampling.draw(dist, [sampling.Row(s) for s in seqs])
        return accepted.tolist(), last

    def _record(self, seq: Sequence, state: _State, drafted: int, accepted: int) -> None:
        stats = seq.stats
        stats.drafts += 1 if drafted else 0
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        if len(stats.accepted_per_position) < drafted:
            stats.accepted_per_position.extend([0] * (drafted - len(stats.accepted_per_position)))
        for i in range(accepted):
            stats.accepted_per_position[i] += 1
        if drafted == 0:
            return
        state.runs.add(drafted, accepted, self.DECAY)
        prior = self._prior.setdefault(state.drafter.name, [self.PRIOR_ALPHA] * MAX_K)
        for i in range(min(accepted + 1, drafted)):  # a slow average over all sequences
            prior[i] += 0.05 * ((i < accepted) - prior[i])

    def release(self, seq: Sequence, ctx: StepContext) -> None:
        if seq.decoder_state is not None:
            seq.decoder_state.drafter.release(seq)
        seq.decoder_state = None


class _EagleBurst(Burst):
    def __init__(self, spec: Speculative, seqs, states, k: int, result: CycleResult) -> None:
        self.spec, self.seqs, self.states, self.k, self.result = spec, seqs, states, k, result

    def commits(self) -> list[Commit]:
        spec, k = self.spec, self.k
        out = []
        per_seq = self.result.per_sequence()
        spec._steps += len(per_seq[0]) if per_seq else 0
        for i, (seq, st, cycles) in enumerate(zip(self.seqs, self.states, per_seq, strict=True)):
            tokens = [t for cycle in cycles for t in cycle]
            for cycle in cycles:
                spec._record(seq, st, k, len(cycle) - 1)
            spec.eagle.burst_done(seq, len(tokens), self.result.roots[i])
            out.append(
                Commit(tokens, [None] * len(tokens), kv_keep=len(tokens) - 1,
                       forward_passes=len(cycles), per_pass=[len(c) for c in cycles])  # fmt: skip
            )
        spec._quiet = spec._quiet_at(spec._last_batch)
        return out


def _within_grammar(seq: Sequence, state: _State, draft: Draft) -> Draft:
    """The draft without the tokens the sequence's grammar forbids: a chain cut at the first,
    a tree without the nodes under one (they would be scored for nothing)."""
    tree = state.tree
    if tree is None:
        n = seq.grammar.valid_prefix(draft.tokens)
        return draft if n == len(draft.tokens) else Draft(draft.tokens[:n], _rows(draft.q, n))
    nodes = grammar.allowed_nodes(seq.grammar, tree.tokens, tree.parents)
    if len(nodes) < len(tree):
        state.tree = tree.subtree(nodes) if nodes else None
    return Draft(list(state.tree.tokens) if state.tree else [])


def _rows(q: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if q is None else q[:n]


def _paths(tree: Tree) -> list[list[int]]:
    """For the root and each node: the draft tokens from the root down to it."""
    out: list[list[int]] = [[]]
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        out.append(out[parent + 1] + [token])
    return out
