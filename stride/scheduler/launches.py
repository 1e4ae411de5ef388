"""What a launch is while the device runs it: a batch started and not yet finished, and what
its sequences' decoders get to commit from it once it is (`scored`).

The executor makes these (`executor.Executor`) and keeps at most one in flight; a launch kept
in flight carries its committing rows' samples on the device (`sampled`), which the next
launch's fed rows read, and the draw settings and logprobs that go with them.
"""

from __future__ import annotations

from functools import cached_property

import torch

from stride.decoders import sampling
from stride.decoders.base import Burst, Scored
from stride.decoders.drawn_logprobs import DrawnLogprobs
from stride.engine.runner import SampledTokens
from stride.engine.sequence import Sequence
from stride.scheduler.batch import Batch, StepResult
from stride.scheduler.decoder_set import DecoderSet


class Launch:
    """A batch started on the device and not yet finished."""

    def __init__(self, batch: Batch, passes: int, continuable: bool = False) -> None:
        self.batch = batch
        self.passes = passes
        self.continuable = continuable  # may stay in flight (see the module docstring)
        self.result = StepResult(batch, passes=passes)
        # The last token each committing row samples, on the device (a continuable launch), and
        # whose each of them is (in `sampled`'s order): what the next launch's fed rows read;
        # `tokens`: all of their samples, [steps, B] (rows with penalties count them).
        self.sampled: torch.Tensor | None = None
        self.sampling: list[Sequence] = []
        self.tokens: SampledTokens | None = None
        self.draws: sampling.DrawSettings | None = None  # their settings (the next may reuse)
        self.logprobs: DrawnLogprobs | None = None  # of their draws, where asked for
        # the raw logits [steps, V] of rows drawn without their grammar's mask, by id (`Commit`)
        self.drawn_from: dict[str, torch.Tensor] = {}

    @cached_property
    def rows(self) -> dict[str, int]:
        """Each sampling sequence's row of `sampled`, by request id."""
        return {seq.request_id: i for i, seq in enumerate(self.sampling)}

    decode_only = False  # only decode rows: its time is a measure of decode steps

    def scored(self, decoders: DecoderSet) -> dict[str, Scored]:  # pragma: no cover
        """What the target made of each decoder's live sequences (waits for the device)."""
        raise NotImplementedError


class ForwardLaunch(Launch):
    """One forward pass; `logits[i]` holds plan item i's rows, `tokens` (a continuable launch)
    the samples of its committing rows, drawn on the device."""

    def __init__(self, batch: Batch, logits: list[torch.Tensor], continuable: bool) -> None:
        super().__init__(batch, 1, continuable)
        self.logits = logits
        self.decode_only = all(item.completes_tail and item.num_tail == 1 for item in batch.plan)

    def scored(self, decoders: DecoderSet) -> dict[str, Scored]:
        out = {}
        if self.tokens is not None:
            made = self.tokens.per_sequence()
            lps = None if self.logprobs is None else self.logprobs.per_sequence(made)
            for name, idx in decoders.live(self.batch).items():
                ids = [self.batch.plan[i].seq.request_id for i in idx]
                rows = [self.rows[request_id] for request_id in ids]
                picked = None if lps is None else [lps[r] for r in rows]
                kept = [self.drawn_from.get(i) for i in ids] if self.drawn_from else None
                out[name] = Scored(tokens=[made[r] for r in rows], logprobs=picked, drawn_from=kept)
            return out
        for name, idx in decoders.live(self.batch).items():
            out[name] = Scored(logits=[self.logits[i] for i in idx])
        return out


class BurstLaunch(Launch):
    """`tokens.steps` plain decode steps: each sequence commits one token per step."""

    def __init__(self, batch: Batch, tokens: SampledTokens, continuable: bool) -> None:
        super().__init__(batch, tokens.steps, continuable)
        self.tokens = tokens
        self.decode_only = True

    def scored(self, decoders: DecoderSet) -> dict[str, Scored]:
        assert self.tokens is not None
        made = self.tokens.per_sequence()
        lps = None if self.logprobs is None else self.logprobs.per_sequence(made)
        plan, out = self.batch.plan, {}
        for name, idx in decoders.live(self.batch).items():
            kept = None
            if self.drawn_from:
                kept = [self.drawn_from.get(plan[i].seq.request_id) for i in idx]
            out[name] = Scored(tokens=[made[i] for i in idx],
                               logprobs=None if lps is None else [lps[i] for i in idx],
                               drawn_from=kept)  # fmt: skip
        return out


class LoopLaunch(Launch):
    """A decoder's own passes on the device (`Decoder.burst`); the plan is all its sequences."""

    def __init__(self, batch: Batch, burst: Burst) -> None:
        super().__init__(batch, 1)
        self.burst = burst
