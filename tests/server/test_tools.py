"""Tool calls: the answer parsed into calls (whole or streamed), tools in the prompt, and a tiny
model trained here to call a tool, served for real: `auto` finds its call, streamed as the SDK
accumulates it, and the conversation goes on with the tool's result."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from stride.engine.config import EngineConfig
from stride.server import request_schemas as rq
from stride.server import tools
from stride.server.app import ServerConfig
from tests.helpers.models import VOCAB_SIZE, make_tokenizer
from tests.helpers.servers import LiveServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def auto(*functions: dict, parallel: bool = True) -> tools.Tools:
    defs = [rq.FunctionDefinition.model_validate(f["function"]) for f in functions]
    return tools.Tools(defs, "auto", parallel=parallel)


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWERS = [  # (text, content, [(name, arguments)])
    (f"<tool_call>\n{CALL}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    (f"Let me look. <tool_call>{CALL}</tool_call>", "Let me look.",
     [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>{CALL}</tool_call><tool_call>{CALL.replace('Paris', 'Oslo')}</tool_call>", None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    (f"<tool_call>{CALL}", None, [("get_weather", {"city": "Paris"})]),  # stopped before closing
    (CALL.replace("arguments", "parameters"), None, [("get_weather", {"city": "Paris"})]),
    (f"[{CALL}, {CALL}]", None, [("get_weather", {"city": "Paris"})] * 2),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', None,
     [("get_weather", {"city": "Rome"})]),  # arguments as a JSON string
    ("It is 3 < 4 and <tool_ is no tag.", "It is 3 < 4 and <tool_ is no tag.", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    ("", "", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), ANSWERS)
def test_answers_split_into_content_and_calls(text, content, calls):
    got_content, got_calls, _ = tools.split_answer(text, auto(WEATHER))
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    # streamed in pieces of every size, the same calls and text come out
    for size in (1, 2, 5, 17):
        parser = tools.AnswerParser(auto(WEATHER))
        pieces = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
        pieces.append(parser.finish())
        streamed = "".join(p.content for p in pieces)
        assert streamed.strip() == (content or "").strip()
        assert [(c.name, json.loads(c.arguments)) for p in pieces for c in p.calls] == calls


@pytest.mark.parametrize(
    "text,whole",
    [
        (f"<tool_call>{CALL}</tool_call>", True),
        (f"<tool_call>{CALL}</tool_call>\n", True),
        (f"Let me look. <tool_call>{CALL}</tool_call>", True),
        (f"<tool_call>{CALL}</tool_call><tool_call>{CALL[:20]}", False),  # a second one, cut
        (f"<tool_call>{CALL}</tool_call> and then", False),
        (CALL, True),
        (CALL[:-1], False),
        ("no call at all", False),
    ],
)
def test_an_answer_of_whole_calls_says_so(text, whole):
    """What decides `tool_calls` over `length` for an answer that reached max_tokens."""
    assert tools.split_answer(text, auto(WEATHER))[2] is whole


def test_one_call_when_parallel_calls_are_off():
    text = f"<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>"
    _, calls, _ = tools.split_answer(text, auto(WEATHER, parallel=False))
    assert len(calls) == 1


# ---- the prompt --------------------------------------------------------------------------------

TOOLS_TEMPLATE = (  # a template that shows tools and calls itself (as Qwen's and Llama's do)
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]  # fmt: skip


def rendered(server, messages, with_tools: bool = True) -> str:
    body = {"messages": messages, **({"tools": [WEATHER]} if with_tools else {})}
    ids = server.post("/tokenize", body).json()["tokens"]
    return server.app.state.serving.inputs.decode(ids)


def test_tools_reach_the_model_through_its_template_or_the_system_message(caller):
    server = caller
    tokenizer = server.app.state.serving.tokenizer
    plain = tokenizer.chat_template
    # The tiny model's template knows no tools: they go into a system message, calls as text.
    text = rendered(server, CONVERSATION)
    assert text.startswith("<|im_start|>system\n" + tools.tools_prompt(auto(WEATHER)))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    assert "<tools>" not in rendered(server, CONVERSATION, with_tools=False)
    # A template that shows them gets them as `tools` and `tool_calls` (arguments as objects).
    tokenizer.chat_template = TOOLS_TEMPLATE
    try:
        text = rendered(server, CONVERSATION)
    finally:
        tokenizer.chat_template = plain
    assert text.startswith("TOOLS:[get_weather]<|im_start|>user\n")
    assert 'CALL get_weather {"city": "Paris"}' in text and "<tools>" not in text


# ---- a tiny model that calls a tool --------------------------------------------------------------

FIRST = [{"role": "user", "content": "What is the weather in Paris?"}]
FIRST_ANSWER = f"<tool_call>\n{CALL}\n</tool_call>"
RESULT = "sunny, 21 C"
SECOND_ANSWER = "It is sunny in Paris."


def conversation(call_id: str) -> list[dict]:
    return FIRST + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]  # fmt: skip


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt a chat request with these messages and the weather tool gets: the server's
    own rendering (`tools.template_messages`, the chat template, no special tokens added)."""
    body = rq.ChatCompletionRequest.model_validate({"messages": messages, "tools": [WEATHER]})
    shown = tools.template_messages(body.messages, tools.resolve(body), tokenizer.chat_template)
    text = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False)
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory) -> Path:
    """A tiny model trained to answer the weather question with a call, and the tool's
    result with a sentence: what a model with tool calling does, in a few seconds of CPU."""
    tokenizer = make_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pairs = [
        (prompt_ids(tokenizer, FIRST), FIRST_ANSWER),
        (prompt_ids(tokenizer, conversation("call_0")), SECOND_ANSWER),
    ]
    examples = [(p, p + tokenizer.encode(a, add_special_tokens=False) + [end]) for p, a in pairs]
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(400):
        loss = 0.0
        for prompt, ids in examples:
            labels = torch.tensor([[-100] * len(prompt) + ids[len(prompt) :]])
            loss = loss + model(torch.tensor([ids]), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    path = tmp_path_factory.mktemp("caller") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def caller(caller_dir):
    engine = EngineConfig(model=str(caller_dir), device="cpu", kv_cache_memory=8 << 20)
    live = LiveServer(ServerConfig(engine=engine))
    yield live
    live.stop()


def test_auto_finds_the_call_the_model_makes(caller):
    client = caller.openai()
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=FIRST, tools=[WEATHER], temperature=0, max_tokens=128)
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # tool_choice none: the tools are not shown and nothing is parsed, as with no tools at all
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    no_tools = {k: v for k, v in kw.items() if k != "tools"}
    alone = client.chat.completions.create(**no_tools).choices[0]
    assert plain.finish_reason != "tool_calls" and plain.message.tool_calls is None
    assert plain.message.content == alone.message.content
    # streamed: text deltas held while they may be a call, then one tool-call delta
    with client.chat.completions.stream(**kw) as events:
        for _ in events:
            pass
        streamed = events.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_the_conversation_goes_on_with_the_tool_result(caller):
    client = caller.openai()
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=FIRST, tools=[WEATHER], temperature=0, max_tokens=128
    ).choices[0].message
    history = FIRST + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": RESULT},
    ]
    out = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], temperature=0, max_tokens=128
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == SECOND_ANSWER


def test_a_content_part_the_model_cannot_read_is_a_400(caller):
    """Audio (or an image, a file) in a message: a 400 naming the messages, never a 500."""
    client = caller.openai()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        )  # fmt: skip
    assert e.value.body["param"] == "messages"
