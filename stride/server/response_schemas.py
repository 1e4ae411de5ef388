"""OpenAI's wire format of responses as pydantic models: what every answer looks like.

Stride adds `usage.decoder` and `usage.timings` (what the decoder did, where the time went). A
field that holds nothing yet is left out rather than sent as null or an empty list (`Optional`),
so that a field never changes its type from one chunk of a stream to the next: typed clients
(Go, Rust, zod) read every chunk with one type.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def _unset(value: Any) -> bool:
    return value is None


def Optional(description: str | None = None) -> Any:  # noqa: N802 (reads as a type)
    """A response field that appears only when it holds something (tool calls, prompt
    logprobs, a delta's role after the first): left out rather than null, so that no field
    changes its type from one chunk to the next."""
    return Field(None, exclude_if=_unset, description=description)


class PromptTokensDetails(Response):
    cached_tokens: int = Field(
        0, description="prompt tokens whose keys and values came from the prefix cache"
    )


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    decoder: dict[str, Any] | list[dict[str, Any]] | None = Optional(
        "what the decoder did (one dict per choice when n > 1); in a stream once all ended"
    )
    timings: dict[str, float] | list[dict[str, float]] | None = Optional(
        "seconds: queue, ttft, e2e; decode_tokens_per_s; in a stream once all ended"
    )


class CompletionLogprobs(Response):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(Response):
    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Optional(
        "vLLM's: per prompt token (the first: null), token id -> logprob, rank, text"
    )


def _created() -> int:
    return int(time.time())


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Response):
    content: list[TokenLogprobEntry] | None = None


class CalledFunction(Response):
    name: str
    arguments: str


class CalledTool(Response):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[CalledTool] | None = Optional()
    function_call: CalledFunction | None = Optional("deprecated: tool_calls")


class ChatChoice(Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Optional("vLLM's")


class FunctionDelta(Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Response):
    index: int
    id: str | None = Optional("in a call's first delta")
    type: Literal["function"] | None = Optional("in a call's first delta")
    function: FunctionDelta


class Delta(Response):
    role: Literal["assistant"] | None = Optional("in each choice's first chunk")
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Optional()
    function_call: FunctionDelta | None = Optional("deprecated: tool_calls")


class ChatChunkChoice(Response):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "stride"
    max_model_len: int | None = None


class TokenizerInfo(Response):
    """What vLLM's /tokenizer_info says (lm-eval's remote tokenizer reads it)."""

    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(Response):
    prompt: str


class ErrorDetail(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Response):
    error: ErrorDetail


class Health(Response):
    status: Literal["ok", "loading", "draining", "dead", "stuck", "failed"]
    detail: str | None = None
