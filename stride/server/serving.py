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
from stride.engine.sequence import Constraint, SamplingParams
from stride.metrics import Metrics
from stride.scheduler.client import BaseClient
from stride.scheduler.outputs import GenerateRequest, RequestOutput
from stride.server import schemas as s
from stride.server import structured
from stride.server.errors import APIError, from_engine_error, from_exception
from stride.server.streaming import (
    SSE_DONE,
    SSE_HEADERS,
    ClientGone,
    Generation,
    sse,
    unless_disconnected,
)
from stride.server.tools import AnswerParser, Call, Tools, split_answer, template_messages
from stride.server.tools import resolve as resolve_tools


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
    ) -> None:
        model = client.model
        self.client = client
        self.metrics = metrics
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

    def tokenizer_info(self) -> s.TokenizerInfo:
        tok = self.tokenizer
        template = tok.chat_template
        return s.TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            model_max_length=self.max_model_len,
            vocab_size=self.vocab_size,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            pad_token=tok.pad_token,
            unk_token=tok.unk_token,
            chat_template=template if isinstance(template, str) else None,
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

    def render_chat(self, messages: list[s.ChatMessage], tools: Tools | None = None) -> str:
        """The chat template applied to `messages`, with the tools on offer (special tokens
        are part of the text)."""
        template = self.tokenizer.chat_template
        source = template if isinstance(template, str) else str(template)
        plain = template_messages(messages, tools, source)
        offered = tools.template_tools() if tools is not None and "tools" in source else None
        try:
            return self.tokenizer.apply_chat_template(
                plain, tools=offered, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:
            raise APIError("invalid_request", f"chat template failed: {e}", "messages") from e

    def chat_prompt(self, messages: list[s.ChatMessage], tools: Tools | None = None) -> list[int]:
        """The token ids of a chat's prompt, refusing one too long for the context early."""
        size = sum(len(_content(m.content)) for m in messages)
        if size > self._max_text:
            raise self._too_long(f"{size} characters", "messages")
        text = self.render_chat(messages, tools)
        return self.encode_prompt(text, special=False, param="messages")

    # ---- requests -------------------------------------------------------------------------------

    def sampling(
        self,
        body: s.SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        constraint: Constraint | None = None,
        prompt_logprobs: int | None = None,
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
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            constraint=constraint,
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
        samples: int | None = None,
    ) -> Generation:
        try:
            decoder, options = parse_spec(body.decoder, self.default_decoder)
        except DecoderError as e:
            raise from_exception(e) from e
        requests = [
            GenerateRequest(
                request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                prompt_ids=prompt,
                params=params,
                decoder=decoder,
                decoder_options=options,
                priority=body.priority,
                user=body.user,
            )
            for i, prompt in enumerate(prompts)
        ]
        deadline = None
        if body.timeout is not None:  # from the request's arrival (the app notes it)
            deadline = getattr(request.state, "arrival", time.monotonic()) + body.timeout
        samples = samples or body.n
        return Generation(self.client, requests, samples, self.metrics, deadline)

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
        if body.suffix is not None:
            why = "suffix (fill-in-the-middle) is not supported"
            raise APIError("invalid_request", why, "suffix")
        samples = _best_of(body)
        self.check_sequences(_num_prompts(body.prompt) * samples)
        constraint = structured.constraint_of(body)
        prompts, texts = await off_loop(lambda: self._prompts(body.prompt), _size(body.prompt))
        max_tokens = body.max_tokens or self.default_max_tokens(prompts)
        self.check_context(prompts, max_tokens)
        logprobs = body.logprobs if samples == body.n else max(body.logprobs or 0, 0)
        prompt_k = _prompt_logprobs(body.logprobs if body.echo else None, body.prompt_logprobs)
        params = self.sampling(body, max_tokens, logprobs, constraint, prompt_k)
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = self.generation(request, body, prompts, params, rid, samples)
        await self._started(request, gen)
        echo = [texts[i] if body.echo else "" for i in range(len(prompts))]
        view = _CompletionView(self, body, rid, prompts, echo, samples)
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
        _check_modalities(body)
        self.check_sequences(body.n)
        tools = resolve_tools(body)
        constraint = structured.constraint_of(body)
        if tools is not None and tools.constraint() is not None:
            if constraint is not None:
                why = "a required or named tool call cannot also follow another output constraint"
                raise APIError("invalid_request", why, "tool_choice")
            constraint = structured.checked(tools.constraint(), "tools")
        size = sum(len(_content(m.content)) for m in body.messages)
        prompt = await off_loop(lambda: self.chat_prompt(body.messages, tools), size)
        max_tokens = (
            body.max_completion_tokens or body.max_tokens or self.default_max_tokens([prompt])
        )
        self.check_context([prompt], max_tokens)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling(body, max_tokens, k, constraint, body.prompt_logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = self.generation(request, body, [prompt], params, rid)
        await self._started(request, gen)
        view = _ChatView(self, body, rid, [prompt], tools=tools)
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
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self.piece(token))}
            for rank, (t, v) in enumerate(lp.top, 1):
                entry.setdefault(str(t), s.PromptLogprob(
                    logprob=_finite(v), rank=rank, decoded_token=self.piece(t)))
            out.append(entry)
        return out


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


def _content(content: str | list | None) -> str:
    """A message's text, for sizing it (parts that are no text count nothing)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", "") for part in content)


def _best_of(body: s.CompletionRequest) -> int:
    """Samples drawn per prompt: best_of (at least n), of which the n best return."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise APIError("invalid_request", "best_of must be at least n", "best_of")
    if body.stream:
        raise APIError("invalid_request", "best_of cannot be used with stream", "best_of")
    return body.best_of


def _prompt_logprobs(*asked: int | None) -> int | None:
    """The most prompt alternatives any field asks for (None: none asked)."""
    given = [k for k in asked if k is not None]
    return max(given) if given else None


def _check_modalities(body: s.ChatCompletionRequest) -> None:
    """Text in, text out: audio output or web search is a clear 400, not silently dropped."""
    if body.modalities is not None and body.modalities != ["text"]:
        raise APIError("invalid_request", 'modalities: only ["text"] is supported', "modalities")
    if body.audio is not None:
        raise APIError("invalid_request", "audio output is not supported", "audio")
    if body.web_search_options is not None:
        raise APIError("invalid_request", "web search is not supported", "web_search_options")


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


_USAGE = {"usage"}
_PLACEHOLDER = RequestOutput("", text="\ue000stride-text\ue000")  # private use: in no name
_PLACEHOLDER_JSON = encode_basestring(_PLACEHOLDER.text)  # as pydantic writes it (tested)


class _View:
    """One response in the making: choices, usage, and the shape of its chunks."""

    CHUNK: type  # the pydantic model of a streamed chunk

    def __init__(
        self,
        serving: Serving,
        body: s.SamplingFields,
        rid: str,
        prompts: list[list[int]],
        samples: int | None = None,
    ):
        self.serving = serving
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
                self.choices[index].add(out)
        finally:
            gen.close()
        return self.response()

    async def stream(self, gen: Generation) -> AsyncIterator[str]:
        include_usage = self.include_usage
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
        if self.usage_always and getattr(chunk, "usage", 0) is None:
            chunk.usage = self.usage()
        data = chunk.model_dump_json() if include_usage else chunk.model_dump_json(exclude=_USAGE)
        return f"data: {data}\n\n"

    def _event(self, index: int, out: RequestOutput, include_usage: bool) -> str | None:
        """The SSE event of one output. Most carry only text: those are the choice's text-delta
        event, serialized once with a placeholder, with the text put in its place (the same
        bytes as serializing each chunk, at a tenth of the cost)."""
        if not out.text or out.finished or self.wants_logprobs or self.shaped:
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

    @property
    def shaped(self) -> bool:
        """Does a text output take more than its text in its chunk (usage, tool calls, the
        prompt)? Then every chunk is serialized whole."""
        return self.usage_always

    def opening(self) -> list[s.Response]:
        return []


class _CompletionView(_View):
    CHUNK = s.CompletionResponse  # a streamed chunk is shaped as the whole response
    body: s.CompletionRequest

    def __init__(
        self, serving, body: s.CompletionRequest, rid, prompts, echo: list[str], samples=None
    ):
        super().__init__(serving, body, rid, prompts, samples)
        self.echo = echo
        self.offsets = [0] * len(self.choices)
        # Echoed prompts whose logprobs are asked for go out with the choice's first tokens,
        # which bring them.
        self.echo_later = [body.echo and body.logprobs is not None] * len(self.choices)

    def _prompt_of(self, index: int) -> int:
        return index // self.samples

    def _logprobs(self, index: int, ids: list[int], lps: list) -> s.CompletionLogprobs:
        out = self.serving.completion_logprobs(ids, lps, self.offsets[index])
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
        return self.serving.vllm_prompt_logprobs(prompt, c.prompt_logprobs)

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
            vllm = self.serving.vllm_prompt_logprobs(prompt, out.prompt_logprobs)
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


class _ChatView(_View):
    CHUNK = s.ChatCompletionChunk
    body: s.ChatCompletionRequest

    def __init__(self, serving, body, rid, prompts, tools: Tools | None = None):
        super().__init__(serving, body, rid, prompts)
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
                    logprobs=self.serving.chat_logprobs(c.logprobs) if self.body.logprobs else None,
                    finish_reason=reason,
                    stop_reason=c.last.stop_reason,
                )
            )
        response = self._envelope(s.ChatCompletionResponse, choices, self.usage())
        if self.body.prompt_logprobs is not None:
            first = self.choices[0].prompt_logprobs
            response.prompt_logprobs = self.serving.vllm_prompt_logprobs(self.prompts[0], first)
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
            logprobs=self.serving.chat_logprobs(out.logprobs) if self.body.logprobs else None,
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
