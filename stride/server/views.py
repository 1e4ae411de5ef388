"""Engine outputs gathered into OpenAI responses, or streamed as server-sent events.

A view is one response in the making: its choices, usage, and the shape of its chunks, for
/v1/completions (`CompletionView`) or /v1/chat/completions (`ChatView`). Logprobs come in
OpenAI's two shapes (`Pieces`).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) quotes with

from fastapi.responses import StreamingResponse

from stride.decoders.sampling import TokenLogprob
from stride.scheduler.outputs import RequestOutput
from stride.server import schemas as s
from stride.server.errors import APIError, from_engine_error
from stride.server.streaming import SSE_DONE, SSE_HEADERS, Generation, sse


@dataclass
class Choice:
    """Everything one choice produced, gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.finished:
            self.last = out


def _failure(out: RequestOutput) -> APIError | None:
    """The API error an output ends with, if any (a passed deadline included)."""
    return None if out.error is None else from_engine_error(out.error)


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
        self, ids: list[int], lps: list[TokenLogprob | None], offset: int
    ) -> s.CompletionLogprobs:
        out = s.CompletionLogprobs()
        for token, lp in zip(ids, lps, strict=True):
            text = self(token)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:  # prompt tokens (echo): Stride does not score the prompt
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_finite(lp.logprob))
                out.top_logprobs.append({self(t): _finite(v) for t, v in lp.top})
        return out

    def chat_logprobs(self, lps: list[TokenLogprob | None]) -> s.ChatLogprobs:
        content = []
        for lp in lps:
            if lp is None:
                continue
            text = self(lp.token_id)
            top = [
                s.TopLogprob(
                    token=self(t), logprob=_finite(v), bytes=list(self(t).encode())
                )
                for t, v in lp.top
            ]
            content.append(
                s.TokenLogprobEntry(
                    token=text,
                    logprob=_finite(lp.logprob),
                    bytes=list(text.encode()),
                    top_logprobs=top,
                )
            )
        return s.ChatLogprobs(content=content)



def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


_USAGE = {"usage"}
_PLACEHOLDER = RequestOutput("", text="\ue000stride-text\ue000")  # private use: in no name
_PLACEHOLDER_JSON = encode_basestring(_PLACEHOLDER.text)  # as pydantic writes it (tested)


class View:
    """One response in the making: choices, usage, and the shape of its chunks."""

    CHUNK: type  # the pydantic model of a streamed chunk

    def __init__(
        self,
        model_name: str,
        pieces: Pieces,
        body: s.SamplingFields,
        rid: str,
        prompts: list[list[int]],
    ) -> None:
        self.model_name = model_name
        self.pieces = pieces
        self.body = body
        self.rid = rid
        self.prompts = prompts
        self.choices = [Choice() for _ in range(len(prompts) * body.n)]
        self.created = int(time.time())  # every chunk carries the same, as OpenAI's do
        self._text_events: dict[int, tuple[str, str]] = {}  # choice -> around a text delta

    def _chunk_of(self, choices: list, usage: s.Usage | None = None):
        return self._envelope(self.CHUNK, choices, usage)

    def _envelope(self, model: type, choices: list, usage: s.Usage | None):
        """A response or chunk of this response: its id, creation time and model name."""
        return model(
            id=self.rid,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
        )

    def usage(self) -> s.Usage:
        done = [c.last for c in self.choices if c.last is not None]
        completion = sum(o.num_output_tokens for o in done)
        prompt = sum(len(p) for p in self.prompts)
        decoder = [o.decoder_stats for o in done]
        timings = [o.timings for o in done]
        return s.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=s.PromptTokensDetails(cached_tokens=self.cached_tokens()),
            decoder=decoder[0] if len(decoder) == 1 else decoder,
            timings=timings[0] if len(timings) == 1 else timings,
        )

    def cached_tokens(self) -> int:
        """Prompt tokens read from the prefix cache, each prompt counted once (as in
        `prompt_tokens`): for the sample of it that found the fewest."""
        n = self.body.n
        total = 0
        for i in range(len(self.prompts)):
            samples = [c.last for c in self.choices[i * n : (i + 1) * n] if c.last is not None]
            total += min((o.num_cached_tokens for o in samples), default=0)
        return total

    async def collect(self, gen: Generation):
        try:
            async for index, out in gen:
                if out.error is not None:
                    raise _failure(out)
                self.choices[index].add(out)
        finally:
            gen.close()
        return self.response()

    async def stream(self, gen: Generation) -> AsyncIterator[str]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        try:
            for event in self.opening():
                yield self.chunk(event, include_usage)
            failed = False
            async for batch in gen.batches():  # one write per batch, one event per choice
                events = []
                for index, out in batch:
                    if out.error is not None and out.finish_reason != "deadline":
                        events.append(sse(_failure(out).body()))
                        failed = True
                        break
                    self.choices[index].add(out)
                    event = self.event(index, out, include_usage)
                    if event is not None:
                        events.append(event)
                if events:
                    yield "".join(events)
                if failed:
                    break
            if include_usage and not failed:
                yield self.chunk(self.final_chunk(), include_usage)
            yield SSE_DONE
        finally:
            gen.close()

    def chunk(self, chunk: s.Response, include_usage: bool) -> str:
        data = chunk.model_dump_json() if include_usage else chunk.model_dump_json(exclude=_USAGE)
        return f"data: {data}\n\n"

    def event(self, index: int, out: RequestOutput, include_usage: bool) -> str | None:
        """The SSE event of one output. Most carry only text: those are the choice's text-delta
        event, serialized once with a placeholder, with the text put in its place (the same
        bytes as serializing each chunk, at a tenth of the cost)."""
        if not out.text or out.finished or self.wants_logprobs:
            chunk = self.delta(index, out)
            return None if chunk is None else self.chunk(chunk, include_usage)
        around = self._text_events.get(index)
        if around is None:
            event = self.chunk(self.delta(index, _PLACEHOLDER), include_usage)
            before, after = event.split(_PLACEHOLDER_JSON)
            around = self._text_events[index] = (before, after)
        return around[0] + encode_basestring(out.text) + around[1]

    @property
    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def opening(self) -> list[s.Response]:
        return []


class CompletionView(View):
    CHUNK = s.CompletionResponse  # a streamed chunk is shaped as the whole response

    def __init__(
        self,
        model_name: str,
        pieces: Pieces,
        body: s.CompletionRequest,
        rid: str,
        prompts: list[list[int]],
        echo: list[str],
    ) -> None:
        super().__init__(model_name, pieces, body, rid, prompts)
        self.echo = echo
        self.offsets = [0] * len(self.choices)

    def _prompt_of(self, index: int) -> int:
        return index // self.body.n

    def _logprobs(self, index: int, ids: list[int], lps: list) -> s.CompletionLogprobs:
        out = self.pieces.completion_logprobs(ids, lps, self.offsets[index])
        if out.text_offset:
            self.offsets[index] = out.text_offset[-1] + len(out.tokens[-1])
        return out

    def response(self) -> s.CompletionResponse:
        choices = []
        for i, c in enumerate(self.choices):
            logprobs = None
            if self.body.logprobs is not None:
                ids, lps = c.token_ids, c.logprobs
                if self.body.echo:
                    prompt = self.prompts[self._prompt_of(i)]
                    ids, lps = prompt + ids, [None] * len(prompt) + lps
                logprobs = self._logprobs(i, ids, lps)
            choices.append(
                s.CompletionChoice(
                    index=i,
                    text=self.echo[self._prompt_of(i)] + c.text,
                    logprobs=logprobs,
                    finish_reason=c.last.finish_reason,
                    stop_reason=c.last.stop_reason,
                )
            )
        return self._chunk_of(choices, self.usage())

    @property
    def wants_logprobs(self) -> bool:
        return self.body.logprobs is not None

    def opening(self) -> list[s.Response]:
        if not self.body.echo:
            return []
        chunks = []
        for i in range(len(self.choices)):
            prompt = self.prompts[self._prompt_of(i)]
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = self._logprobs(i, prompt, [None] * len(prompt))
            choice = s.CompletionChoice(
                index=i, text=self.echo[self._prompt_of(i)], logprobs=logprobs
            )
            chunks.append(self._chunk_of([choice]))
        return chunks

    def delta(self, index: int, out: RequestOutput) -> s.Response | None:
        wants_logprobs = self.body.logprobs is not None and out.token_ids
        if not (out.text or out.finished or wants_logprobs):
            return None
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._logprobs(index, out.token_ids, out.logprobs)
        choice = s.CompletionChoice(
            index=index,
            text=out.text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return self._chunk_of([choice])

    def final_chunk(self) -> s.Response:
        return self._chunk_of([], self.usage())


class ChatView(View):
    CHUNK = s.ChatCompletionChunk
    body: s.ChatCompletionRequest

    def response(self) -> s.ChatCompletionResponse:
        choices = [
            s.ChatChoice(
                index=i,
                message=s.AssistantMessage(content=c.text),
                logprobs=self.pieces.chat_logprobs(c.logprobs) if self.body.logprobs else None,
                finish_reason=c.last.finish_reason,
                stop_reason=c.last.stop_reason,
            )
            for i, c in enumerate(self.choices)
        ]
        return self._envelope(s.ChatCompletionResponse, choices, self.usage())

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.body.logprobs)

    def opening(self) -> list[s.Response]:
        return [
            self._chunk_of(
                [s.ChatChunkChoice(index=i, delta=s.Delta(role="assistant", content=""))]
            )
            for i in range(len(self.choices))
        ]

    def delta(self, index: int, out: RequestOutput) -> s.Response | None:
        wants_logprobs = self.body.logprobs and out.token_ids
        if not (out.text or out.finished or wants_logprobs):
            return None
        choice = s.ChatChunkChoice(
            index=index,
            delta=s.Delta(content=out.text or None),
            logprobs=self.pieces.chat_logprobs(out.logprobs) if self.body.logprobs else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return self._chunk_of([choice])

    def final_chunk(self) -> s.Response:
        return self._chunk_of([], self.usage())
