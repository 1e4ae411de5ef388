"""The generation endpoints (and /tokenize): OpenAI requests in, engine requests out; engine
outputs in, OpenAI responses (or SSE) out.

One request reads top to bottom: `requests.Inputs` checks and tokenizes what it asks for and
builds its engine requests; `generation.Generation` submits them to the engine client; a view
(`completion_view`, `chat_view`) is made for its answer; `respond` writes the answer from the
generation's outputs, as one response or as a stream. Nothing here touches engine internals:
requests cross to the step loop as plain `GenerateRequest`s and come back as plain
`RequestOutput`s.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request

from stride.metrics.registry import Metrics
from stride.scheduler.client import BaseClient
from stride.scheduler.outputs import GenerateRequest
from stride.server import request_schemas as rq
from stride.server import respond, structured
from stride.server import response_schemas as rs
from stride.server.chat_view import ChatView
from stride.server.completion_view import CompletionView
from stride.server.errors import APIError, from_exception
from stride.server.generation import Generation, Running
from stride.server.logprobs import Pieces
from stride.server.requests import (
    Inputs,
    best_of,
    check_modalities,
    content,
    most_prompt_logprobs,
    num_prompts,
    off_loop,
    size,
)
from stride.server.respond import ClientGone, unless_disconnected
from stride.server.tools import Tools
from stride.server.tools import resolve as resolve_tools
from stride.server.views import View
from stride.tracing import RequestTrace, Tracing, request_attributes


class Serving:
    def __init__(
        self,
        client: BaseClient,
        default_decoder: str | dict[str, Any],
        running: Running,
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.client = client
        self.running = running
        self.metrics = metrics
        self.tracing = tracing
        self.inputs = Inputs(client.model, default_decoder)
        self.pieces = Pieces(self.inputs.decode)
        self.model_name = self.inputs.model_name
        self.max_model_len = self.inputs.max_model_len
        self.tokenizer = self.inputs.tokenizer

    # ---- /v1/completions ------------------------------------------------------------------------

    async def completions(self, request: Request, body: rq.CompletionRequest):
        inputs = self.inputs
        inputs.check_model(body.model)
        if body.suffix is not None:
            why = "suffix (fill-in-the-middle) is not supported"
            raise APIError("invalid_request", why, "suffix")
        samples = best_of(body)
        inputs.check_sequences(
            num_prompts(body.prompt) * samples, "n" if samples == body.n else "best_of"
        )
        constraint = structured.constraint_of(body)
        prompts, texts = await off_loop(lambda: inputs.prompts(body.prompt), size(body.prompt))
        # max_tokens 0 (lm-eval's and HELM's way to score a prompt with echo): the engine
        # draws one token, which the answer leaves out
        scoring = body.max_tokens == 0
        max_tokens = 1 if scoring else body.max_tokens or inputs.default_max_tokens(prompts)
        inputs.check_context(prompts, max_tokens)
        # best_of ranks its samples by their logprobs: drawn with them, returned without
        logprobs = body.logprobs if samples == body.n else max(body.logprobs or 0, 0)
        prompt_k = most_prompt_logprobs(body.logprobs if body.echo else None, body.prompt_logprobs)
        params = inputs.sampling(body, max_tokens, logprobs, constraint, prompt_k)
        rid = f"cmpl-{uuid.uuid4().hex}"
        requests = inputs.requests(body, prompts, params, rid)
        gen = await self._start(request, body, requests, "text_completion", samples)
        echo = [texts[i] if body.echo else "" for i in range(len(prompts))]
        view = CompletionView(self.model_name, self.pieces, body, rid, prompts, echo, samples,
                              generated=not scoring)  # fmt: skip
        return await self._respond(request, body, view, gen)

    # ---- /v1/chat/completions -------------------------------------------------------------------

    async def chat(self, request: Request, body: rq.ChatCompletionRequest):
        inputs = self.inputs
        inputs.check_model(body.model)
        check_modalities(body)
        inputs.check_sequences(body.n, "n")
        tools = resolve_tools(body)
        constraint = structured.constraint_of(body)
        if tools is not None and tools.constraint() is not None:
            if constraint is not None:
                why = "a required or named tool call cannot also follow another output constraint"
                raise APIError("invalid_request", why, "tool_choice")
            constraint = structured.checked(tools.constraint(), "tools")
        chars = sum(len(content(m.content)) for m in body.messages)
        prompt = await off_loop(lambda: inputs.chat_prompt(body.messages, tools), chars)
        max_tokens = (
            body.max_completion_tokens or body.max_tokens or inputs.default_max_tokens([prompt])
        )
        inputs.check_context([prompt], max_tokens)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = inputs.sampling(body, max_tokens, k, constraint, body.prompt_logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await self._start(request, body, inputs.requests(body, [prompt], params, rid), "chat")
        view = ChatView(self.model_name, self.pieces, body, rid, [prompt], tools=tools)
        return await self._respond(request, body, view, gen)

    # ---- both -----------------------------------------------------------------------------------

    async def _start(
        self,
        request: Request,
        body: rq.SamplingFields,
        requests: list[GenerateRequest],
        operation: str,
        samples: int | None = None,
    ) -> Generation:
        """Submit the requests (their deadline runs from the request's arrival, which the app
        notes); an error of the engine's is the request's API error. `operation` (`chat`,
        `text_completion`) names the request's trace; `samples` per prompt: `body.n`, or
        best_of's."""
        arrival = getattr(request.state, "arrival", time.monotonic())
        samples = samples or body.n
        trace = self._trace(request, operation, arrival, requests[0], samples)
        for r in requests:
            r.trace = trace is not None
        deadline = None if body.timeout is None else arrival + body.timeout
        gen = Generation(
            self.client, requests, samples, self.running, self.metrics, deadline, trace
        )
        try:
            await unless_disconnected(request, gen.start())
        except ClientGone:
            raise
        except Exception as e:
            raise from_exception(e) from e
        return gen

    def _trace(
        self, request: Request, operation: str, arrival: float, first: GenerateRequest, n: int
    ) -> RequestTrace | None:
        """The request's trace, if tracing is on and the sampler keeps it."""
        if self.tracing is None:
            return None
        p = first.params
        attrs = request_attributes(first.decoder, first.decoder_options, p.max_tokens,
                                   p.temperature, n)  # fmt: skip
        return self.tracing.start(operation, self.model_name, request.headers, arrival, attrs)

    async def _respond(
        self, request: Request, body: rq.SamplingFields, view: View, gen: Generation
    ):
        if body.stream:
            return respond.stream(view, gen)
        return await respond.collect(request, view, gen)

    # ---- /tokenize ------------------------------------------------------------------------------

    async def tokenize(self, body: rq.TokenizeRequest) -> rs.TokenizeResponse:
        """Token ids of a prompt, or of messages as a chat request shows them; bounded as the
        generation routes are (a text too long for the context is refused, by its length
        alone where it can be)."""
        inputs = self.inputs
        inputs.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("invalid_request", "give exactly one of 'prompt' and 'messages'")
        if body.prompt is not None:
            prompt, special = body.prompt, body.add_special_tokens
            work = lambda: inputs.encode_prompt(prompt, special, "prompt")  # noqa: E731
            ids = await off_loop(work, len(prompt))
        else:
            messages = body.messages
            # as a chat request with these tools would show them
            tools = Tools([t.function for t in body.tools], "auto") if body.tools else None
            chars = sum(len(content(m.content)) for m in messages)
            ids = await off_loop(lambda: inputs.chat_prompt(messages, tools), chars)
        return rs.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)
