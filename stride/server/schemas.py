"""OpenAI's wire format as pydantic models: what requests may say, and what responses look like.

Requests forbid unknown fields (as OpenAI does) so a typo is a 400 rather than silently ignored.
Every field has a type (strictly: no `"2"` for 2) and a range (numbers finite: NaN is no
temperature), so bad input is a 400 here and never reaches the engine; what depends on the
loaded model (token ids below its vocabulary, the context length) is checked by `serving`
before a request is submitted.
Stride's extensions (top_k, min_p, decoder, timeout, ...) sit next to OpenAI's fields; the SDK
sends them through `extra_body`. Responses add `usage.decoder` and `usage.timings`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from stride.decoders.base import DecoderError
from stride.decoders.registry import parse_spec, spec_schema

INT32_MAX = 2**31 - 1  # a bound for counts and ids: nothing real comes near, nothing overflows
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # a token id as a JSON object key
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class _RegisteredDecoder:
    """The `decoder` field: a registered decoder's name, or `{"type": name, ...its options}`.

    Checked against the decoder registry as the request arrives (decoders registered after
    import count), so an unknown decoder, option or value is a 400 `invalid_decoder` before the
    engine sees it; what depends on the server (its drafters, the model's layers) is checked at
    admission. The OpenAPI schema lists every decoder's options.
    """

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(_check_decoder)

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return spec_schema()


def _check_decoder(value: Any) -> str | dict[str, Any]:
    try:
        parse_spec(value, "ar")
    except DecoderError as e:
        raise PydanticCustomError("invalid_decoder", str(e)) from None
    return value


DecoderSpec = Annotated[str | dict[str, Any], _RegisteredDecoder()]


class Request(BaseModel):
    """Strict: `"2"` is no integer and `1` no boolean (what the OpenAPI schema says is what is
    accepted); numbers are finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Request):
    include_usage: bool = False


class SamplingFields(Request):
    """Fields shared by completions and chat: sampling, stopping and Stride's extensions."""

    model: str | None = Field(None, description="the served model's name (default: it)")
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="0 or -1: no top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    logit_bias: dict[TokenKey, Bias] | None = Field(
        None, max_length=1024, description="token id (as a string) -> bias added to its logit"
    )
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    decoder: DecoderSpec | None = Field(
        None,
        description='decoding strategy: a name ("ar") or {"type": name, ...options}; '
        "default: the server's --decoder",
    )
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="lower runs first")
    timeout: float | None = Field(
        None, gt=0.0, le=86400.0, description="seconds until the request fails with a deadline"
    )


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmpty
        | Annotated[list[NonEmpty], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(..., description="a string, strings, token ids, or lists of token ids")
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=INT32_MAX, description="default: what the context allows"
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses ----------------------------------------------------------------------------------


class Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(Response):
    cached_tokens: int = Field(
        0, description="prompt tokens whose keys and values came from the prefix cache"
    )


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    decoder: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None, description="what the decoder did (one dict per choice when n > 1)"
    )
    timings: dict[str, float] | list[dict[str, float]] | None = Field(
        None, description="seconds: queue, ttft, e2e; decode_tokens_per_s"
    )


class CompletionLogprobs(Response):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


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


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


class Delta(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
