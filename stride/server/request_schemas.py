"""OpenAI's wire format of requests as pydantic models: what a request may say.

Requests forbid unknown fields (as OpenAI does) so a typo is a 400 rather than silently ignored.
Every field has a type (strictly: no `"2"` for 2) and a range (numbers finite: NaN is no
temperature), so bad input is a 400 here and never reaches the engine; what depends on the
loaded model (token ids below its vocabulary, the context length) is checked by `serving`
before a request is submitted.
Stride's extensions (top_k, min_p, decoder, timeout, ...) sit next to OpenAI's fields; the SDK
sends them through `extra_body`. Responses are in `response_schemas`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from stride.decoders.base import DecoderError
from stride.decoders.registry import Choice, parse_spec, spec_schema

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
    admission. Parsed here once, into the `Choice` the engine request carries; the OpenAPI
    schema lists every decoder's options.
    """

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(_check_decoder)

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return spec_schema()


def _check_decoder(value: Any) -> Choice:
    try:
        return parse_spec(value)
    except DecoderError as e:
        raise PydanticCustomError("invalid_decoder", str(e)) from None


DecoderSpec = Annotated[Choice, _RegisteredDecoder()]


class Request(BaseModel):
    """Strict: `"2"` is no integer and `1` no boolean (what the OpenAPI schema says is what is
    accepted); numbers are finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: with include_usage, usage so far in every chunk"
    )
    include_obfuscation: bool = Field(True, description="ignored: chunks carry no padding")


JSONObject = dict[str, Any]
Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for names


class JSONSchemaFormat(Request):
    name: Name
    description: str | None = None
    schema_: JSONObject | None = Field(
        None, alias="schema", description="the JSON schema the output follows (none: any JSON)"
    )
    strict: bool | None = Field(None, description="ignored: the schema is always enforced")


class TextFormat(Request):
    type: Literal["text"]


class JSONObjectFormat(Request):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputs(Request):
    """vLLM's `structured_outputs`: one constraint of the output (the newer names of its
    `guided_*` fields)."""

    json_: JSONObject | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="a Lark or GBNF grammar")
    json_object: bool | None = None
    disable_any_whitespace: bool = Field(
        False, description="ignored: JSON is always written without free whitespace"
    )
    disable_fallback: bool = Field(False, description="ignored: there is one grammar engine")
    disable_additional_properties: bool = Field(
        False, description="ignored: a schema's additionalProperties is what it says"
    )
    whitespace_pattern: str | None = Field(None, description="ignored (as above)")


class GuidedFields(Request):
    """Structured outputs as vLLM clients ask for them (Stride's extension of both routes)."""

    guided_json: JSONObject | str | None = Field(None, description="vLLM: a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM: a regular expression")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="vLLM: the output is one of these strings"
    )
    guided_grammar: str | None = Field(None, description="vLLM: a Lark or GBNF grammar")
    guided_decoding_backend: str | None = Field(
        None, description="ignored: Stride's one grammar engine is llguidance"
    )
    guided_whitespace_pattern: str | None = Field(None, description="ignored")
    structured_outputs: StructuredOutputs | None = None


class SamplingFields(GuidedFields):
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
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="vLLM: logprobs of the prompt's tokens, with k alternatives"
    )
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmpty
        | Annotated[list[NonEmpty], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(..., description="a string, strings, token ids, or lists of token ids")
    max_tokens: int | None = Field(
        16, ge=0, le=INT32_MAX, description="0: nothing generated (with echo: the prompt scored)"
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(
        None, ge=1, le=20, description="samples drawn; the n with the best mean logprob return"
    )
    suffix: str | None = Field(None, description="fill-in-the-middle: not supported (400)")


class TextPart(Request):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: JSONObject | None = Field(None, description="ignored")


class RefusalPart(Request):
    type: Literal["refusal"]
    refusal: str


class MediaPart(Request):
    """Images, audio and files: Stride serves text models (a clear 400)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url"]


ContentPart = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


class FunctionCall(Request):
    name: str
    arguments: str = Field(..., description="the arguments, as a JSON object's text")


class ToolCall(Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this answers")
    function_call: FunctionCall | None = Field(None, description="assistant (deprecated)")
    refusal: str | None = None
    audio: JSONObject | None = Field(None, description="ignored: text only")


class FunctionDefinition(Request):
    name: Name
    description: str | None = None
    parameters: JSONObject | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(None, description="ignored: required calls always follow it")


class FunctionTool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: Name


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(Request):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(..., min_length=1)


class AllowedToolsChoice(Request):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[NamedToolChoice | AllowedToolsChoice, Field(discriminator="type")]
)


class PredictionContent(Request):
    type: Literal["content"]
    content: str | list[TextPart]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=INT32_MAX, description="default: what the context allows"
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, else none")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per answer")
    functions: Annotated[list[FunctionDefinition], Field(max_length=128)] | None = Field(
        None, description="deprecated: tools"
    )
    function_call: Literal["none", "auto"] | FunctionName | None = Field(
        None, description="deprecated: tool_choice"
    )
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, description='["text"] only: Stride answers text'
    )
    audio: JSONObject | None = Field(None, description="audio output: not supported (400)")
    store: bool | None = Field(None, description="ignored: nothing is stored")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="ignored")
    service_tier: str | None = Field(None, description="ignored: one tier")
    prediction: PredictionContent | None = Field(None, description="ignored")
    prompt_cache_key: str | None = Field(None, description="ignored: prefix caching is automatic")
    prompt_cache_options: JSONObject | None = Field(None, description="ignored (as above)")
    prompt_cache_retention: str | None = Field(None, description="ignored (as above)")
    reasoning_effort: str | None = Field(None, description="ignored")
    verbosity: str | None = Field(None, description="ignored")
    safety_identifier: str | None = Field(None, description="ignored")
    moderation: JSONObject | None = Field(None, description="ignored: no moderation runs")
    web_search_options: JSONObject | None = Field(
        None, description="web search: not supported (400)"
    )


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[FunctionTool] | None = Field(None, description="with messages: shown as chat")
    add_special_tokens: bool = True


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[TokenId]
