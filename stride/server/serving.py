"""OpenAI requests in, engine requests out; engine outputs in, OpenAI responses (or SSE) out.

`Serving` holds what the HTTP edge needs to know about the loaded model (its name, tokenizer,
context length, vocabulary) and the engine client. It never touches engine internals: requests
cross to the step loop as plain `GenerateRequest`s and come back as plain `RequestOutput`s.

What the schema cannot check because it depends on the model (token ids, the context length,
how many sequences the queue can ever take) is checked here, before anything is submitted, and
cheap checks come first: a request of too many sequences, or a text too long for the context
by its length alone, is refused without tokenizing it. Large texts are tokenized (and chat
templates rendered) on a worker thread, so that one large prompt stalls no other request.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) quotes with
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from stride.decoders.base import DecoderError
from stride.decoders.registry import parse_spec
from stride.decoders.sampling import TokenLogprob
from stride.engine.sequence import SamplingParams
from stride.metrics import Metrics
from stride.scheduler.client import BaseClient
from stride.scheduler.outputs import GenerateRequest, RequestOutput
from stride.server import schemas as s
from stride.server.errors import APIError, from_engine_error, from_exception
from stride.server.streaming import (
    SSE_DONE,
    SSE_HEADERS,
    ClientGone,
    Generation,
    sse,
    unless_disconnected,
)
from stride.tracing import RequestTrace, Tracing, request_attributes


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


T = TypeVar("T")
INLINE_WORK = 4096  # characters or token ids: less is tokenized on the event loop (a thread
# hop costs more than that), more on a worker thread
PROBE_PER_TOKEN = 16  # a text longer than this many characters per context token is probed
PROBE_SLACK = 16  # tokens a cut text may gain at the cut


async def off_loop(work: Callable[[], T], size: int) -> T:
    """`work()` here if it is small (`size`), else on a worker thread."""
    return work() if size <= INLINE_WORK else await asyncio.to_thread(work)


class Serving:
    def __init__(
        self,
        client: BaseClient,
        default_decoder: str | dict[str, Any],
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        model = client.model
        self.client = client
        self.metrics = metrics
        self.tracing = tracing
        self.default_decoder = default_decoder
        self.model_name: str = model.name
        self.tokenizer = model.tokenizer
        self._backend = model.tokenizer.backend_tokenizer  # immutable calls: thread-safe
        self.max_model_len: int = model.max_model_len
        self.capacity = model.capacity
        self.vocab_size: int = model.vocab_size
        self.max_waiting: int = model.max_waiting
        self._pieces: dict[int, str] = {}
        # A token covers at most this many characters of text (byte-level BPE: its bytes; 2x
        # for normalizers that shrink text), so a longer text cannot fit in the context.
        longest = max((len(t) for t in model.tokenizer.get_vocab()), default=1)
        self._max_text = 2 * self.capacity * max(longest, 1)

    # ---- tokens ---------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                "model_not_found",
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
            )

    def encode(self, text: str, special: bool) -> list[int]:
        """Token ids of `text`. Long texts through `encode_batch`, which lets go of the GIL while
        it works (`encode` holds it: every other thread, the event loop too, would wait)."""
        try:
            if len(text) <= INLINE_WORK:
                return self._backend.encode(text, add_special_tokens=special).ids
            return self._backend.encode_batch([text], add_special_tokens=special)[0].ids
        except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
            raise APIError("invalid_request", f"cannot tokenize the text: {e}", "prompt") from e

    def encode_prompt(self, text: str, special: bool, param: str) -> list[int]:
        """Token ids of a prompt, refusing a text too long for the context before tokenizing
        all of it: by its length alone, or by the tokens of its beginning."""
        if len(text) > self._max_text:
            raise self._too_long(f"{len(text)} characters", param)
        probe = PROBE_PER_TOKEN * self.capacity
        if len(text) > probe:
            head = len(self.encode(text[:probe], special)) - PROBE_SLACK
            if head > self.capacity:
                raise self._too_long(f"more than {head} tokens", param)
        return self.encode(text, special)

    def _too_long(self, what: str, param: str) -> APIError:
        return APIError(
            "context_length_exceeded",
            f"the prompt is too long: {what}, and at most {self.capacity} tokens fit "
            "(the context length, or what the KV cache holds)",
            param,
        )

    def check_context(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Every prompt is non-empty, and fits with `max_tokens` in the context and the KV."""
        if any(not p for p in prompts):
            raise APIError("invalid_request", "the prompt is empty", "prompt")
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > self.max_model_len:
            raise APIError(
                "context_length_exceeded",
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {longest} and max_tokens asks for {max_tokens}",
                "max_tokens",
            )
        if longest + max_tokens > self.capacity:
            raise APIError(
                "context_length_exceeded",
                f"prompt plus max_tokens ({longest} + {max_tokens} tokens) do not fit in this "
                f"server's KV cache ({self.capacity} tokens)",
                "max_tokens",
            )

    def check_sequences(self, count: int) -> None:
        """prompts x n sequences are admitted together: more than the queue holds, never."""
        if count > self.max_waiting:
            raise APIError(
                "invalid_request",
                f"this request asks for {count} sequences (prompts x n), and at most "
                f"{self.max_waiting} can ever be admitted together (the server's --max-waiting)",
                "n",
            )

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        """The text of one token on its own (what logprobs name tokens by)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.decode([token_id])
        return text

    def check_ids(self, ids: list[int], param: str) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise APIError(
                "invalid_request", f"token ids must lie in [0, {self.vocab_size})", param
            )

    def render_chat(self, messages: list[s.ChatMessage]) -> str:
        """The chat template applied to `messages` (special tokens are part of the text)."""
        plain = [{"role": m.role, "content": _content(m.content)} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:
            raise APIError("invalid_request", f"chat template failed: {e}", "messages") from e

    def chat_prompt(self, messages: list[s.ChatMessage]) -> list[int]:
        """The token ids of a chat's prompt, refusing one too long for the context early."""
        size = sum(len(_content(m.content)) for m in messages)
        if size > self._max_text:
            raise self._too_long(f"{size} characters", "messages")
        return self.encode_prompt(self.render_chat(messages), special=False, param="messages")

    # ---- requests -------------------------------------------------------------------------------

    def sampling(
        self, body: s.SamplingFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_ids = list(body.stop_token_ids or [])
        self.check_ids(stop_ids, "stop_token_ids")
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.vocab_size:
                raise APIError(
                    "invalid_request",
                    f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}",
                    "logit_bias",
                )
            bias[token] = value
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=min(max(body.top_k, 0), self.vocab_size),
            min_p=body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=bias,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            stop=stop,
            stop_token_ids=stop_ids,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )

    def default_max_tokens(self, prompts: list[list[int]]) -> int:
        """What the context and the KV cache allow the longest prompt (at least 1)."""
        return max(1, self.capacity - max(len(p) for p in prompts))

    def generation(
        self,
        request: Request,
        body: s.SamplingFields,
        prompts: list[list[int]],
        params: SamplingParams,
        rid: str,
        operation: str,
    ) -> Generation:
        """The engine requests of one HTTP request; `operation` (`chat`, `text_completion`)
        names its trace."""
        try:
            decoder, options = parse_spec(body.decoder, self.default_decoder)
        except DecoderError as e:
            raise from_exception(e) from e
        arrival = getattr(request.state, "arrival", time.monotonic())
        trace = self._trace(request, operation, arrival, decoder, options, params, body.n)
        requests = [
            GenerateRequest(
                request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                prompt_ids=prompt,
                params=params,
                decoder=decoder,
                decoder_options=options,
                priority=body.priority,
                user=body.user,
                trace=trace is not None,
            )
            for i, prompt in enumerate(prompts)
        ]
        deadline = None
        if body.timeout is not None:  # from the request's arrival (the app notes it)
            deadline = arrival + body.timeout
        return Generation(self.client, requests, body.n, self.metrics, deadline, trace)

    def _trace(
        self,
        request: Request,
        operation: str,
        arrival: float,
        decoder: str,
        options: dict[str, Any],
        params: SamplingParams,
        n: int,
    ) -> RequestTrace | None:
        """The request's trace, if tracing is on and the sampler keeps it."""
        if self.tracing is None:
            return None
        attrs = request_attributes(decoder, options, params.max_tokens, params.temperature, n)
        return self.tracing.start(operation, self.model_name, request.headers, arrival, attrs)

    async def _started(self, request: Request, gen: Generation) -> None:
        try:
            await unless_disconnected(request, gen.start())
        except ClientGone:
            raise
        except Exception as e:
            raise from_exception(e) from e

    # ---- /v1/completions ------------------------------------------------------------------------

    async def completions(self, request: Request, body: s.CompletionRequest):
        self.check_model(body.model)
        self.check_sequences(_num_prompts(body.prompt) * body.n)
        prompts, texts = await off_loop(lambda: self._prompts(body.prompt), _size(body.prompt))
        max_tokens = body.max_tokens or self.default_max_tokens(prompts)
        self.check_context(prompts, max_tokens)
        params = self.sampling(body, max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = self.generation(request, body, prompts, params, rid, "text_completion")
        await self._started(request, gen)
        echo = [texts[i] if body.echo else "" for i in range(len(prompts))]
        view = _CompletionView(self, body, rid, prompts, echo)
        if body.stream:
            return _sse(view.stream(gen))
        return await unless_disconnected(request, view.collect(gen))

    def _prompts(self, prompt: Any) -> tuple[list[list[int]], list[str]]:
        """Token ids and text of every prompt, whatever form the request used."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("invalid_request", "the prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        if all(isinstance(p, str) for p in prompt):
            ids = [self.encode_prompt(p, special=True, param="prompt") for p in prompt]
            return ids, list(prompt)
        for p in prompt:
            if len(p) > self.capacity:
                raise self._too_long(f"{len(p)} tokens", "prompt")
            self.check_ids(p, "prompt")
        return [list(p) for p in prompt], [self.decode(p) for p in prompt]

    # ---- /v1/chat/completions -------------------------------------------------------------------

    async def chat(self, request: Request, body: s.ChatCompletionRequest):
        self.check_model(body.model)
        self.check_sequences(body.n)
        size = sum(len(_content(m.content)) for m in body.messages)
        prompt = await off_loop(lambda: self.chat_prompt(body.messages), size)
        max_tokens = (
            body.max_completion_tokens or body.max_tokens or self.default_max_tokens([prompt])
        )
        self.check_context([prompt], max_tokens)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling(body, max_tokens, k)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self.generation(request, body, [prompt], params, rid, "chat")
        await self._started(request, gen)
        view = _ChatView(self, body, rid, [prompt])
        if body.stream:
            return _sse(view.stream(gen))
        return await unless_disconnected(request, view.collect(gen))

    # ---- logprobs in OpenAI's two shapes --------------------------------------------------------

    def completion_logprobs(
        self, ids: list[int], lps: list[TokenLogprob | None], offset: int
    ) -> s.CompletionLogprobs:
        out = s.CompletionLogprobs()
        for token, lp in zip(ids, lps, strict=True):
            text = self.piece(token)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:  # prompt tokens (echo): Stride does not score the prompt
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_finite(lp.logprob))
                out.top_logprobs.append({self.piece(t): _finite(v) for t, v in lp.top})
        return out

    def chat_logprobs(self, lps: list[TokenLogprob | None]) -> s.ChatLogprobs:
        content = []
        for lp in lps:
            if lp is None:
                continue
            text = self.piece(lp.token_id)
            top = [
                s.TopLogprob(
                    token=self.piece(t), logprob=_finite(v), bytes=list(self.piece(t).encode())
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


def _num_prompts(prompt: Any) -> int:
    """How many prompts a completion request's `prompt` holds (without reading them)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _size(prompt: Any) -> int:
    """Characters or token ids in a `prompt`: the work of reading it."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(1 if isinstance(p, int) else len(p) for p in prompt)


def _content(content: str | list[s.TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


_USAGE = {"usage"}
_PLACEHOLDER = RequestOutput("", text="\ue000stride-text\ue000")  # private use: in no name
_PLACEHOLDER_JSON = encode_basestring(_PLACEHOLDER.text)  # as pydantic writes it (tested)


class _View:
    """One response in the making: choices, usage, and the shape of its chunks."""

    CHUNK: type  # the pydantic model of a streamed chunk

    def __init__(
        self, serving: Serving, body: s.SamplingFields, rid: str, prompts: list[list[int]]
    ):
        self.serving = serving
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
            model=self.serving.model_name,
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
                yield self._chunk(event, include_usage)
            failed = False
            async for batch in gen.batches():  # one write per batch, one event per choice
                events = []
                for index, out in batch:
                    if out.error is not None and out.finish_reason != "deadline":
                        events.append(sse(_failure(out).body()))
                        failed = True
                        break
                    self.choices[index].add(out)
                    event = self._event(index, out, include_usage)
                    if event is not None:
                        events.append(event)
                if events:
                    yield "".join(events)
                if failed:
                    break
            if include_usage and not failed:
                yield self._chunk(self.final_chunk(), include_usage)
            yield SSE_DONE
        finally:
            gen.close()

    def _chunk(self, chunk: s.Response, include_usage: bool) -> str:
        data = chunk.model_dump_json() if include_usage else chunk.model_dump_json(exclude=_USAGE)
        return f"data: {data}\n\n"

    def _event(self, index: int, out: RequestOutput, include_usage: bool) -> str | None:
        """The SSE event of one output. Most carry only text: those are the choice's text-delta
        event, serialized once with a placeholder, with the text put in its place (the same
        bytes as serializing each chunk, at a tenth of the cost)."""
        if not out.text or out.finished or self.wants_logprobs:
            chunk = self.delta(index, out)
            return None if chunk is None else self._chunk(chunk, include_usage)
        around = self._text_events.get(index)
        if around is None:
            event = self._chunk(self.delta(index, _PLACEHOLDER), include_usage)
            before, after = event.split(_PLACEHOLDER_JSON)
            around = self._text_events[index] = (before, after)
        return around[0] + encode_basestring(out.text) + around[1]

    @property
    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def opening(self) -> list[s.Response]:
        return []


class _CompletionView(_View):
    CHUNK = s.CompletionResponse  # a streamed chunk is shaped as the whole response

    def __init__(self, serving, body: s.CompletionRequest, rid, prompts, echo: list[str]):
        super().__init__(serving, body, rid, prompts)
        self.echo = echo
        self.offsets = [0] * len(self.choices)

    def _prompt_of(self, index: int) -> int:
        return index // self.body.n

    def _logprobs(self, index: int, ids: list[int], lps: list) -> s.CompletionLogprobs:
        out = self.serving.completion_logprobs(ids, lps, self.offsets[index])
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


class _ChatView(_View):
    CHUNK = s.ChatCompletionChunk
    body: s.ChatCompletionRequest

    def response(self) -> s.ChatCompletionResponse:
        choices = [
            s.ChatChoice(
                index=i,
                message=s.AssistantMessage(content=c.text),
                logprobs=self.serving.chat_logprobs(c.logprobs) if self.body.logprobs else None,
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
            logprobs=self.serving.chat_logprobs(out.logprobs) if self.body.logprobs else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        return self._chunk_of([choice])

    def final_chunk(self) -> s.Response:
        return self._chunk_of([], self.usage())
