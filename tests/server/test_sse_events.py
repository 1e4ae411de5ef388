"""Text-only SSE events come from a per-choice template: byte for byte what pydantic writes."""

from __future__ import annotations

import random

import pytest

from stride.scheduler.outputs import RequestOutput
from stride.server import request_schemas as rq
from stride.server.chat_view import ChatView
from stride.server.completion_view import CompletionView
from stride.server.logprobs import Pieces

TEXTS = ["", "a", ' "quoted" \\ back', "tab\tnew\nline\r\x00\x1f\x7f", "é日本🙂\u2028\ufeff\ue000"]


MODEL = "tiny/model"
NO_PIECES = Pieces(lambda ids: "")  # no logprobs asked for


def _views(include_usage: bool):
    options = {"include_usage": True} if include_usage else None
    completion = rq.CompletionRequest(prompt="x", stream=True, stream_options=options, n=2)
    chat = rq.ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], stream=True, stream_options=options
    )
    yield CompletionView(MODEL, NO_PIECES, completion, "cmpl-1", [[1]], [""])
    yield ChatView(MODEL, NO_PIECES, chat, "chatcmpl-1", [[1]])


@pytest.mark.parametrize("include_usage", [False, True])
def test_text_events_are_what_pydantic_writes(include_usage):
    rng = random.Random(0)
    alphabet = [chr(i) for i in range(128)] + list("éü日本語🙂\u2028\ufeff\ue000\U0010ffff")
    texts = TEXTS + ["".join(rng.choices(alphabet, k=rng.randint(1, 16))) for _ in range(300)]
    for view in _views(include_usage):
        for i, text in enumerate(texts):
            index = i % len(view.choices)
            out = RequestOutput(f"r{index}", token_ids=[7], text=text, num_output_tokens=1)
            chunk = view.delta(index, out)
            expected = None if chunk is None else view.chunk(chunk)
            assert view.event(index, out) == expected
