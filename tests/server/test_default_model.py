"""Chat against the real default model (SmolLM2-135M-Instruct) through the openai SDK."""

from __future__ import annotations

import pytest

from stride.engine.config import EngineConfig
from stride.server.app import ServerConfig
from tests.helpers.servers import LiveServer

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def server():
    engine = EngineConfig(device="cpu", kv_cache_memory=64 << 20)
    live = LiveServer(ServerConfig(engine=engine))
    yield live
    live.stop()


def test_chat_streams_an_answer_through_the_chat_template(server):
    client = server.openai()
    model = client.models.list().data[0].id
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in answer
    serving = server.app.state.serving
    template = serving.tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    )
    assert chunks[-1].usage.prompt_tokens == len(serving.inputs.encode(template, special=False))
