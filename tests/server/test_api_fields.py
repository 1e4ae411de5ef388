"""Every field of OpenAI's request schemas is accepted, and acted on or knowingly ignored.

The lists of fields come from the installed openai SDK's own request types, so a field the SDK
gains fails these tests until Stride decides what to do with it. Also: `models.retrieve`,
`/tokenizer_info` (and the rest of lm-eval's remote tokenizer), vLLM's
`stream_options.continuous_usage_stats`, and `best_of`.
"""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from stride.engine.config import EngineConfig
from stride.server.app import ServerConfig
from tests.helpers.servers import LiveServer

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20,
                          served_name="tiny/model")  # fmt: skip
    live = LiveServer(ServerConfig(engine=engine))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


MODEL = "tiny/model"  # a name with a slash: models.retrieve must still find it
HISTORY = [
    {"role": "developer", "content": "Be brief.", "name": "dev"},
    {"role": "system", "content": [{"type": "text", "text": "You look words up.",
                                    "prompt_cache_breakpoint": {"mode": "explicit"}}]},  # fmt: skip
    {"role": "user", "content": [{"type": "text", "text": "What is a fox?"}], "name": "ann"},
    {"role": "assistant", "content": None, "refusal": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "lookup", "arguments": '{"word": "fox"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a small wild canine"},
    {"role": "assistant", "content": [{"type": "text", "text": "A small wild canine."}]},
    {"role": "user", "content": "And a dog?"},
]


def chat_fields() -> dict:
    """A value for every field of the SDK's chat request that Stride accepts."""
    return {
        "messages": HISTORY,
        "model": MODEL,
        "audio": None,  # audio output: only its absence
        "frequency_penalty": 0.1,
        "logit_bias": {"5": 1.0},
        "logprobs": True,
        "max_completion_tokens": 6,
        "max_tokens": 8,
        "metadata": {"team": "search"},
        "modalities": ["text"],
        "moderation": {"model": "omni-moderation-latest"},
        "n": 2,
        "parallel_tool_calls": False,
        "prediction": {"type": "content", "content": "A dog is"},
        "presence_penalty": 0.1,
        "prompt_cache_key": "dictionary",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "prompt_cache_retention": "in_memory",
        "reasoning_effort": "low",
        "response_format": {"type": "text"},
        "safety_identifier": "user-1",
        "seed": 3,
        "service_tier": "auto",
        "stop": ["\n\n"],
        "store": False,
        "stream_options": None,
        "temperature": 0.7,
        "tool_choice": "auto",
        "tools": [TOOL],
        "top_logprobs": 2,
        "top_p": 0.9,
        "user": "ann",
        "verbosity": "low",
        "web_search_options": None,  # web search: only its absence
    }


def legacy_fields() -> dict:
    """The deprecated function fields (they exclude tools)."""
    return {"functions": [TOOL["function"]], "function_call": "auto"}


def completion_fields() -> dict:
    return {
        "model": MODEL,
        "prompt": "Once upon a time",
        "best_of": 2,
        "echo": True,
        "frequency_penalty": 0.1,
        "logit_bias": {"5": -1.0},
        "logprobs": 2,
        "max_tokens": 5,
        "n": 1,
        "presence_penalty": 0.1,
        "seed": 4,
        "stop": "\n\n",
        "stream_options": None,
        "suffix": None,  # fill-in-the-middle: only its absence
        "temperature": 0.8,
        "top_p": 0.95,
        "user": "bob",
    }


def sdk_fields(params) -> set[str]:
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


def test_every_chat_field_of_the_sdk_is_accepted(client):
    fields = chat_fields()
    assert set(fields) | set(legacy_fields()) | {"stream"} == sdk_fields(chat_create_params)
    out = client.chat.completions.create(**fields)
    assert len(out.choices) == 2 and out.usage.completion_tokens > 0
    assert all(len(c.logprobs.content) <= 6 for c in out.choices)  # max_completion_tokens
    chunks = list(client.chat.completions.create(
        **{**fields, "stream_options": {"include_usage": True, "include_obfuscation": False}},
        stream=True,
    ))  # fmt: skip
    assert chunks[-1].usage.completion_tokens > 0
    legacy = {k: v for k, v in fields.items() if k not in ("tools", "tool_choice")}
    out = client.chat.completions.create(**legacy, **legacy_fields())
    assert len(out.choices) == 2


def test_every_completion_field_of_the_sdk_is_accepted(client):
    fields = completion_fields()
    assert set(fields) | {"stream"} == sdk_fields(completion_create_params)
    out = client.completions.create(**fields)
    assert len(out.choices) == 1 and out.choices[0].text.startswith("Once upon a time")
    streamed = list(client.completions.create(**{**fields, "best_of": None}, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("chat", {"web_search_options": {}}, "web_search_options"),
        ("chat", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
        ("chat", {"tools": [TOOL], "functions": [TOOL["function"]]}, "functions"),
        ("chat", {"metadata": {"k": 1}}, "metadata.k"),
        ("chat", {"not_an_openai_field": 1}, "not_an_openai_field"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("completions", {"best_of": 1, "n": 2}, "best_of"),
        ("completions", {"best_of": 2, "stream": True}, "best_of"),
    ],  # fmt: skip
)
def test_what_cannot_be_done_is_a_clear_400(server, route, fields, param):
    if route == "chat":
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
        r = server.post("/v1/chat/completions", body)
    else:
        r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_models_retrieve(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra["max_model_len"] == client.models.list().data[0].max_model_len
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_tokenizer_info_and_the_remote_tokenizer_routes(server):
    """What lm-eval's `tokenizer_backend=remote` reads: /tokenizer_info, /tokenize with
    add_special_tokens false, /detokenize."""
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    tokenizer = server.app.state.serving.tokenizer
    assert info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == server.app.state.serving.max_model_len
    ids = server.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert ids["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    text = server.post("/detokenize", {"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_puts_usage_in_every_chunk(server, path):
    """What guidellm and aiperf --per-chunk-usage send: the usage so far in every chunk."""
    body = {"max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True, "stop": None,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    body |= chat if "chat" in path else {"prompt": "Hi"}
    chunks = sse(server, path, body)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    assert [u["completion_tokens"] for u in usages] == sorted(u["completion_tokens"]
                                                              for u in usages)  # fmt: skip
    assert usages[-1]["completion_tokens"] == 6
    assert all(u["prompt_tokens"] == usages[-1]["prompt_tokens"] for u in usages)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    plain = sse(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] is not None


def test_best_of_returns_the_samples_with_the_best_mean_logprob(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    samples = client.completions.create(**kw, n=3, logprobs=0).choices
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in samples]
    best = client.completions.create(**kw, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == samples[max(range(3), key=means.__getitem__)].text
    assert best.usage.completion_tokens == 18  # every sample drawn counts
