"""Structured outputs through the openai SDK against a live server on the default model.

`client.chat.completions.parse(response_format=Model)` for eleven schemas (tests/
helpers/schemas.py), streamed and not, with every decoder: each answer parses into its model
and validates against the strict JSON schema the SDK sent (jsonschema), every decoder gives the
same answer (they are lossless, and so is the grammar's mask), and free requests in the same
batch answer what they answer alone. Tool calls with `tool_choice` required or named are valid
under their tools' schemas; vLLM's guided fields and bad constraints get what they ask for.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema

from tests.helpers.schemas import SCHEMAS
from tests.helpers.servers import LiveServer

DECODERS = {  # a fixed K and a fixed window: every step drafts, and its drafts meet the grammar
    "ar": "ar",
    "speculative-ngram": {"type": "speculative", "draft": "ngram", "adaptive": False},
    "speculative-eagle": {"type": "speculative", "draft": "eagle", "adaptive": False},
    "refine-jacobi": {"type": "refine", "method": "jacobi", "window": 4},
}
FREE = ["Name three colours.", "Count from one to five.", "Say hello in French."]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def server(default_server) -> LiveServer:
    return default_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def parse(client, model, cls, ask: str, decoder, stream: bool):
    """One `parse` (or its streaming helper): the parsed object and the completion."""
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": ask}],
        response_format=cls,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"decoder": decoder},
    )
    if not stream:
        completion = client.chat.completions.parse(**kw)
    else:
        with client.chat.completions.stream(**kw) as events:
            for _ in events:
                pass
            completion = events.get_final_completion()
    return completion.choices[0].message.parsed, completion


def free(client, model, ask: str, decoder) -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ask}], temperature=0, max_tokens=24,
        extra_body={"decoder": decoder},
    )  # fmt: skip
    return out.choices[0].message.content


@pytest.fixture(scope="module")
def answers(client, model) -> dict[str, dict]:
    """Every schema, streamed and not, and the free requests, with each decoder: all of one
    decoder's requests in flight together (one batch)."""
    out: dict[str, dict] = {}
    for name, decoder in DECODERS.items():
        with ThreadPoolExecutor(2 * len(SCHEMAS) + len(FREE)) as pool:
            parsed = {
                (cls, stream): pool.submit(parse, client, model, cls, ask, decoder, stream)
                for cls, ask in SCHEMAS.items()
                for stream in (False, True)
            }
            freed = {ask: pool.submit(free, client, model, ask, decoder) for ask in FREE}
            out[name] = {
                "parsed": {key: f.result() for key, f in parsed.items()},
                "free": {ask: f.result() for ask, f in freed.items()},
            }
    return out


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_parse_gives_schema_valid_objects(answers, decoder):
    for (cls, stream), (obj, completion) in answers[decoder]["parsed"].items():
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", (cls.__name__, stream)
        assert isinstance(obj, cls)
        jsonschema.validate(json.loads(choice.message.content), to_strict_json_schema(cls))


def test_every_decoder_and_both_modes_answer_alike(answers):
    texts = {
        (name, cls, stream): completion.choices[0].message.content
        for name, run in answers.items()
        for (cls, stream), (_, completion) in run["parsed"].items()
    }
    for (_, cls, _), text in texts.items():
        assert text == texts[("ar", cls, False)]


def test_free_requests_in_a_constrained_batch_are_unchanged(client, model, answers):
    for name, decoder in DECODERS.items():
        for ask, text in answers[name]["free"].items():
            assert text == free(client, model, ask, decoder)  # alone now


def test_speculative_requests_drafted_under_the_grammar(answers):
    for name in ("speculative-ngram", "speculative-eagle"):
        drafted = sum(
            completion.usage.model_extra["decoder"].get("draft_tokens", 0)
            for (_, stream), (_, completion) in answers[name]["parsed"].items()
            if not stream
        )
        assert drafted > 0, name


# ---- tools with the default model --------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_calls(calls, parallel: bool = True) -> None:
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name])


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_required_and_named_tool_calls_are_schema_valid(client, model, choice, decoder):
    kw = dict(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0,
        max_tokens=MAX_TOKENS, extra_body={"decoder": DECODERS[decoder]},
    )  # fmt: skip
    out = client.chat.completions.create(**kw)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_time"]
    # streamed: the SDK accumulates the tool-call deltas into the same calls
    with client.chat.completions.stream(**kw) as events:
        for _ in events:
            pass
        streamed = events.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]


def test_one_call_when_parallel_calls_are_off(client, model):
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    check_calls(out.choices[0].message.tool_calls, parallel=False)


def test_allowed_tools_and_legacy_functions(client, model):
    only_time = [{"type": "function", "function": {"name": "get_time"}}]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": only_time}}
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=allowed, temperature=0,
        max_tokens=MAX_TOKENS,
    )  # fmt: skip
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_time"]
    legacy = client.chat.completions.create(
        model=model, messages=ASK, functions=[WEATHER["function"]],
        function_call={"name": "get_weather"}, temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    choice = legacy.choices[0]
    assert choice.finish_reason == "function_call" and not choice.message.tool_calls
    call = choice.message.function_call
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOLS["get_weather"])


# ---- vLLM's fields and completions -------------------------------------------------------------


ANSWER = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_vllm_guided_fields_on_completions_and_chat(server, model):
    prompt = "Q: Is the sky blue? A:"
    cases = [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r" [0-9]{2}-[0-9]{2}"}, lambda t: re.fullmatch(r" [0-9]{2}-[0-9]{2}", t)),
        ({"guided_json": ANSWER}, lambda t: isinstance(json.loads(t)["answer"], bool)),
        ({"guided_grammar": 'root ::= "The sky is " ("blue" | "grey") "."'},
         lambda t: t in ("The sky is blue.", "The sky is grey.")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ]  # fmt: skip
    for fields, ok in cases:
        body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0, **fields}
        r = server.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert ok(text), (fields, text)
        chat = {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 64, "temperature": 0, **fields}  # fmt: skip
        r = server.post("/v1/chat/completions", chat)
        assert r.status_code == 200, r.text
        assert ok(r.json()["choices"][0]["message"]["content"]), fields


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": schema_format({"type": "nope"})}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
        ({"response_format": schema_format({"uniqueItems": True})}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ],  # fmt: skip
)
def test_bad_constraints_are_400s(server, model, fields, param):
    body = {"model": model, "messages": ASK, "max_tokens": 4, **fields}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and error["param"].startswith(param), error
    server.wait_idle()


def test_the_grammar_engine_refuses_what_it_cannot_enforce_by_name(server, model):
    """A keyword llguidance does not implement is named in the 400 (never silently dropped)."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    r = server.post("/v1/completions", {"model": model, "prompt": "x", "guided_json": schema})
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]


def test_a_stream_of_a_constrained_request_ends_once(server, model):
    body = {"model": model, "messages": ASK, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "response_format": {"type": "json_object"}}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons.count("stop") == 1 and reasons[-1] == "stop"
    json.loads("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks))
