"""What a request asks for, checked against the model and turned into engine requests.

What the schema cannot check because it depends on the model (token ids, the context length,
how many sequences the queue can ever take) is checked here, before anything is submitted, and
cheap checks come first: a request of too many sequences, or a text too long for the context
by its length alone, is refused without tokenizing it. Large texts are tokenized (and chat
templates rendered) on a worker thread (`off_loop`), so that one large prompt stalls no other
request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from stride.decoders.registry import parse_spec
from stride.engine.sequence import Constraint, SamplingParams
from stride.scheduler.model_info import ModelInfo
from stride.scheduler.outputs import GenerateRequest
from stride.server import request_schemas as rq
from stride.server import response_schemas as rs
from stride.server.errors import APIError
from stride.server.tools import Tools, template_messages

T = TypeVar("T")
INLINE_WORK = 4096  # characters or token ids: less is tokenized on the event loop (a thread
# hop costs more than that), more on a worker thread
PROBE_PER_TOKEN = 16  # a text longer than this many characters per context token is probed
PROBE_SLACK = 16  # tokens a cut text may gain at the cut


async def off_loop(work: Callable[[], T], size: int) -> T:
    """`work()` here if it is small (`size`), else on a worker thread."""
    return work() if size <= INLINE_WORK else await asyncio.to_thread(work)


class Inputs:
    """The model's side of a request: its tokenizer, context length, vocabulary and queue."""

    def __init__(self, model: ModelInfo, default_decoder: str | dict[str, Any]) -> None:
        self.model_name: str = model.name
        self.default_decoder = parse_spec(default_decoder)  # (checked by the CLI)
        self.tokenizer = model.tokenizer
        self._backend = model.tokenizer.backend_tokenizer  # immutable calls: thread-safe
        self.max_model_len: int = model.max_model_len
        self.capacity = model.capacity
        self.vocab_size: int = model.vocab_size
        self.max_waiting: int = model.max_waiting
        # A token covers at most this many characters of text (byte-level BPE: its bytes; 2x
        # for normalizers that shrink text), so a longer text cannot fit in the context.
        longest = max((len(t) for t in model.tokenizer.get_vocab()), default=1)
        self._max_text = 2 * self.capacity * max(longest, 1)

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

    def check_sequences(self, count: int, param: str) -> None:
        """prompts x n sequences (or best_of's samples) are admitted together: more than the
        queue holds, never; `param` names the field that asked for them."""
        if count > self.max_waiting:
            raise APIError(
                "invalid_request",
                f"this request asks for {count} sequences (prompts x {param}), and at most "
                f"{self.max_waiting} can ever be admitted together (the server's --max-waiting)",
                param,
            )

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def check_ids(self, ids: list[int], param: str) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise APIError(
                "invalid_request", f"token ids must lie in [0, {self.vocab_size})", param
            )

    def render_chat(self, messages: list[rq.ChatMessage], tools: Tools | None = None) -> str:
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

    def chat_prompt(self, messages: list[rq.ChatMessage], tools: Tools | None = None) -> list[int]:
        """The token ids of a chat's prompt, refusing one too long for the context early."""
        size = sum(len(content(m.content)) for m in messages)
        if size > self._max_text:
            raise self._too_long(f"{size} characters", "messages")
        text = self.render_chat(messages, tools)
        return self.encode_prompt(text, special=False, param="messages")

    def tokenizer_info(self) -> rs.TokenizerInfo:
        """The tokenizer's settings, as vLLM's /tokenizer_info says them."""
        tok = self.tokenizer
        template = tok.chat_template
        return rs.TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            model_max_length=self.max_model_len,
            vocab_size=self.vocab_size,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            pad_token=tok.pad_token,
            unk_token=tok.unk_token,
            chat_template=template if isinstance(template, str) else None,
        )

    def sampling(
        self,
        body: rq.SamplingFields,
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

    def requests(
        self,
        body: rq.SamplingFields,
        prompts: list[list[int]],
        params: SamplingParams,
        rid: str,
    ) -> list[GenerateRequest]:
        """One engine request per prompt (the engine makes `body.n` samples of each)."""
        decoder, options = body.decoder or self.default_decoder
        return [
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

    def prompts(self, prompt: Any) -> tuple[list[list[int]], list[str]]:
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


def num_prompts(prompt: Any) -> int:
    """How many prompts a completion request's `prompt` holds (without reading them)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def size(prompt: Any) -> int:
    """Characters or token ids in a `prompt`: the work of reading it."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(1 if isinstance(p, int) else len(p) for p in prompt)


def content(content: str | list | None) -> str:
    """A message's text, for sizing it (parts that are no text count nothing)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", "") for part in content)


def best_of(body: rq.CompletionRequest) -> int:
    """Samples drawn per prompt: best_of (at least n), of which the n best return."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise APIError("invalid_request", "best_of must be at least n", "best_of")
    if body.stream:
        raise APIError("invalid_request", "best_of cannot be used with stream", "best_of")
    return body.best_of


def most_prompt_logprobs(*asked: int | None) -> int | None:
    """The most prompt alternatives any field asks for (None: none asked)."""
    given = [k for k in asked if k is not None]
    return max(given) if given else None


def check_modalities(body: rq.ChatCompletionRequest) -> None:
    """Text in, text out: audio output or web search is a clear 400, not silently dropped."""
    if body.modalities is not None and body.modalities != ["text"]:
        raise APIError("invalid_request", 'modalities: only ["text"] is supported', "modalities")
    if body.audio is not None:
        raise APIError("invalid_request", "audio output is not supported", "audio")
    if body.web_search_options is not None:
        raise APIError("invalid_request", "web search is not supported", "web_search_options")
