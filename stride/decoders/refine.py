"""The iterative-refinement decoder family behind one registry name, chosen by `method`.

`{"type": "refine", "method": "jacobi" | "lookahead" | "diffusion", ...}`: Jacobi and lookahead
refine guesses inside the target's shared forward (greedy only, lossless); diffusion unmasks
blocks on a masked diffusion LM of its own, run as a separate model group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from stride.decoders.base import (
    Commit,
    Decoder,
    DecoderError,
    DecodersConfig,
    ModelGroup,
    Proposal,
    StepContext,
)
from stride.decoders.diffusion import DiffusionGroup
from stride.decoders.jacobi import Jacobi
from stride.decoders.lookahead import Lookahead
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence

METHODS = ("jacobi", "lookahead", "diffusion")


class Refine(Decoder):
    name = "refine"

    def __init__(self, diffusion: DiffusionGroup | None = None) -> None:
        self.causal: dict[str, Decoder] = {"jacobi": Jacobi(), "lookahead": Lookahead()}
        self.diffusion = diffusion

    @classmethod
    def from_config(cls, engine: Engine, config: DecodersConfig) -> Refine:
        if config.diffusion_model is None:
            return cls()
        group = DiffusionGroup.load(
            config.diffusion_model,
            engine.tokenizer,
            engine.device,
            engine.dtype,
            config.trust_remote_code,
        )
        return cls(group)

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        options = dict(options)
        method = options.pop("method", "jacobi")
        if method == "diffusion":
            if self.diffusion is None:
                raise DecoderError(
                    "refine method 'diffusion' needs a diffusion model; start the server with "
                    "--diffusion-model PATH"
                )
            return self.diffusion.validate(params, options)
        if method not in self.causal:
            raise DecoderError(f"unknown refine method {method!r}; valid: {', '.join(METHODS)}")
        return {"method": method, **self.causal[method].validate(params, options)}

    def model_group(self, seq: Sequence) -> ModelGroup | None:
        return self.diffusion if seq.decoder_options["method"] == "diffusion" else None

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
        logits: list[torch.Tensor],
        ctx: StepContext,
    ) -> list[Commit]:
        out: list[Commit] = [Commit([], [])] * len(seqs)
        for method, idx in _by_method(seqs).items():
            commits = self.causal[method].commit(
                [seqs[i] for i in idx], [proposals[i] for i in idx], [logits[i] for i in idx], ctx
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
