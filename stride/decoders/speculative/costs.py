"""The cost model of speculation: tokens a target pass yields with K drafts, what a step costs,
and the K that maximises goodput (see `policy` for how the inputs are measured).

With a_i the chance that draft i passes once drafts 0..i-1 have, K drafts yield
E(K) = 1 + a_0 + a_0·a_1 + … + a_0·…·a_(K-1) tokens per target pass. A step with K drafts costs
T(K) = spec·(1 + B(1+K)/S) + K·draft·(1 + B/S) and a plain one T0 = plain·(1 + B/S): a forward
grows with the tokens it scores once past S "saturation" tokens (where the device turns from
memory- to compute-bound: 16 on CPU, 256 on GPU), and each draft position is one batched
drafter forward. B is the number of speculative sequences in the step. Goodput relative to
plain decoding is G(K) = E(K)·T0/T(K); the best K is the one with the largest G, and K = 0
(plain decoding, no drafter work) unless the best G beats 1 by 5 %.
"""

from __future__ import annotations

from dataclasses import dataclass

Rates = float | tuple[float, ...]  # acceptance per draft position; a float: the same at each
MIN_GAIN = 1.05  # speculation must beat plain decoding by this much to be chosen


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
    """The goodput-maximising number of drafts; 0 when none pays."""
    best_k, best_gain = 0, 1.0
    for k in range(1, k_max + 1):
        gain = costs.gain(alpha, batch, k)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k if best_gain >= MIN_GAIN else 0


def bucket(batch: int) -> int:
    """Batch sizes whose step costs are measured together: 1, 2, 3-4, 5-8, …, 33-64, …"""
    return (max(batch, 1) - 1).bit_length()


@dataclass
class Timings:
    """Measured step costs at one batch-size bucket."""

    plain_s: float | None = None  # a plain step, seconds per token-count factor
    spec: float | None = None  # StepCosts.spec measured, relative to plain_s
    plain_since_spec: int = 0  # plain steps timed since a drafting step was last timed
    plain_steps: int = 0  # plain steps timed in all


def ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """An exponential moving average: wall times drift, ratios of recent ones stay sensible."""
    return new if old is None else old + weight * (new - old)
