"""Logprobs in OpenAI's two shapes (completions: per token, a map of alternatives; chat: a list
of entries) and vLLM's `prompt_logprobs`, with each token's text decoded once (`Pieces`).

OpenAI and vLLM always list the chosen token among a completion token's `top_logprobs`, also
when it is not one of the top n (a sampled token, an echoed prompt token): so does Stride.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from stride.decoders.sampling import TokenLogprob
from stride.server import response_schemas as rs


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class Pieces:
    """Each token's text on its own (what logprobs name tokens by), decoded once."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._pieces: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self._decode([token_id])
        return text

    def completion_logprobs(
        self, ids: list[int], lps: Sequence[TokenLogprob | None], offset: int
    ) -> rs.CompletionLogprobs:
        out = rs.CompletionLogprobs()
        for token, lp in zip(ids, lps, strict=True):
            text = self(token)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:  # the first prompt token (echo): nothing scores it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_finite(lp.logprob))
                top = {self(t): _finite(v) for t, v in lp.top}
                top.setdefault(text, _finite(lp.logprob))  # the chosen token, always
                out.top_logprobs.append(top)
        return out

    def chat_logprobs(self, lps: Sequence[TokenLogprob | None]) -> rs.ChatLogprobs:
        content = []
        for lp in lps:
            if lp is None:
                continue
            text = self(lp.token_id)
            top = [
                rs.TopLogprob(token=self(t), logprob=_finite(v), bytes=list(self(t).encode()))
                for t, v in lp.top
            ]
            content.append(
                rs.TokenLogprobEntry(
                    token=text,
                    logprob=_finite(lp.logprob),
                    bytes=list(text.encode()),
                    top_logprobs=top,
                )
            )
        return rs.ChatLogprobs(content=content)

    def vllm_prompt_logprobs(
        self, prompt: list[int], lps: list[TokenLogprob | None] | None
    ) -> list[dict[str, rs.PromptLogprob] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (the first: None), the token's own
        logprob and rank, then its alternatives', keyed by token id."""
        out: list[dict[str, rs.PromptLogprob] | None] = []
        for token, lp in zip(prompt, lps or [None] * len(prompt), strict=True):
            if lp is None:
                out.append(None)
                continue
            entry = {
                str(token): rs.PromptLogprob(
                    logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self(token)
                )
            }
            for rank, (t, v) in enumerate(lp.top, 1):
                entry.setdefault(
                    str(t), rs.PromptLogprob(logprob=_finite(v), rank=rank, decoded_token=self(t))
                )
            out.append(entry)
        return out
