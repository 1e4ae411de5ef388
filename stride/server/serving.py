"""The two generation endpoints: OpenAI requests in, engine requests out; engine outputs in,
OpenAI responses (or SSE) out.

`Serving` joins the pieces: `requests.Inputs` checks and tokenizes what a request asks for and
builds its engine requests, `streaming.Generation` submits them to the engine client and hands
back their outputs, and a `views` view shapes those as a response or a stream. It never touches
engine internals: requests cross to the step loop as plain `GenerateRequest`s and come back as
plain `RequestOutput`s.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request

from stride.metrics.registry import Metrics
from stride.scheduler.client import BaseClient
from stride.scheduler.outputs import GenerateRequest
from stride.server import schemas as s
from stride.server import structured
from stride.server.errors import APIError, from_exception
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
from stride.server.streaming import ClientGone, Generation, unless_disconnected
from stride.server.tools import resolve as resolve_tools
from stride.server.views import ChatView, CompletionView, Pieces, View, sse_response
from stride.tracing import RequestTrace, Tracing, request_attributes


class Serving:
    def __init__(
        self,
        client: BaseClient,
        default_decoder: str | dict[str, Any],
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.tracing = tracing
        self.inputs = Inputs(client.model, default_decoder)
        self.pieces = Pieces(self.inputs.decode)
        self.model_name = self.inputs.model_name
        self.max_model_len = self.inputs.max_model_len
        self.tokenizer = self.inputs.tokenizer

    # ---- /v1/completions ------------------------------------------------------------------------

    async def completions(self, request: Request, body: s.CompletionRequest):
        inputs = self.inputs
        inputs.check_model(body.model)
        if body.suffix is not None:
            why = "suffix (fill-in-the-middle) is not supported"
            raise APIError("invalid_request", why, "suffix")
        samples = best_of(body)
        inputs.check_sequences(num_prompts(body.prompt) * samples)
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

    async def chat(self, request: Request, body: s.ChatCompletionRequest):
        inputs = self.inputs
        inputs.check_model(body.model)
        check_modalities(body)
        inputs.check_sequences(body.n)
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
        body: s.SamplingFields,
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
        gen = Generation(self.client, requests, samples, self.metrics, deadline, trace)
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
        self, request: Request, body: s.SamplingFields, view: View, gen: Generation
    ):
        if body.stream:
            return sse_response(view.stream(gen))
        return await unless_disconnected(request, view.collect(gen))
