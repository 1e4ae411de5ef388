"""What speculation pays, priced against plain decoding: the cost model of K drafts, and which
draft shape EAGLE's device loop runs for a batch of adaptive requests, or none.

Both measure per batch-size bucket with moving averages of wall times, and choose speculation
only where it beats plain decoding by `MIN_GAIN` (`rates`, which the adaptive K policy and
refining's `payoff` use too).

The cost model. With a_i the chance that draft i passes once drafts 0..i-1 have, K drafts yield
E(K) = 1 + a_0 + a_0·a_1 + … + a_0·…·a_(K-1) tokens per target pass. A step with K drafts costs
T(K) = spec·(1 + B(1+K)/S) + K·draft·(1 + B/S) and a plain one T0 = plain·(1 + B/S): a forward
grows with the tokens it scores once past S "saturation" tokens (where the device turns from
memory- to compute-bound: 16 on CPU, 256 on GPU), and each draft position is one batched drafter
forward; where a draft-scoring forward of B(1+K) tokens has been timed, its measured `spec` stands
in for the straight line (`StepCosts.spec_at`: a CPU's GEMM may cost one row's up to 3 rows and
twice that from 4), and a size not timed yet is priced from the nearest one timed
(`StepCosts.scoring`). B is the number of speculative sequences in the step. Goodput relative to
plain decoding is G(K) = E(K)·T0/T(K); the best K is the one with the largest G, and K = 0 (plain
decoding, no drafter work) unless the best G beats 1 by 5 %.

The device loop. Where the loop serves EAGLE (a GPU with graphs), an adaptive EAGLE request
drafts only there: a step that drafts on the host pays a round trip per pass and loses to plain
decoding on such a device. The candidates of a batch are its requests' `menu`: a chain of K
drafts and a tree (the requests' own, else `DEFAULT_TREE`); where a row samples, the sampled
chain alone (trees accept by the argmax). Each has a rate measured per
batch-size bucket (`bucket`): tokens the batch commits per second of its bursts (`Spent`). A
burst right after another is timed from the previous launch's end to its commit, so that the
host's work between bursts (which plain steps in flight hide) counts against the loop; its
share beside the cycles' device time is kept per bucket. A burst after plain steps (a try, or
the first of a choice) pays once for switching: the head catches up on every token decoded
plainly since its last draft. Staying in the loop does not pay that, so such a burst is priced
at its cycles' device time and the bucket's host share (device time alone until a burst in a
row has measured it): a try of a few cycles would otherwise carry the whole switch and price
the shape far above what it costs in a row. Plain decoding has its own rate, from the plain
steps the speculative policy times. The batch runs the fastest, and plain decoding unless a shape
beats it by `MIN_GAIN`.

What is not measured yet at a bucket is tried once plain decoding has been timed there (a try
that cannot start, for want of room or KV blocks, counts as one); a
candidate not chosen is tried again after `RETRY_EVERY` steps, so that a rate measured on
other prompts cannot pin the choice, and each time such a retry loses again its wait doubles,
up to `MAX_WAIT` steps: a shape that does not pay at a batch size costs a few cycles now and
then, not a share of every minute. A try runs `TRY_CYCLES` cycles, the chosen shape as many as
a burst takes. A rate is a moving average over bursts (`ema`) of seconds and tokens per
cycle: both drift with the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from stride.decoders.rates import MIN_GAIN, bucket, ema
from stride.decoders.speculative.device_tree import TreeShape

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
    spec: float = 1.0  # a verification forward that scores drafts, where none was measured
    draft: float = 0.0  # one batched drafter forward (one draft position)
    # `spec` as measured for a forward of so many tokens: a CPU's GEMM may cost the same for 1
    # to 3 rows and twice that from 4, which no saturation describes
    spec_at: dict[int, float] = field(default_factory=dict)

    def scoring(self, tokens: int) -> float:
        """A draft-scoring forward of `tokens` tokens, per unit of `plain`'s factor: as measured
        for that many; else on the straight line from the nearest count measured, below it if
        one was (more tokens never cost less); `spec` where nothing was."""
        ratio = self.spec_at.get(tokens)
        if ratio is None and self.spec_at:
            below = [t for t in self.spec_at if t < tokens]
            ratio = self.spec_at[max(below) if below else min(self.spec_at)]
        return (self.spec if ratio is None else ratio) * (1 + tokens / self.saturation)

    def gain(self, alpha: Rates, batch: int, k: int) -> float:
        """Goodput with k drafts relative to plain decoding."""
        unit = 1 + batch / self.saturation
        step = self.scoring(batch * (1 + k)) + k * self.draft * unit
        return expected_tokens(alpha, k) * self.plain * unit / step

    def step_gain(self, batch: int, drafts: list[tuple[Rates, int]]) -> float:
        """Goodput of a whole step relative to a plain one, for (alpha, k) per drafting sequence.

        `gain` prices a sequence's drafts as if every sequence drafted as many; a step pays one
        draft-scoring forward however few sequences draft in it, so a handful of drafts in a
        large batch (probes) cannot pay for it there."""
        unit = 1 + batch / self.saturation
        tokens = batch + sum(k for _, k in drafts)
        positions = max((k for _, k in drafts), default=0)
        step = self.scoring(tokens) + positions * self.draft * unit
        extra = sum(expected_tokens(alpha, k) - 1 for alpha, k in drafts)
        return (batch + extra) / batch * self.plain * unit / step


def choose_k(alpha: Rates, batch: int, k_max: int, costs: StepCosts) -> int:
    """The goodput-maximising number of drafts; 0 when none pays."""
    best_k, best_gain = 0, 1.0
    for k in range(1, k_max + 1):
        gain = costs.gain(alpha, batch, k)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k if best_gain >= MIN_GAIN else 0


@dataclass
class Timings:
    """Measured step costs at one batch-size bucket."""

    plain_s: float | None = None  # a plain step, seconds per token-count factor
    spec_at: dict[int, float] = field(default_factory=dict)  # StepCosts.spec_at measured
    plain_since_spec: int = 0  # plain steps timed since a drafting step was last timed
    plain_steps: int = 0  # plain steps timed in all


# ---- the device loop ----------------------------------------------------------------------------

DEFAULT_TREE = TreeShape.of(64, 7, 8)  # EAGLE-2's tree: 64 drafts, 7 levels, 8 children a node


def menu(options: dict, sampled: bool = False, ranks: int = 0) -> tuple[TreeShape, ...]:
    """The shapes an adaptive EAGLE request may draft in the loop: a chain of its K drafts, and
    its tree (`tree_nodes` drafts, K levels) or `DEFAULT_TREE` if it named none (0: no tree);
    in a batch where some rows sample, the sampled chain alone (`TreeShape.sampled`, its draws
    ranking `ranks` tokens)."""
    k, nodes = options["num_speculative_tokens"], options.get("tree_nodes")
    if sampled:
        return (TreeShape.chain(k, sampled=True, ranks=ranks),)
    if nodes is None:
        return (TreeShape.chain(k), DEFAULT_TREE)
    if nodes == 0:
        return (TreeShape.chain(k),)
    return (TreeShape.chain(k), TreeShape.of(nodes, k, options["tree_topk"]))


@dataclass
class Rate:
    """A shape's measured cycles at one bucket: per cycle, seconds and tokens per sequence."""

    seconds: float
    tokens: float

    def per_second(self, batch: int) -> float:
        return batch * self.tokens / self.seconds


class Spent(NamedTuple):
    """What a burst took: wall seconds from the previous launch's end to its commit, its cycles'
    seconds on the device, and whether it ran right after a burst of the same sequences."""

    wall: float
    device: float
    in_a_row: bool


class Choice(NamedTuple):
    """The shape a burst drafts, and the most cycles it runs (fewer for a try)."""

    shape: TreeShape
    cycles: int


class LoopPolicy:
    """The device loop's choice per batch (see the module docstring)."""

    RETRY_EVERY = 64  # steps before a candidate not chosen at a bucket is tried again, at first
    MAX_WAIT = 1024  # the longest that wait grows to
    TRY_CYCLES = 4

    def __init__(self, max_batch: int, max_cycles: int) -> None:
        self.max_batch = max_batch  # the most sequences a burst of the loop takes
        self.max_cycles = max_cycles  # the most cycles a burst runs
        self.rates: dict[tuple[int, TreeShape], Rate] = {}
        self.tried: dict[tuple[int, TreeShape], int] = {}  # step of each candidate's last try
        self.waits: dict[tuple[int, TreeShape], int] = {}  # steps until its next retry is due
        self.host_share: dict[int, float] = {}  # per bucket: bursts' host time over device time

    def choose(
        self, batch: int, shapes: tuple[TreeShape, ...], plain_s: float | None, step: int
    ) -> Choice | None:
        """The shape for `batch` sequences at `step` (None: plain decoding), where a plain step
        at this batch size takes `plain_s` seconds (None: not timed yet)."""
        if plain_s is None:
            return None  # what speculation must beat comes first
        key = bucket(batch)
        best, best_rate = None, MIN_GAIN * batch / plain_s
        for shape in shapes:
            rate = self.rates.get((key, shape))
            if rate is None:
                if (key, shape) not in self.tried:  # (a try that could not start: retried below)
                    return Choice(shape, self.TRY_CYCLES)
                continue
            if rate.per_second(batch) > best_rate:
                best, best_rate = shape, rate.per_second(batch)
        if best is not None:
            self.waits.pop((key, best), None)  # a retry that won: its next loss waits least
        stale = min(shapes, key=lambda s: self.tried.get((key, s), -1))
        wait = self.waits.get((key, stale), self.RETRY_EVERY)
        if stale != best and step - self.tried.get((key, stale), -1) >= wait:
            self.waits[(key, stale)] = min(2 * wait, self.MAX_WAIT)  # (if it loses again)
            return Choice(stale, self.TRY_CYCLES)
        return None if best is None else Choice(best, self.max_cycles)

    def plain_steps(self, batch: int, shapes: tuple[TreeShape, ...], step: int) -> int:
        """Plain steps to promise `batch` sequences from `step` on: until a candidate is due
        (more sequences than the loop takes: `RETRY_EVERY`, the batch may shrink meanwhile)."""
        if batch > self.max_batch:
            return self.RETRY_EVERY
        key = bucket(batch)
        due = min(
            self.tried.get((key, s), step - self.RETRY_EVERY)
            + self.waits.get((key, s), self.RETRY_EVERY)
            for s in shapes
        )
        return max(1, due - step)

    def declined(self, batch: int, shape: TreeShape, step: int) -> None:
        """A burst of `shape` chosen for `batch` sequences at `step` could not start (no room
        before a context's end, no KV blocks, no graph wide enough): it counts as tried, so
        that plain steps are promised up to its next retry rather than one at a time."""
        self.tried[(bucket(batch), shape)] = step

    def measured(
        self, batch: int, shape: TreeShape, cycles: int, spent: Spent, tokens: int, step: int
    ) -> None:
        """A burst of `cycles` cycles of `shape` over `batch` sequences, starting at `step`,
        committed `tokens` and took `spent` (priced as the module docstring says)."""
        at = bucket(batch)
        if spent.in_a_row:
            seconds = spent.wall
            if spent.device > 0:
                share = max(0.0, spent.wall / spent.device - 1)
                self.host_share[at] = ema(self.host_share.get(at), share)
        else:
            seconds = spent.device * (1 + self.host_share.get(at, 0.0))
        key = (at, shape)
        old = self.rates.get(key)
        per_cycle, made = seconds / cycles, tokens / (cycles * batch)
        if old is None:
            self.rates[key] = Rate(per_cycle, made)
        else:
            self.rates[key] = Rate(ema(old.seconds, per_cycle), ema(old.tokens, made))
        self.tried[key] = step
