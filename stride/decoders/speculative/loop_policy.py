"""Which draft shape EAGLE's device loop runs for a batch of adaptive requests, or none.

Where the loop serves EAGLE (a GPU with graphs), an adaptive EAGLE request drafts only there:
a step that drafts on the host pays a round trip per pass and loses to plain decoding on such
a device. The candidates of a batch are its requests' `menu`: a chain of K drafts and a tree
(the requests' own, else `DEFAULT_TREE`). Each has a rate measured per batch-size bucket
(`costs.bucket`): tokens the batch commits per second of its bursts, each timed from the
previous launch's end to its commit, so that the host's work between bursts (which plain steps
in flight hide) counts against the loop. Plain decoding has its own, from the plain steps the
speculative policy times. The batch runs the fastest, and plain decoding unless a shape beats
it by `MIN_GAIN`.

What is not measured yet at a bucket is tried once plain decoding has been timed there; a
candidate not chosen is tried again after `RETRY_EVERY` steps, so that a rate measured on
other prompts cannot pin the choice, and each time such a retry loses again its wait doubles,
up to `MAX_WAIT` steps: a shape that does not pay at a batch size costs a few cycles now and
then, not a share of every minute. A try runs `TRY_CYCLES` cycles, the chosen shape as many as
a burst takes. A rate is a moving average over bursts (`costs.ema`) of seconds and tokens per
cycle: both drift with the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from stride.decoders.speculative.costs import MIN_GAIN, bucket, ema
from stride.decoders.speculative.device_tree import TreeShape

DEFAULT_TREE = TreeShape.of(64, 7, 8)  # EAGLE-2's tree: 64 drafts, 7 levels, 8 children a node


def menu(options: dict) -> tuple[TreeShape, ...]:
    """The shapes an adaptive EAGLE request may draft in the loop: a chain of its K drafts, and
    its tree (`tree_nodes` drafts, K levels) or `DEFAULT_TREE` if it named none (0: no tree)."""
    k, nodes = options["num_speculative_tokens"], options.get("tree_nodes")
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
                return Choice(shape, self.TRY_CYCLES)
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

    def measured(
        self, batch: int, shape: TreeShape, cycles: int, seconds: float, tokens: int, step: int
    ) -> None:
        """A burst of `cycles` cycles of `shape` over `batch` sequences committed `tokens` in
        `seconds`, starting at `step`."""
        key = (bucket(batch), shape)
        old = self.rates.get(key)
        per_cycle, made = seconds / cycles, tokens / (cycles * batch)
        if old is None:
            self.rates[key] = Rate(per_cycle, made)
        else:
            self.rates[key] = Rate(ema(old.seconds, per_cycle), ema(old.tokens, made))
        self.tried[key] = step
