"""What the decoders buy: tokens per target pass, and speculation's drafts and acceptance.

Fed when a request finishes, from the summary its decoder returns with its last output
(`decoder_stats`), by its `tracker.RequestTracker`. The speculative counters' series exist from
the start for the speculative strategies on offer only (and the draft positions up to the
server's default K): only speculative decoding drafts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from stride.metrics.buckets import TOKENS_PER_PASS_BUCKETS


class DecoderMetrics:
    """The decoders' metrics, by model, strategy and (for counts) user."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, md, mdu = registry, ["model", "decoder"], ["model", "decoder", "user"]
        self.forward_passes = Counter(
            "stride_decoder_forward_passes",
            "Target forward passes that produced tokens for a request.",
            mdu,
            registry=r,
        )
        self.tokens_per_pass = Histogram(
            "stride_decoder_tokens_per_pass",
            "Per request: mean tokens committed per forward pass (refinement, speculation).",
            md,
            buckets=TOKENS_PER_PASS_BUCKETS,
            registry=r,
        )
        self.spec_drafts = Counter(
            "stride_spec_drafts", "Speculative: verification passes that checked a draft.", mdu,
            registry=r,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            "stride_spec_draft_tokens", "Speculative: tokens proposed by the drafter.", mdu,
            registry=r,
        )  # fmt: skip
        self.spec_accepted_tokens = Counter(
            "stride_spec_accepted_tokens", "Speculative: drafted tokens the target accepted.",
            mdu, registry=r,
        )  # fmt: skip
        self.spec_accepted_by_position = Counter(
            "stride_spec_accepted_tokens_by_position",
            "Speculative: accepted drafted tokens by their position in the draft (0-based).",
            ["model", "decoder", "position"],
            registry=r,
        )
