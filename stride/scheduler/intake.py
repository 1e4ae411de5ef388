"""Intake: a request checked against what this engine can do, and its sequence built.

The HTTP edge has validated the request's shape; what depends on the engine is checked here:
the context and the KV cache it needs, its token ids, its decoder and that decoder's options
(`Decoder.validate`), and its grammar (compiled, or a clear error). Nothing is touched until all
of it passes: a rejected request leaves no trace.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from stride.decoders.base import Decoder, DecoderError
from stride.decoders.grammar import GrammarError, Grammars
from stride.engine.engine import Engine
from stride.engine.sequence import Sequence
from stride.scheduler.outputs import GenerateRequest, RequestRejected


class Intake:
    def __init__(self, engine: Engine, decoders: Mapping[str, Decoder]) -> None:
        self.engine = engine
        self.decoders = decoders
        self.grammars = Grammars(engine.tokenizer, engine.hf_config.vocab_size, engine.eos_ids)

    def sequence(self, req: GenerateRequest) -> tuple[Sequence, bool]:
        """`req`'s sequence, and whether a model group runs it; or RequestRejected."""
        n_prompt, p = len(req.prompt_ids), req.params
        if n_prompt == 0:
            raise RequestRejected("the prompt is empty", param="prompt")
        if n_prompt + p.max_tokens > self.engine.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {n_prompt} and max_tokens asks for {p.max_tokens}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        cache = self.engine.cache
        if -(-(n_prompt + p.max_tokens) // cache.block_size) > cache.num_usable_blocks:
            raise RequestRejected(
                "prompt plus max_tokens do not fit in this server's KV cache",
                code="context_length_exceeded",
                param="max_tokens",
            )
        vocab = self.engine.hf_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_ids):
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        decoder = self.decoders.get(req.decoder)
        if decoder is None:
            raise RequestRejected(
                f"unknown decoder {req.decoder!r}; valid decoders: {', '.join(self.decoders)}",
                code="invalid_decoder",
                param="decoder",
            )
        try:
            options = decoder.validate(p, req.decoder_options)
        except DecoderError as e:
            raise RequestRejected(str(e), code="invalid_decoder", param="decoder") from e

        seq = Sequence(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            params=p,
            decoder=req.decoder,
            decoder_options=options,
            priority=req.priority,
            deadline=None if req.timeout is None else time.monotonic() + req.timeout,
        )
        grouped = decoder.model_group(seq) is not None
        if p.constraint is not None:
            if grouped:
                raise RequestRejected(
                    f"structured outputs are not supported by decoder {req.decoder!r} "
                    f"with these options ({seq.decoder_options})",
                    code="invalid_decoder",
                    param="decoder",
                )
            try:
                seq.grammar = self.grammars.matcher(p.constraint)
            except GrammarError as e:
                raise RequestRejected(str(e), param="response_format") from e
        if p.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has no logprob
        decoder.admit(seq)  # (what the decoder sets up on the new sequence only)
        return seq, grouped

