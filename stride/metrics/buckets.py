"""Bucket boundaries of Stride's histograms: where each one must resolve what it measures."""

from __future__ import annotations

# Fine at the low end: CPU/GPU decode steps and inter-token gaps are often well under 10 ms.
STEP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
ITL_BUCKETS = STEP_BUCKETS
# A request's latencies: from a millisecond to minutes.
REQUEST_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
    2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
TOKENS_PER_STEP_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384
TOKENS_PER_PASS_BUCKETS = (1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0,
                           32.0, 64.0)  # fmt: skip
