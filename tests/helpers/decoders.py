"""Test-only decoders, registered in every process that serves them: `stride serve`
(`servers.LAUNCH`) and its engine process (`STRIDE_ENGINE_SETUP`).

`slow` (a sleep per step) makes requests last long enough to be cancelled, timed out or drained;
`broken` fails its request mid-stream (a fault the engine pins on that request); `crash` breaks
the engine itself (its next forward pass fails for everyone, as after a lost device), so that the
engine dies and is restarted. This module imports only what an engine imports anyway: an engine
process runs it at every start and restart, before the model loads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.base import Commit, DecodersConfig, Proposal, StepContext
from stride.decoders.registry import DECODERS
from stride.engine.engine import Engine
from stride.engine.sequence import Sequence


class Slow(Autoregressive):
    """Plain decoding, 20 ms per step: long enough to act on a request while it runs."""

    name = "slow"
    delay = 0.02

    def commit(self, seqs, proposals, logits, ctx) -> list[Commit]:
        time.sleep(self.delay)
        return super().commit(seqs, proposals, logits, ctx)


class Broken(Autoregressive):
    """Fails on a sequence's third step: the loop dies after a stream has started."""

    name = "broken"

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        logits: list[torch.Tensor],
        ctx: StepContext,
    ) -> list[Commit]:
        if any(s.num_output_tokens >= 2 for s in seqs):
            raise RuntimeError("injected failure")
        return super().commit(seqs, proposals, logits, ctx)


class Crash(Autoregressive):
    """Commits its first token, and breaks the engine's forward pass for good."""

    name = "crash"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_config(cls, engine: Engine, config: DecodersConfig) -> Crash:
        return cls(engine)

    def commit(self, seqs, proposals, logits, ctx) -> list[Commit]:
        def lost(*args, **kwargs):
            raise RuntimeError("injected device loss")

        self.engine.runner.forward = lost
        return super().commit(seqs, proposals, logits, ctx)


TEST_DECODERS = {cls.name: cls for cls in (Slow, Broken, Crash)}


def register_test_decoders() -> None:
    DECODERS.update(TEST_DECODERS)


@contextlib.contextmanager
def extra_decoders() -> Iterator[None]:
    """The test decoders, registered for the block (and left if an outer block registered them:
    requests are checked against the registry as they arrive)."""
    added = [name for name in TEST_DECODERS if name not in DECODERS]
    register_test_decoders()
    try:
        yield
    finally:
        for name in added:
            DECODERS.pop(name, None)
