"""The real default model (SmolLM2-135M-Instruct): chat through the openai SDK, and the
tokenizer directory it is served from, which transformers 4.x loads too."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

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


def test_the_cached_tokenizer_names_a_class_every_transformers_knows(server):
    """transformers 5 saves `TokenizersBackend`, which 4.x cannot load; the cache says
    `PreTrainedTokenizerFast` (4.57.6 was checked by hand to load it: docs in the README), and
    the transformers installed here loads it as the same tokenizer the server uses."""
    path = server.app.state.client.core.engine.path
    settings = json.loads((path / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(path)
    text = "Hello, world! 日本語 <|im_end|>"
    assert loaded(text).input_ids == server.app.state.serving.inputs.encode(text, special=True)
