"""Masked diffusion decoding: unmask a block of mask tokens by confidence, a few per pass.

Semi-autoregressive over blocks (LLaDA / Fast-dLLM style): a sequence appends `block_size` mask
tokens; every pass predicts all still-masked positions of the block at once and unmasks those
whose confidence (the model's probability of the chosen token) reaches `threshold`, at least the
most confident one, and all of them on the block's `max_iterations`-th pass. Unmasked tokens are
emitted as soon as they form a prefix of the block, so output streams in order.

The diffusion model is its own model group: its sequences never touch the target's scheduler or
KV cache; each engine step runs one batched pass over all of them beside the target forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from stride.decoders import sampling
from stride.decoders.base import Commit, ModelGroup, Options, StepContext, parse_options
from stride.decoders.catalog import DIFFUSION
from stride.engine.diffusion import DiffusionModel
from stride.engine.sequence import SamplingParams, Sequence

MAX_BLOCK = 1024


class DiffusionOptions(Options):
    block_size: int = Field(32, ge=1, le=MAX_BLOCK, description="mask tokens per block")
    threshold: float = Field(0.9, gt=0.0, le=1.0, description="confidence that unmasks")
    max_iterations: int | None = Field(
        None, ge=1, le=MAX_BLOCK, description="passes per block at most (default: block_size)"
    )


@dataclass
class Block:
    """The not yet emitted part of a sequence's current block."""

    tokens: list[int]  # the mask token where still masked
    logprobs: list[sampling.TokenLogprob | None]
    iterations: int = 0


class DiffusionGroup(ModelGroup):
    def __init__(self, model: DiffusionModel, vocab_limit: int | None = None) -> None:
        self.model = model
        self.mask = model.mask_token_id
        self.vocab_limit = vocab_limit  # ids the target's tokenizer can decode

    @classmethod
    def load(
        cls, path: str, target_tokenizer, device: torch.device, dtype, trust_remote_code: bool
    ) -> DiffusionGroup:
        model, tokenizer = DiffusionModel.load(path, device, dtype, trust_remote_code)
        ours, theirs = target_tokenizer.get_vocab(), tokenizer.get_vocab()
        differ = [t for t, i in ours.items() if theirs.get(t) != i]
        if differ:
            raise ValueError(
                f"the diffusion model {path} does not share the target's tokenizer "
                f"({len(differ)} tokens differ, e.g. {differ[:3]}); prompts and outputs use the "
                "target's token ids, so both models need the same vocabulary"
            )
        return cls(model, vocab_limit=len(target_tokenizer))

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        opts = parse_options(DiffusionOptions, options, "refine method 'diffusion'")
        return {
            "method": DIFFUSION,
            "block_size": opts.block_size,
            "threshold": float(opts.threshold),
            "max_iterations": opts.block_size
            if opts.max_iterations is None
            else opts.max_iterations,
        }

    def step(self, seqs: list[Sequence], ctx: StepContext) -> list[Commit]:
        """One batched pass over all `seqs`: unmask what is confident, emit the ready prefix."""
        blocks = [self._block(s) for s in seqs]
        limit = self.model.max_len
        inputs = [(s.token_ids + b.tokens)[-limit:] for s, b in zip(seqs, blocks, strict=True)]
        logits = self.model.forward(inputs, [len(b.tokens) for b in blocks])

        rows, picked, masked = [], [], []
        for seq, block, lg in zip(seqs, blocks, logits, strict=True):
            where = [j for j, t in enumerate(block.tokens) if t == self.mask]
            masked.append(where)
            picked.append(lg[where])
            for j in where:
                pending = [t for t in block.tokens[:j] if t != self.mask]
                rows.append(sampling.Row(seq, pending, ahead=j - len(pending)))
        raw = torch.cat(picked)
        raw[:, self.mask] = float("-inf")  # a mask token must never be an answer
        if self.vocab_limit is not None:
            raw[:, self.vocab_limit :] = float("-inf")
        adjusted = sampling.adjust(raw, rows, ctx.eos_ids)
        tokens = sampling.draw(sampling.probabilities(adjusted, rows), rows)
        chosen = torch.tensor(tokens, device=raw.device)[:, None]
        conf = torch.softmax(adjusted, dim=-1).gather(1, chosen)[:, 0].tolist()
        lps = sampling.logprobs(raw, tokens, rows)

        commits, k = [], 0
        for seq, block, where in zip(seqs, blocks, masked, strict=True):
            n = len(where)
            self._unmask(seq, block, where, tokens[k : k + n], conf[k : k + n], lps[k : k + n])
            commits.append(self._emit(seq, block))
            k += n
        return commits

    def _block(self, seq: Sequence) -> Block:
        if seq.decoder_state is None:
            left = seq.params.max_tokens - seq.num_output_tokens
            size = max(1, min(seq.decoder_options["block_size"], left, self.model.max_len - 1))
            seq.decoder_state = Block([self.mask] * size, [None] * size)
        return seq.decoder_state

    def _unmask(
        self,
        seq: Sequence,
        block: Block,
        where: list[int],
        tokens: list[int],
        conf: list[float],
        lps: list[sampling.TokenLogprob | None],
    ) -> None:
        opts = seq.decoder_options
        block.iterations += 1
        if block.iterations >= opts["max_iterations"]:
            chosen = list(range(len(where)))
        elif opts["threshold"] < 1.0:  # 1.0: one token a pass (fp32 confidences can round to 1)
            chosen = [i for i, c in enumerate(conf) if c >= opts["threshold"]]
        else:
            chosen = []
        if not chosen:
            chosen = [max(range(len(where)), key=conf.__getitem__)]
        for i in chosen:
            block.tokens[where[i]] = tokens[i]
            block.logprobs[where[i]] = lps[i]

    def _emit(self, seq: Sequence, block: Block) -> Commit:
        ready = block.tokens.index(self.mask) if self.mask in block.tokens else len(block.tokens)
        commit = Commit(block.tokens[:ready], block.logprobs[:ready])
        del block.tokens[:ready], block.logprobs[:ready]
        if not block.tokens:
            seq.decoder_state = None  # the next pass opens a new block
        return commit
