"""Engine outputs gathered into OpenAI responses, or streamed as server-sent events.

A view is one response in the making: its choices, usage, and the shape of its chunks, for
/v1/completions (`CompletionView`) or /v1/chat/completions (`ChatView`). Logprobs come in
OpenAI's two shapes (`Pieces`).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) quotes with

from fastapi.responses import StreamingResponse

from stride.decoders.sampling import TokenLogprob
from stride.scheduler.outputs import RequestOutput
from stride.server import schemas as s
from stride.server.errors import APIError, from_engine_error
from stride.server.streaming import SSE_DONE, SSE_HEADERS, Generation, sse
from stride.server.tools import AnswerParser, Call, Tools, split_answer


@dataclass
class Choice:
    """Everything one choice produced, gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.last = out

    def mean_logprob(self) -> float:
        """What best_of ranks samples by: the mean log-probability of their tokens."""
        scored = [lp.logprob for lp in self.logprobs if lp is not None]
        return sum(scored) / len(scored) if scored else -math.inf


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
            if lp is None:  # the first prompt token (echo): nothing scores it
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

    def vllm_prompt_logprobs(
        self, prompt: list[int], lps: list[TokenLogprob | None] | None
    ) -> list[dict[str, s.PromptLogprob] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (the first: None), the token's own
        logprob and rank, then its alternatives', keyed by token id."""
        out: list[dict[str, s.PromptLogprob] | None] = []
        for token, lp in zip(prompt, lps or [None] * len(prompt), strict=True):
            if lp is None:
                out.append(None)
                continue
            entry = {str(token): s.PromptLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self(token))}
            for rank, (t, v) in enumerate(lp.top, 1):
                entry.setdefault(str(t), s.PromptLogprob(
                    logprob=_finite(v), rank=rank, decoded_token=self(t)))
            out.append(entry)
        return out


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
        samples: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.pieces = pieces
        self.body = body
        self.rid = rid
        self.prompts = prompts
        self.samples = samples or body.n  # per prompt (best_of draws more than it returns)
        self.choices = [Choice() for _ in range(len(prompts) * self.samples)]
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's continuous_usage_stats: the usage so far in every chunk
        self.usage_always = self.include_usage and bool(options and options.continuous_usage_stats)
        self.created = int(time.time())  # every chunk carries the same, as OpenAI's do
        self.generated = True  # False: max_tokens 0, the generated token is left out
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
        if len(done) < len(self.choices):  # in a stream: the usage so far
            completion = sum(len(c.token_ids) for c in self.choices)
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
        n = self.samples
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
                out = self.shown(out)
                self.choices[index].add(out)
        finally:
            gen.close()
        return self.response()

    async def stream(self, gen: Generation) -> AsyncIterator[str]:
        include_usage = self.include_usage
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
                    out = self.shown(out)
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
        if self.usage_always and getattr(chunk, "usage", 0) is None:
            chunk.usage = self.usage()
        data = chunk.model_dump_json() if include_usage else chunk.model_dump_json(exclude=_USAGE)
        return f"data: {data}\n\n"

    def event(self, index: int, out: RequestOutput, include_usage: bool) -> str | None:
        """The SSE event of one output. Most carry only text: those are the choice's text-delta
        event, serialized once with a placeholder, with the text put in its place (the same
        bytes as serializing each chunk, at a tenth of the cost)."""
        if not out.text or out.finished or self.wants_logprobs or self.shaped:
            chunk = self.delta(index, out)
            return None if chunk is None else self.chunk(chunk, include_usage)
        around = self._text_events.get(index)
        if around is None:
            event = self.chunk(self.delta(index, _PLACEHOLDER), include_usage)
            before, after = event.split(_PLACEHOLDER_JSON)
            around = self._text_events[index] = (before, after)
        return around[0] + encode_basestring(out.text) + around[1]

    def shown(self, out: RequestOutput) -> RequestOutput:
        """What of an output the answer shows (all of it, unless nothing is to be generated)."""
        if self.generated:
            return out
        return replace(out, token_ids=[], text="", logprobs=[], num_output_tokens=0)

    @property
    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    @property
    def shaped(self) -> bool:
        """Does a text output take more than its text in its chunk (usage, tool calls, the
        prompt)? Then every chunk is serialized whole."""
        return self.usage_always

    def opening(self) -> list[s.Response]:
        return []


class CompletionView(View):
    CHUNK = s.CompletionResponse  # a streamed chunk is shaped as the whole response
    body: s.CompletionRequest

    def __init__(
        self,
        model_name: str,
        pieces: Pieces,
        body: s.CompletionRequest,
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

    def _logprobs(self, index: int, ids: list[int], lps: list) -> s.CompletionLogprobs:
        out = self.pieces.completion_logprobs(ids, lps, self.offsets[index])
        if out.text_offset:
            self.offsets[index] = out.text_offset[-1] + len(out.tokens[-1])
        return out

    def response(self) -> s.CompletionResponse:
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
                s.CompletionChoice(
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

    def opening(self) -> list[s.Response]:
        if not self.body.echo or self.body.logprobs is not None:
            return []  # (with logprobs: with the first tokens)
        chunks = []
        for i in range(len(self.choices)):
            choice = s.CompletionChoice(index=i, text=self.echo[self._prompt_of(i)])
            chunks.append(self._chunk_of([choice]))
        return chunks

    def delta(self, index: int, out: RequestOutput) -> s.Response | None:
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
        choice = s.CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=vllm,
        )
        return self._chunk_of([choice])

    def final_chunk(self) -> s.Response:
        return self._chunk_of([], self.usage())


class ChatView(View):
    CHUNK = s.ChatCompletionChunk
    body: s.ChatCompletionRequest

    def __init__(
        self,
        model_name: str,
        pieces: Pieces,
        body: s.ChatCompletionRequest,
        rid: str,
        prompts: list[list[int]],
        tools: Tools | None = None,
    ) -> None:
        super().__init__(model_name, pieces, body, rid, prompts)
        self.tools = tools
        self.parsers = [AnswerParser(tools) for _ in self.choices] if tools is not None else []
        self.announced: list[set[str]] = [set() for _ in self.choices]  # calls begun, by id

    def response(self) -> s.ChatCompletionResponse:
        choices = []
        for i, c in enumerate(self.choices):
            message, reason = self._message(c)
            choices.append(
                s.ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self.pieces.chat_logprobs(c.logprobs) if self.body.logprobs else None,
                    finish_reason=reason,
                    stop_reason=c.last.stop_reason,
                )
            )
        response = self._envelope(s.ChatCompletionResponse, choices, self.usage())
        if self.body.prompt_logprobs is not None:
            first = self.choices[0].prompt_logprobs
            response.prompt_logprobs = self.pieces.vllm_prompt_logprobs(self.prompts[0], first)
        return response

    def _message(self, c: Choice) -> tuple[s.AssistantMessage, str | None]:
        """The answer, with its tool calls parsed out (see `tools`), and its finish reason."""
        reason = c.last.finish_reason
        if self.tools is None:
            return s.AssistantMessage(content=c.text), reason
        content, calls = split_answer(c.text, self.tools)
        if not calls:
            return s.AssistantMessage(content=content), reason
        reason = self._called(reason)
        functions = [s.CalledFunction(name=k.name, arguments=k.arguments) for k in calls]
        if self.tools.legacy:
            return s.AssistantMessage(content=content, function_call=functions[0]), reason
        pairs = zip(calls, functions, strict=True)
        tool_calls = [s.CalledTool(id=k.id, function=f) for k, f in pairs]
        return s.AssistantMessage(content=content, tool_calls=tool_calls), reason

    def _called(self, reason: str | None) -> str | None:
        """An answer that calls tools says so where it stopped of its own accord."""
        if reason != "stop":
            return reason
        return "function_call" if self.tools is not None and self.tools.legacy else "tool_calls"

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.body.logprobs)

    @property
    def shaped(self) -> bool:
        return self.usage_always or self.tools is not None

    def opening(self) -> list[s.Response]:
        return [
            self._chunk_of(
                [s.ChatChunkChoice(index=i, delta=s.Delta(role="assistant", content=""))]
            )
            for i in range(len(self.choices))
        ]

    def delta(self, index: int, out: RequestOutput) -> s.Response | None:
        content, calls, reason = out.text, [], out.finish_reason
        if self.tools is not None:
            parser = self.parsers[index]
            piece = parser.feed(out.text)
            content, calls = piece.content, piece.calls
            if out.finished:
                rest = parser.finish()
                content, calls = content + rest.content, calls + rest.calls
                if parser.calls:
                    reason = self._called(reason)
        wants_logprobs = self.body.logprobs and out.token_ids
        if not (content or calls or out.finished or wants_logprobs):
            return None
        delta = s.Delta(content=content or None)
        if calls:
            self._add_calls(index, delta, calls)
        choice = s.ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=self.pieces.chat_logprobs(out.logprobs) if self.body.logprobs else None,
            finish_reason=reason,
            stop_reason=out.stop_reason,
        )
        return self._chunk_of([choice])

    def _add_calls(self, index: int, delta: s.Delta, calls: list[Call]) -> None:
        """Tool-call deltas as the SDK accumulates them: a call's first one carries its index,
        id, type and name; later ones (a named call's arguments as they come) more arguments."""
        made = self.parsers[index].calls
        begun = self.announced[index]
        deltas = []
        for call in calls:
            first = call.id not in begun
            begun.add(call.id)
            function = s.FunctionDelta(name=call.name if first else None, arguments=call.arguments)
            if self.tools.legacy:
                delta.function_call = function
                continue
            at = next(i for i, made_call in enumerate(made) if made_call.id == call.id)
            deltas.append(
                s.ToolCallDelta(index=at, id=call.id if first else None,
                                type="function" if first else None, function=function)
            )  # fmt: skip
        delta.tool_calls = deltas or None

    def final_chunk(self) -> s.Response:
        return self._chunk_of([], self.usage())
