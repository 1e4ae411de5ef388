"""The roofline's metrics: what the target's forward passes cost, under the device's peaks.

`stride.engine.roofline` counts each step's load from the model's shapes; here its bytes read,
FLOPs, passes and wall time are counters by `decoder`, the registry name of the decoder of every
sequence the step scored (`ar`, `speculative`, `refine`; `mixed` when several), so achieved
bandwidth, FLOP/s and arithmetic intensity are ratios of their rates, and the device's peaks are
gauges: the roof they sit under.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from stride.metrics.labels import SCORED_KINDS, STEP_DECODER_MIXED

if TYPE_CHECKING:
    from stride.engine.roofline import StepLoad


class RooflineMetrics:
    """The roofline counters and peaks of one model, fed with each step's load."""

    def __init__(self, registry: CollectorRegistry, model: str, decoders: Iterable[str]) -> None:
        """`decoders`: the registry names of the decoders on offer (their series exist from
        the start, and `mixed`'s)."""
        r, mstep = registry, ["model", "decoder"]
        self.model = model
        self.read_bytes = Counter(
            "stride_engine_read_bytes",
            "Bytes the target's forward passes read (weights once per pass, the K/V of the "
            "context attended), counted from the model's shapes; by the decoder of the step's "
            "sequences (mixed: several).",
            mstep, registry=r,
        )  # fmt: skip
        self.flops = Counter(
            "stride_engine_flops",
            "Floating-point operations of the target's forward passes (linear maps, LM head, "
            "attention), counted from the model's shapes; by the decoder of the step's sequences.",
            mstep, registry=r,
        )  # fmt: skip
        self.step_seconds = Counter(
            "stride_engine_step_seconds",
            "Wall time of engine steps that ran the target, by the decoder of their sequences.",
            mstep, registry=r,
        )  # fmt: skip
        self.passes = Counter(
            "stride_engine_forward_passes",
            "Forward passes of the target, by the decoder of their sequences.",
            mstep, registry=r,
        )  # fmt: skip
        self.scored_tokens = Counter(
            "stride_engine_scored_tokens",
            "Tokens the target scored, by kind: decode (a one-token tail), prefill (longer tails: "
            "prompts, recomputation), draft (proposed by a decoder: drafts, Jacobi guesses).",
            ["model", "kind"], registry=r,
        )  # fmt: skip
        # One engine's values: `max` across API processes reads them (the others stay at 0).
        self.peak_bandwidth = Gauge(
            "stride_device_peak_bandwidth_bytes_per_second",
            "The device's memory bandwidth (read plus written), measured at start or given.",
            ["model"], registry=r, multiprocess_mode="max",
        )  # fmt: skip
        self.peak_flops = Gauge(
            "stride_device_peak_flops_per_second",
            "The device's compute peak in the engine's dtype, measured at start or given.",
            ["model"], registry=r, multiprocess_mode="max",
        )  # fmt: skip

        # Children looked up once, so the step loop pays no labels() and the series start at 0.
        self._by_decoder = {
            d: self._children(d) for d in (*dict.fromkeys(decoders), STEP_DECODER_MIXED)
        }
        self._scored = {k: self.scored_tokens.labels(model, k) for k in SCORED_KINDS}
        self._peak_bandwidth = self.peak_bandwidth.labels(model)
        self._peak_flops = self.peak_flops.labels(model)

    def on_step(self, load: StepLoad, step_seconds: float) -> None:
        """What one engine step asked of the target, if it ran it."""
        if not load.passes:
            return
        children = self._by_decoder.get(load.decoder)
        if children is None:  # a decoder registered outside Stride: bounded by the registry
            children = self._by_decoder[load.decoder] = self._children(load.decoder)
        read, flops, seconds, passes = children
        read.inc(load.read_bytes)
        flops.inc(load.flops)
        seconds.inc(step_seconds)
        passes.inc(load.passes)
        for kind, n in zip(SCORED_KINDS, (load.decode_rows, load.prefill_tokens,
                                          load.draft_rows), strict=True):  # fmt: skip
            if n:
                self._scored[kind].inc(n)

    def set_peaks(self, bandwidth: float, flops: float) -> None:
        """The device's roof, once the engine is loaded (it measures it when it starts)."""
        self._peak_bandwidth.set(bandwidth)
        self._peak_flops.set(flops)

    def _children(self, decoder: str) -> tuple[Counter, Counter, Counter, Counter]:
        return tuple(
            c.labels(self.model, decoder)
            for c in (self.read_bytes, self.flops, self.step_seconds, self.passes)
        )
