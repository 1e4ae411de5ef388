"""Adaptive K: how many drafts each speculative sequence gets per step, from measured costs.

The model (in `loop_policy`): K drafts yield E(K) tokens per target pass at a step cost T(K);
the policy picks the K ≤ K_max with the largest goodput G(K) = E(K)·T0/T(K), and K = 0 (plain
decoding, no drafter work) unless the best G beats 1 by 5 %. B, the number of speculative
sequences in the step, is the previous step's when reserving, the actual one when drafting.

Observations and decisions. Everything the policy knows is one record, `Observed`: the step
costs per batch size, each drafter's cost and acceptance prior, the verification step count,
the last step's batch size, and what its checks found (holds and idle periods, below). Only the
observation methods write it (`proposed`, `stepped`, `measured`, `drafter_timed`, `record`);
the decisions (`plan`, `plan_step`, `quiet_at`, `quiet_steps`) read it and their arguments, so
asking again (a sequence is planned when it reserves and again when the step drafts) changes
nothing, and what the policy does next follows from what it has seen. What one step's plans
found is the step's, not the policy's: the decoder gathers it (`StepPlans`) and hands it to
`proposed` with the step.

What it measures. `spec` and `draft` are measured relative to `plain` (moving averages of wall
times): decode-only verification steps with drafts (through their per-row commit, without their
drafters' forwards) against those without (they differ a lot on a GPU, where plain decode steps
replay CUDA graphs and draft-scoring steps run eagerly), and each drafter's forward per draft
position. K stays 0 until plain decoding has been timed (`PLAIN_WARMUP` steps, the fastest counts:
the first steps at a batch size can be slow once); until a drafting step has been timed, and again
after `REMEASURE_EVERY` plain steps without one (so that a stale measurement cannot pin K at 0),
the costs come from sizes: scoring drafts costs what plain decoding does, drafting what the
drafter's size says (0 for n-gram, L/layers for early exit, the parameter ratio for a draft model);
and then a sequence drafts one token at most, so that the smallest draft-scoring pass is the one
measured first, and larger ones are priced from it. Step costs are measured per batch-size bucket
(`rates.bucket`), since a draft-scoring step of 64 rows and one of 1 row relate differently
to their plain steps, and within a bucket by the step's tokens per pass (`Timings.spec_at`; a size
not measured yet is priced from the nearest one measured, `StepCosts.scoring`). Measured from the
smallest pass up, a dear 4-row pass on a CPU cannot price the cheap 2-row one out of ever being
tried.

Acceptance. The a_i are measured per position, not one a for all (`Runs`, in each sequence's
`SeqState`): per sequence, decayed counts of the drafts scored at position i (their predecessors
passed) and of those accepted there, shrunk towards a prior: the drafter's slow average over all
sequences per position (`PRIOR_ALPHA` before any). Acceptance is bursty, prompt lookup above
all: its first draft often fails, but once it matches it matches long; one a for all positions,
learned from a failed first draft, would keep K at 0 where runs pay. A sequence held at K = 0 by
low acceptance probes every `PROBE_EVERY` steps (counted from its start, so that sequences that
started together probe in the same step) if good drafts (`PROBE_ALPHA`) would pay at the
measured costs, so its estimate can recover. A probe drafts what good drafts would, where
scoring them costs at most 10 % more than scoring one draft (a small batch on a GPU); else one.

The step as a whole must pay. Whatever G(K) says per sequence, a step that scores any draft
is a draft-scoring forward for all B rows, so `plan_step` drops every adaptive draft of the step
unless the step's expected tokens, B + Σ(E(K_i) − 1) over its drafting sequences (a probe
priced at `PROBE_ALPHA`), beat B plain tokens by 5 % at the step's cost (`StepCosts.step_gain`).
After a step dropped its drafts, K is 0 at that batch size for `PROBE_EVERY` steps (a hold: no
drafter lookups, no reserved KV), then the check runs again; from `BACKOFF_BATCH` on, each check
that fails again doubles the wait (up to `REMEASURE_EVERY` steps).

Quiet steps. Where speculation does not pay, a speculative request must cost what an `ar`
request costs. A step is quiet (`quiet_at`, asked once when the step before it commits) when
the answer is K = 0 for every adaptive sequence without asking per sequence: while plain
decoding is being timed at the batch size, during a hold, and after a step whose plans were all
K = 0, until the next probe (estimates change only when drafts are scored). Then the decoder
does what `ar` does, and the core may launch the next step ahead (nothing is timed against a
quiet step) or run the quiet period as a burst (`quiet_steps`: a burst ends before the period
does, so that the probe or re-check there happens in the step it would have happened in anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from stride.decoders.base import StepContext
from stride.decoders.rates import MIN_GAIN, bucket, ema
from stride.decoders.speculative.drafters import Draft, Drafter
from stride.decoders.speculative.loop_policy import Rates, StepCosts, Timings, choose_k
from stride.decoders.speculative.tree import Tree
from stride.engine.sequence import Sequence

MAX_K = 16  # the most drafts a request may ask for per step
UNTIMED = Timings()  # what is measured at a bucket before anything is (never written)

Period = tuple[int, int]  # (bucket, step): at that batch-size bucket, until that step


@dataclass
class Runs:
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
class SeqState:
    """What speculation keeps per sequence (in `seq.decoder_state`): its drafter, how far its
    drafts go, and this step's plan and drafts. The policy reads and records it; the decoder
    fills in the step's drafts."""

    drafter: Drafter
    runs: Runs = field(default_factory=Runs)  # how far this sequence's drafts go
    reserved: int = 0  # K that extra_tokens reserved for this step
    depth: int = 0  # a tree's depth this step (its K; `reserved` is then its nodes)
    born: int = 0  # the policy's step count when this state was made: the probe phase
    draft: Draft | None = None  # this step's drafts, until they are verified
    tree: Tree | None = None  # this step's draft tree (greedy EAGLE requests with tree_nodes)


@dataclass
class Observed:
    """What the policy has observed; only its observation methods write it."""

    hold_steps: int  # the next hold's length (doubles while checks fail)
    steps: int = 0  # verification steps so far (a burst's passes count one each)
    batch: int = 1  # speculative sequences in the last proposed step
    drafting: float = 0.0  # seconds its drafters took (inside its measured time: `measured`)
    timings: dict[int, Timings] = field(default_factory=dict)  # bucket(batch) → step costs
    draft_ratio: dict[int, float] = field(default_factory=dict)  # id(drafter) → StepCosts.draft
    prior: dict[str, list[float]] = field(default_factory=dict)  # drafter name → rates, all seqs
    hold: Period | None = None  # a step there found its drafts would not pay: none until then
    idle: Period | None = None  # a step planned there gave every adaptive sequence K = 0


class Plan(NamedTuple):
    """A sequence's drafts for a step, before the step as a whole is priced."""

    k: int
    probing: bool = False  # k is a probe's (priced as one good draft: `step_pays`)
    probe_at: int | None = None  # k = 0 until a probe due at this step


@dataclass
class StepPlans:
    """What the plans of a step's sequences found (their `extra_tokens`), for its proposal:
    the decoder gathers them and hands them to `AdaptivePolicy.proposed`."""

    reserved: bool = False  # some sequence reserved drafts (else the step drafts nothing)
    planned: bool = False  # some adaptive sequence's plan had K > 0
    next_probe: int | None = None  # the earliest step a probe of a sequence planned K = 0 is due

    def add(self, plan: Plan, adaptive: bool) -> None:
        """A sequence's plan (`adaptive`: its K is the policy's to choose)."""
        self.planned = self.planned or bool(plan.k and adaptive)
        if plan.probe_at is not None and (
            self.next_probe is None or plan.probe_at < self.next_probe
        ):
            self.next_probe = plan.probe_at


class AdaptivePolicy:
    """The speculative decoder's K per sequence and step, from what it observed (`seen`)."""

    DECAY = 0.8  # of a sequence's acceptance counts, per verification
    PRIOR_WEIGHT = 3.0  # how many verifications the drafter's prior counts as
    PROBE_EVERY = 16
    PLAIN_WARMUP = 4  # plain steps timed at a batch size before anything is priced against them
    PRIOR_ALPHA = 0.6  # a drafter's acceptance per position before any draft of it was scored
    PROBE_ALPHA = 0.9  # the acceptance a probe is priced at: it asks "would good drafts pay?"
    REMEASURE_EVERY = 256
    BACKOFF_BATCH = 8  # from this batch size on, holds double while their checks fail

    def __init__(self, saturation: float, measure_costs: bool = True) -> None:
        self.saturation = saturation
        self.measure_costs = measure_costs
        self.seen = Observed(hold_steps=self.PROBE_EVERY)
        self.choices: dict[tuple, int] = {}  # choose_k's answers under the observed costs

    # ---- costs ------------------------------------------------------------------------------

    def timings_at(self, batch: int) -> Timings:
        """What is measured at `batch`'s bucket (reading it adds no record there)."""
        return self.seen.timings.get(bucket(batch), UNTIMED)

    def plain_seconds(self, batch: int) -> float | None:
        """A plain step of `batch` sequences, in seconds (None: not timed there yet)."""
        timings = self.timings_at(batch)
        if not timings.plain_s or timings.plain_steps < self.PLAIN_WARMUP:
            return None
        return timings.plain_s * (1 + batch / self.saturation)

    def stale(self, timings: Timings) -> bool:
        """No drafting step measured at this batch size, or none lately: price from sizes."""
        return not timings.spec_at or timings.plain_since_spec >= self.REMEASURE_EVERY

    def costs(self, drafter: Drafter, batch: int) -> StepCosts:
        timings = self.timings_at(batch)
        if not self.measure_costs or self.stale(timings):  # sizes: drafting gets (re)measured
            return StepCosts(self.saturation, draft=drafter.cost)
        draft = self.seen.draft_ratio.get(id(drafter), drafter.cost)
        return StepCosts(self.saturation, draft=draft, spec_at=timings.spec_at)

    def alpha(self, state: SeqState, k_max: int) -> tuple[float, ...]:
        """The sequence's acceptance per draft position, on top of the drafter's."""
        prior = self.seen.prior.get(state.drafter.name)
        prior = (self.PRIOR_ALPHA,) * k_max if prior is None else tuple(prior[:k_max])
        return state.runs.rates(prior, self.PRIOR_WEIGHT)

    def choose(self, alpha: Rates, batch: int, k_max: int, drafter: Drafter) -> int:
        """choose_k, remembered until costs are observed again: in a large batch most sequences
        share alpha (the drafter's prior, at K = 0), so a step evaluates the policy a few times,
        not once per sequence."""
        if self.measure_costs and self.stale(self.timings_at(batch)):
            k_max = min(k_max, 1)  # the smallest draft-scoring pass is the one measured first
        key = (alpha, batch, k_max, id(drafter))
        k = self.choices.get(key)
        if k is None:
            k = self.choices[key] = choose_k(alpha, batch, k_max, self.costs(drafter, batch))
        return k

    # ---- plans ------------------------------------------------------------------------------

    def plan(self, seq: Sequence, state: SeqState, batch: int) -> Plan:
        """The sequence's K for this step at `batch` (before the step as a whole is priced)."""
        k_max = seq.decoder_options["num_speculative_tokens"]
        if not seq.decoder_options["adaptive"] or k_max == 0:
            return Plan(k_max)
        seen = self.seen
        if self.measure_costs and self.timings_at(batch).plain_steps < self.PLAIN_WARMUP:
            return Plan(0)  # measure plain decoding first: it is what speculation must beat
        if seen.hold and seen.hold[0] == bucket(batch) and seen.steps < seen.hold[1]:
            return Plan(0)  # a step at this batch size just found its drafts would not pay
        k = self.choose(self.alpha(state, k_max), batch, k_max, state.drafter)
        good_k = self.choose(self.PROBE_ALPHA, batch, k_max, state.drafter) if k == 0 else 0
        if not good_k:
            return Plan(k)
        # Speculation would pay at this batch size if drafts were good: probe now and then, all
        # such sequences in the same step (one draft-scoring step, not many).
        wait = -(seen.steps - state.born + 1) % self.PROBE_EVERY
        if wait == 0:
            return Plan(self.probe_k(batch, good_k), probing=True)
        return Plan(0, probe_at=seen.steps + wait)

    def probe_k(self, batch: int, good_k: int) -> int:
        """A probe drafts what good drafts would (it measures how far runs go, not only the
        first position) where scoring them costs at most 10 % more than scoring one; else 1."""
        s = self.saturation
        return good_k if 1 + batch * (1 + good_k) / s <= 1.1 * (1 + 2 * batch / s) else 1

    def plan_step(
        self, seqs: list[Sequence], states: list[SeqState]
    ) -> tuple[list[int], bool | None]:
        """Each sequence's drafts this step: its reserved K re-planned at the actual batch
        size, all adaptive ones dropped unless together they pay for a draft-scoring step; and
        whether they pay (None: there were none to price), for `proposed`."""
        batch = len(seqs)
        plans = [
            self.plan(s, st, batch) if st.reserved else Plan(0)
            for s, st in zip(seqs, states, strict=True)
        ]
        # (for a tree: its depth; it scores up to `reserved` nodes)
        ks = [min(st.reserved, p.k) for st, p in zip(states, plans, strict=True)]
        if not any(ks):
            return ks, None
        if self.step_pays(seqs, states, plans, ks):
            return ks, True
        return [0] * batch, False

    def step_pays(
        self, seqs: list[Sequence], states: list[SeqState], plans: list[Plan], ks: list[int]
    ) -> bool:
        """Do the adaptive drafts `ks` of this step, together, pay for a draft-scoring step?"""
        if any(k and not s.decoder_options["adaptive"] for s, k in zip(seqs, ks, strict=True)):
            return True  # fixed K drafts anyway: the step scores drafts whatever we decide
        drafts: dict[int, list[tuple[Rates, int]]] = {}  # by drafter: each prices its forwards
        for st, plan, k in zip(states, plans, ks, strict=True):
            if k:  # a probe is priced as one draft: its others cost next to nothing (probe_k)
                priced = (self.PROBE_ALPHA, 1) if plan.probing else (self.alpha(st, k), k)
                drafts.setdefault(id(st.drafter), []).append(priced)
        by_id = {id(st.drafter): st.drafter for st in states}
        batch = len(seqs)
        return all(
            self.costs(by_id[d], batch).step_gain(batch, ds) >= MIN_GAIN for d, ds in drafts.items()
        )

    # ---- quiet steps ------------------------------------------------------------------------

    def quiet_at(self, batch: int) -> bool:
        """Is the next step's K = 0 for every adaptive sequence, without asking the policy?

        While plain decoding is being timed at this batch size, while a hold is on (a step
        found its drafts would not pay), and while the last plan at this batch size gave every
        sequence K = 0 (until the next probe step: an estimate changes only when its sequence
        drafts, and a sequence new to the decoder is planned anyway). Such a step
        costs what an `ar` step does: no per-sequence policy, lookups or bookkeeping.
        """
        return self._quiet_until(batch) is not None

    def quiet_steps(self, batch: int) -> int:
        """How many steps from this one on are quiet at `batch`: until its hold or idle period
        ends. 1 while plain decoding is being timed there: those steps run one by one."""
        until = self._quiet_until(batch)
        return 1 if until is None else until - self.seen.steps

    def _quiet_until(self, batch: int) -> int | None:
        """The step at which the quiet run at `batch` (see `quiet_at`) ends; None: not quiet."""
        seen = self.seen
        if self.measure_costs and self.timings_at(batch).plain_steps < self.PLAIN_WARMUP:
            return seen.steps + 1
        key = bucket(batch)
        ends = [p[1] for p in (seen.hold, seen.idle) if p is not None and p[0] == key]
        return max((end for end in ends if end > seen.steps), default=None)

    # ---- observing --------------------------------------------------------------------------

    def proposed(self, batch: int, plans: StepPlans, quiet: bool, pays: bool | None) -> None:
        """A step of `batch` sequences was proposed after `plans` (made at the last step's
        batch size; `quiet`: without asking the policy per adaptive sequence), its drafts
        priced as a whole by `plan_step` with the answer `pays`."""
        seen = self.seen
        planned_at, seen.batch, seen.drafting = seen.batch, max(batch, 1), 0.0
        if not plans.planned and not quiet:  # the policy said K = 0 to every adaptive sequence
            until = seen.steps + self.PROBE_EVERY  # re-planned at least this often
            until = until if plans.next_probe is None else min(until, plans.next_probe)
            seen.idle = (bucket(planned_at), until)
        if pays:  # estimates change with drafts; a passed check ends the backoff
            seen.idle, seen.hold_steps = None, self.PROBE_EVERY
        elif pays is not None:
            # No drafts at this batch size for a while. In a large batch each check that fails
            # again doubles the wait: a check there costs a lookup per sequence on the step's
            # critical path; in a small one it is cheap and a missed run of good drafts dear.
            key = bucket(batch)
            if seen.hold is None or seen.hold[0] != key or batch < self.BACKOFF_BATCH:
                seen.hold_steps = self.PROBE_EVERY
            seen.hold = (key, seen.steps + seen.hold_steps)
            seen.hold_steps = min(2 * seen.hold_steps, self.REMEASURE_EVERY)

    def stepped(self, passes: int) -> None:
        """`passes` verification steps ran (a burst's passes count one each)."""
        self.seen.steps += passes

    def measured(
        self, batch: int, tokens: int, drafted: bool, ctx: StepContext, passes: int = 1
    ) -> None:
        """A launch of `passes` passes over `batch` speculative rows, `tokens` scored per pass,
        took `ctx.timing` seconds (None: it is not to be priced, e.g. it held a prefill): fold
        its cost per pass into the step costs of its batch size. A drafting step's time holds
        its drafters' forwards, which `draft` prices apart: they come off."""
        if not self.measure_costs or ctx.timing is None:
            return
        key = bucket(batch)
        timings = self.seen.timings.get(key)  # (setdefault would build a record every step)
        if timings is None:
            timings = self.seen.timings[key] = Timings()
        spent = ctx.timing - self.seen.drafting if drafted else ctx.timing
        seconds = spent / passes / (1 + tokens / self.saturation)
        if not drafted:
            # The first steps at a batch size can be slow once (allocation, kernel selection):
            # the fastest of them is the baseline, so that drafting is not judged cheap by it.
            if timings.plain_steps < self.PLAIN_WARMUP:
                timings.plain_s = min(timings.plain_s or seconds, seconds)
            else:
                timings.plain_s = ema(timings.plain_s, seconds)
            timings.plain_steps += passes
            timings.plain_since_spec += passes
        elif timings.plain_s:
            timings.spec_at[tokens] = ema(timings.spec_at.get(tokens), seconds / timings.plain_s)
            timings.plain_since_spec = 0
        self.choices.clear()

    def drafter_timed(self, drafter: Drafter, seconds: float, positions: int, rows: int) -> None:
        """A drafter's forwards took `seconds` for `positions` draft positions of `rows`, in
        the step last proposed."""
        self.seen.drafting += seconds
        plain_s = self.timings_at(self.seen.batch).plain_s
        if plain_s:
            per_position = seconds / positions
            ratio = per_position / (1 + rows / self.saturation) / plain_s
            ratios = self.seen.draft_ratio
            ratios[id(drafter)] = ema(ratios.get(id(drafter)), ratio)
            self.choices.clear()

    def record(self, state: SeqState, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts accepted `accepted`: the sequence's runs and its
        drafter's prior learn from it."""
        if drafted == 0:
            return
        state.runs.add(drafted, accepted, self.DECAY)
        prior = self.seen.prior.setdefault(state.drafter.name, [self.PRIOR_ALPHA] * MAX_K)
        for i in range(min(accepted + 1, drafted)):  # a slow average over all sequences
            prior[i] += 0.05 * ((i < accepted) - prior[i])
