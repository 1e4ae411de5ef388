"""The iterative-refinement decoder family behind one registry name, chosen by `method`.

`{"type": "refine", "method": "jacobi" | "lookahead" | "introspective" | "diffusion", ...}`:
Jacobi and lookahead refine guesses inside the target's shared forward (greedy only, lossless);
introspective makes its guesses at MASK slots of the same forward through a MASK-slot adapter
(greedy and sampled, lossless; needs an adapter for the model); diffusion unmasks blocks on a
masked diffusion LM of its own, run as a separate model group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from stride import adapters
from stride.decoders.base import (
    Commit,
    Decoder,
    DecoderError,
    DecodersConfig,
    ModelGroup,
    Proposal,
    Scored,
    StepContext,
    Variants,
)
from stride.decoders.catalog import DIFFUSION, INTROSPECTIVE, JACOBI, LOOKAHEAD, REFINE
from stride.decoders.diffusion import DiffusionGroup, DiffusionOptions
from stride.decoders.introspective import Introspective, IntrospectiveOptions
from stride.decoders.jacobi import Jacobi, JacobiOptions
from stride.decoders.lookahead import Lookahead, LookaheadOptions
from stride.engine.adapter import MaskAdapter
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence

METHODS = Variants(  # one per `catalog.REFINE_METHODS`
    key="method",
    what="refine method",
    models={
        JACOBI: JacobiOptions,
        LOOKAHEAD: LookaheadOptions,
        INTROSPECTIVE: IntrospectiveOptions,
        DIFFUSION: DiffusionOptions,
    },
    default=JACOBI,
)


class Refine(Decoder):
    name = REFINE
    options_model = METHODS

    def __init__(
        self, diffusion: DiffusionGroup | None = None, adapter: MaskAdapter | None = None
    ) -> None:
        """`adapter`: a MASK-slot adapter attached to the engine's runner (`introspective`)."""
        self.causal: dict[str, Decoder] = {JACOBI: Jacobi(), LOOKAHEAD: Lookahead()}
        if adapter is not None:
            self.causal[INTROSPECTIVE] = Introspective(adapter)
        self.diffusion = diffusion

    @classmethod
    def from_config(cls, engine: Engine, config: DecodersConfig) -> Refine:
        group = adapter = None
        if config.diffusion_model is not None:
            group = DiffusionGroup.load(
                config.diffusion_model,
                engine.tokenizer,
                engine.device,
                engine.dtype,
                config.trust_remote_code,
            )
        path = adapters.pick(config.mask_adapter, engine.name)
        if path is not None and engine.workers is not None:
            raise ValueError(
                f"the MASK-slot adapter {path} (refine method introspective) does not run on a "
                "model split over devices; serve it with --tensor-parallel-size 1"
            )
        if path is not None:
            adapter = MaskAdapter.load(path, engine.model)
            engine.runner.attach_adapter(adapter)
        return cls(group, adapter)

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        method, options = METHODS.split(options)
        if method == DIFFUSION:
            if self.diffusion is None:
                raise DecoderError(
                    "refine method 'diffusion' needs a diffusion model; start the server with "
                    "--diffusion-model PATH"
                )
            return self.diffusion.validate(params, options)
        if method not in self.causal:
            raise DecoderError(
                "refine method 'introspective' needs a MASK-slot adapter for this model; start "
                "the server with --mask-adapter DIR (python -m stride.train --kind introspective "
                "trains one)"
            )
        return {"method": method, **self.causal[method].validate(params, options)}

    def model_group(self, seq: Sequence) -> ModelGroup | None:
        return self.diffusion if seq.decoder_options["method"] == DIFFUSION else None

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        return self._of(seq).extra_tokens(seq, cap)

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        out: list[Proposal] = [Proposal()] * len(seqs)
        for method, idx in _by_method(seqs).items():
            props = self.causal[method].propose([seqs[i] for i in idx], ctx)
            for i, prop in zip(idx, props, strict=True):
                out[i] = prop
        return out

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        scored: Scored,
        ctx: StepContext,
    ) -> list[Commit]:
        out: list[Commit] = [Commit([], [])] * len(seqs)
        for method, idx in _by_method(seqs).items():
            part = Scored(
                None if scored.logits is None else [scored.logits[i] for i in idx],
                None if scored.tokens is None else [scored.tokens[i] for i in idx],
                None if scored.logprobs is None else [scored.logprobs[i] for i in idx],
                None if scored.drawn_from is None else [scored.drawn_from[i] for i in idx],
            )
            commits = self.causal[method].commit(
                [seqs[i] for i in idx], [proposals[i] for i in idx], part, ctx
            )
            for i, commit in zip(idx, commits, strict=True):
                out[i] = commit
        return out

    def _of(self, seq: Sequence) -> Decoder:
        return self.causal[seq.decoder_options["method"]]


def _by_method(seqs: list[Sequence]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, seq in enumerate(seqs):
        groups[seq.decoder_options["method"]].append(i)
    return groups
