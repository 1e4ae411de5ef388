"""/v1/completions as a view: text choices, echoed prompts, logprobs per token, and best_of's
pick of the samples with the best mean logprob. A streamed chunk has the whole response's shape.
"""

from __future__ import annotations

from collections.abc import Sequence

from stride.decoders.sampling import TokenLogprob
from stride.scheduler.outputs import RequestOutput
from stride.server import request_schemas as rq
from stride.server import response_schemas as rs
from stride.server.logprobs import Pieces
from stride.server.views import Choice, View


class CompletionView(View):
    CHUNK = rs.CompletionResponse  # a streamed chunk is shaped as the whole response
    body: rq.CompletionRequest

    def __init__(
        self,
        model_name: str,
        pieces: Pieces,
        body: rq.CompletionRequest,
        rid: str,
        prompts: list[list[int]],
        echo: list[str],
        samples: int | None = None,
        generated: bool = True,
    ) -> None:
        super().__init__(model_name, pieces, body, rid, prompts, samples)
        self.generated = generated
        self.echo = echo
        self.offsets = [0] * len(self.choices)
        # Echoed prompts whose logprobs are asked for go out with the choice's first tokens,
        # which bring them.
        self.echo_later = [body.echo and body.logprobs is not None] * len(self.choices)

    def _prompt_of(self, index: int) -> int:
        return index // self.samples

    def _logprobs(self, index: int, ids: list[int], lps: Sequence) -> rs.CompletionLogprobs:
        out = self.pieces.completion_logprobs(ids, lps, self.offsets[index])
        if out.text_offset:
            self.offsets[index] = out.text_offset[-1] + len(out.tokens[-1])
        return out

    def response(self) -> rs.CompletionResponse:
        choices = []
        for i in self._returned():
            c, prompt = self.choices[i], self.prompts[self._prompt_of(i)]
            logprobs = None
            if self.body.logprobs is not None:
                ids, lps = c.token_ids, c.logprobs
                if self.body.echo:
                    ids, lps = prompt + ids, self._prompt_lps(c, prompt) + lps
                logprobs = self._logprobs(i, ids, lps)
            choices.append(
                rs.CompletionChoice(
                    index=len(choices),
                    text=self.echo[self._prompt_of(i)] + c.text,
                    logprobs=logprobs,
                    finish_reason=c.last.finish_reason,
                    stop_reason=c.last.stop_reason,
                    prompt_logprobs=self._vllm_prompt(c, prompt),
                )
            )
        return self._chunk_of(choices, self.usage())

    def _returned(self) -> list[int]:
        """The choices that return, in order: all of them, or with best_of the n samples of
        each prompt with the best mean logprob."""
        n, samples = self.body.n, self.samples
        if samples == n:
            return list(range(len(self.choices)))
        out = []
        for start in range(0, len(self.choices), samples):
            ranked = sorted(range(start, start + samples),
                            key=lambda i: -self.choices[i].mean_logprob())  # fmt: skip
            out += sorted(ranked[:n])
        return out

    @staticmethod
    def _prompt_lps(c: Choice, prompt: list[int]) -> list[TokenLogprob | None]:
        return c.prompt_logprobs if c.prompt_logprobs is not None else [None] * len(prompt)

    def _vllm_prompt(self, c: Choice, prompt: list[int]) -> list | None:
        if self.body.prompt_logprobs is None:
            return None
        return self.pieces.vllm_prompt_logprobs(prompt, c.prompt_logprobs)

    @property
    def shaped(self) -> bool:
        return self.usage_always or any(self.echo_later) or self.body.prompt_logprobs is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.body.logprobs is not None

    def opening(self) -> list[rs.Response]:
        if not self.body.echo or self.body.logprobs is not None:
            return []  # (with logprobs: with the first tokens)
        chunks = []
        for i in range(len(self.choices)):
            choice = rs.CompletionChoice(index=i, text=self.echo[self._prompt_of(i)])
            chunks.append(self._chunk_of([choice]))
        return chunks

    def delta(self, index: int, out: RequestOutput) -> rs.Response | None:
        wants_logprobs = self.body.logprobs is not None and out.token_ids
        if not (out.text or out.finished or wants_logprobs):
            return None
        prompt = self.prompts[self._prompt_of(index)]
        text, ids, lps = out.text, out.token_ids, out.logprobs
        if self.echo_later[index]:
            self.echo_later[index] = False
            text = self.echo[self._prompt_of(index)] + text
            ids = prompt + ids
            lps = self._prompt_lps(self.choices[index], prompt) + lps
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._logprobs(index, ids, lps)
        vllm = None
        if out.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
            vllm = self.pieces.vllm_prompt_logprobs(prompt, out.prompt_logprobs)
        choice = rs.CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=vllm,
        )
        return self._chunk_of([choice])
