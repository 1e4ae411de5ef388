"""Where each engine step stands against the device's limits: an analytic roofline count.

A step's forward passes read the weights once per pass and the K/V of every context they
attend, and do two FLOPs per multiply-add of the layers' linear maps (per scored token), of the
LM head (per logits row) and of attention (per query-key pair). `StepLoad` counts what a step
scored, by kind: decode rows (a one-token tail), prefill tokens (longer tails: prompts, and
recomputation after a preemption), draft rows (tokens a decoder proposed after the tail:
speculative drafts, Jacobi guesses), plus the context they read. `ModelShape` turns those
counts into bytes and FLOPs from the model's own parameter shapes. Nothing is profiled: the
count costs a few additions per sequence and step, and the achieved bandwidth and FLOP/s are
those bytes and FLOPs over the step's wall time (the metrics divide).

What is left out, being small next to the rest or not the target's: embedding lookups (one row
per token), norms, rotary, activations, the K/V written, and the passes of draft models, EAGLE
heads and diffusion model groups. A step's masks (trees, lookahead branches) are counted as
causal.

The device's peaks (`DevicePeaks`) come from a short measurement when the engine starts: a
device-to-device copy (bytes read plus written per second, as `bench/bench_gpu.py` measures
it) and a matmul in the engine's dtype. Either can be given instead (`--peak-bandwidth`,
`--peak-flops`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from stride.engine.sequence import Sequence
from stride.engine.spans import Span

MIXED = "mixed"  # the decoder label of a step whose sequences use several decoders


@dataclass(frozen=True)
class ModelShape:
    """Per-pass, per-token and per-pair costs of one model, from its parameters."""

    layer_bytes: int  # weights a pass reads whatever it scores: every layer, the final norm
    head_bytes: int  # the LM head's weight, read by a pass that computes logits
    layer_macs_per_token: int  # multiply-adds of the layers' linear maps for one token
    head_macs_per_row: int  # of the LM head for one logits row
    attention_macs_per_pair: int  # of QKᵀ and PV for one (query, key) pair, all layers
    kv_bytes_per_token: int  # K and V of one token, all layers

    @classmethod
    def of(cls, model: torch.nn.Module, kv_dtype: torch.dtype) -> ModelShape:
        """`model`: a `CausalLM` (its `model.layers`, `model.norm`, `lm_head`)."""
        layers = model.model.layers
        layer_params = [p for p in layers.parameters()] + list(model.model.norm.parameters())
        linear = [m.weight for m in layers.modules() if isinstance(m, torch.nn.Linear)]
        head = model.lm_head.weight
        attn = layers[0].self_attn
        item = torch.empty((), dtype=kv_dtype).element_size()
        return cls(
            layer_bytes=sum(p.numel() * p.element_size() for p in layer_params),
            head_bytes=head.numel() * head.element_size(),
            layer_macs_per_token=sum(w.numel() for w in linear),
            head_macs_per_row=head.numel(),
            attention_macs_per_pair=2 * len(layers) * attn.num_heads * attn.head_dim,
            kv_bytes_per_token=2 * len(layers) * attn.num_kv_heads * attn.head_dim * item,
        )

    def read_bytes(self, load: StepLoad) -> int:
        return (
            load.passes * self.layer_bytes
            + load.passes_with_logits * self.head_bytes
            + load.kv_tokens_read * self.kv_bytes_per_token
        )

    def flops(self, load: StepLoad) -> int:
        return 2 * (
            load.tokens * self.layer_macs_per_token
            + load.logits_rows * self.head_macs_per_row
            + load.attention_pairs * self.attention_macs_per_pair
        )


@dataclass(slots=True)
class StepLoad:
    """What one engine step asked of the target model, counted as it was launched.

    Plain data: it crosses to the server process with the step's other numbers (`StepStats`).
    `decoder` is the one decoder of every sequence the step scored, `mixed` if several, empty
    if it scored none. `read_bytes` and `flops` are filled by `priced` (the engine's shape).
    """

    decoder: str = ""
    passes: int = 0  # forward passes of the target
    passes_with_logits: int = 0  # of those, the ones that ran the LM head
    decode_rows: int = 0  # one-token tails
    prefill_tokens: int = 0  # tails of several tokens (prompts, recomputation)
    draft_rows: int = 0  # tokens decoders proposed after the tails
    logits_rows: int = 0
    kv_tokens_read: int = 0  # context tokens whose K/V the passes read, summed over sequences
    attention_pairs: int = 0  # (query, key) pairs attended
    read_bytes: int = 0
    flops: int = 0

    @property
    def tokens(self) -> int:
        return self.decode_rows + self.prefill_tokens + self.draft_rows

    def add_forward(self, spans: list[Span], tails: list[int]) -> None:
        """One forward pass over `chunks`; `tails[i]`: how many of chunk i's tokens are its
        sequence's tail (the rest were proposed by its decoder)."""
        self.passes += 1
        self.passes_with_logits += any(c.num_logits for c in spans)
        for span, tail in zip(spans, tails, strict=True):
            seq, n = span.seq, len(span.token_ids)
            self._decoder(seq.decoder)
            if tail == 1:
                self.decode_rows += 1
            else:
                self.prefill_tokens += tail
            self.draft_rows += n - tail
            self.logits_rows += span.num_logits
            context = seq.num_cached + span.offset
            self.kv_tokens_read += context + n
            self.attention_pairs += n * context + n * (n + 1) // 2  # causal

    def add_decode_steps(
        self, seqs: list[Sequence], steps: int, offsets: list[int] | None = None
    ) -> None:
        """`steps` fused decode steps of one row per sequence, sequence i's after `offsets[i]`
        pending tokens (a launch that continues one in flight: each context that much longer)."""
        rows = len(seqs)
        self.passes += steps
        self.passes_with_logits += steps
        self.decode_rows += rows * steps
        self.logits_rows += rows * steps
        for seq in seqs:
            self._decoder(seq.decoder)
        # Step s (0-based) of a sequence with `c` cached tokens reads c + offset + s + 1 of them.
        context = sum(seq.num_cached for seq in seqs) + sum(offsets or ())
        read = steps * context + rows * steps * (steps + 1) // 2
        self.kv_tokens_read += read
        self.attention_pairs += read

    def add_burst(self, seqs: list[Sequence], passes: list[int], drafted: list[int]) -> None:
        """A decoder's passes on the device (`Decoder.burst`): per sequence, its verification
        passes and the draft rows they scored, counted once the burst committed."""
        self.passes += max(passes, default=0)
        self.passes_with_logits += max(passes, default=0)
        for seq, p, d in zip(seqs, passes, drafted, strict=True):
            self._decoder(seq.decoder)
            self.decode_rows += p
            self.draft_rows += d
            self.logits_rows += p + d
            rows = p + d  # over p passes of about (1 + d / p) rows each, after num_cached
            self.kv_tokens_read += p * seq.num_cached + rows
            self.attention_pairs += rows * seq.num_cached + rows * (rows // max(p, 1) + 1) // 2

    def priced(self, shape: ModelShape) -> StepLoad:
        self.read_bytes = shape.read_bytes(self)
        self.flops = shape.flops(self)
        return self

    def _decoder(self, name: str) -> None:
        if self.decoder != name:
            self.decoder = name if not self.decoder else MIXED


def decoder_labels(names: Iterable[str]) -> tuple[str, ...]:
    """The `decoder` labels of step metrics for decoders `names` (registry names), and mixed."""
    return (*dict.fromkeys(names), MIXED)


# ---- the device's peaks ----------------------------------------------------------------------


@dataclass(frozen=True)
class DevicePeaks:
    """The roof: memory bandwidth (bytes/s, read plus written) and compute (FLOP/s)."""

    bandwidth: float
    flops: float


# Sizes of the start-up measurement: big enough to leave the caches on a GPU (50 MiB of L2 on
# an H100), small enough to take milliseconds; on a CPU a quick figure of the same kind.
_COPY_BYTES = {"cuda": 512 << 20, "cpu": 32 << 20}
_MATMUL_N = {"cuda": 8192, "cpu": 512}


def device_peaks(
    device: torch.device,
    dtype: torch.dtype,
    bandwidth: float | None = None,
    flops: float | None = None,
) -> DevicePeaks:
    """The given peaks, and a measurement of each one not given (run before the KV cache takes
    the device's memory: the measurement needs a few hundred MiB on a GPU). A process measures
    a device once: an engine restarted, or the many engines of a test run, reuse the figure."""
    if bandwidth is None:
        bandwidth = _measured(str(device), "bandwidth", dtype)
    if flops is None:
        flops = _measured(str(device), "flops", dtype)
    return DevicePeaks(float(bandwidth), float(flops))


@functools.cache
def _measured(device: str, what: str, dtype: torch.dtype) -> float:
    where = torch.device(device)
    value = copy_bandwidth(where) if what == "bandwidth" else matmul_flops(where, dtype)
    if where.type == "cuda":
        torch.cuda.empty_cache()
    return value


def copy_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes read plus written per second by a device-to-device copy (the median of a few)."""
    size = _COPY_BYTES.get(device.type, _COPY_BYTES["cpu"])
    src = torch.ones(size // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _timed(device, lambda: dst.copy_(src), repeats)
    return 2 * size / seconds


def matmul_flops(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (bf16 on a GPU), the median of a few."""
    n = _MATMUL_N.get(device.type, _MATMUL_N["cpu"])
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    seconds = _timed(device, lambda: a @ b, repeats)
    return 2 * n**3 / seconds


def _timed(device: torch.device, work, repeats: int) -> float:
    """Median seconds of `work()` on `device`."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
    return max(sorted(times)[len(times) // 2], 1e-9)
