"""What the decoders' policies measure with: batch-size buckets, moving averages of wall times,
and the gain a mode must show over plain decoding to be chosen.

Speculation's policies (`speculative.policy`, `speculative.loop_policy`) and refining's
`payoff` all price their modes against plain decoding with these, so that a batch of a given
size is judged the same way whichever family runs it.
"""

from __future__ import annotations

MIN_GAIN = 1.05  # a mode must beat plain decoding by this much to be chosen


def bucket(batch: int) -> int:
    """Batch sizes whose step costs are measured together: 1, 2, 3-4, 5-8, …, 33-64, …"""
    return (max(batch, 1) - 1).bit_length()


def ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """An exponential moving average: wall times drift, ratios of recent ones stay sensible."""
    return new if old is None else old + weight * (new - old)
