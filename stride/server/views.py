"""A response in the making: the choices gathered from engine outputs, the usage, and the shape
of the chunks a stream sends. One subclass per route: `CompletionView` (/v1/completions) and
`ChatView` (/v1/chat/completions). A view shapes and serializes, down to each chunk's
server-sent event (`sse_event`: its text-only events are cut from a template of it); `respond`
drives it and writes the rest of the stream.

In a stream, `usage.decoder` and `usage.timings` appear once every choice has finished (before
that the chunks leave them out): a field never changes its type between chunks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) quotes with

from stride.decoders.sampling import TokenLogprob
from stride.scheduler.outputs import RequestOutput
from stride.server import request_schemas as rq
from stride.server import response_schemas as rs
from stride.server.logprobs import Pieces


@dataclass
class Choice:
    """Everything one choice produced, gathered from its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.last = out

    def mean_logprob(self) -> float:
        """What best_of ranks samples by: the mean log-probability of their tokens."""
        scored = [lp.logprob for lp in self.logprobs if lp is not None]
        return sum(scored) / len(scored) if scored else -math.inf


_USAGE = {"usage"}
_PLACEHOLDER = RequestOutput("", text="\ue000stride-text\ue000")  # private use: in no name
_PLACEHOLDER_JSON = encode_basestring(_PLACEHOLDER.text)  # as pydantic writes it (tested)


def sse_event(data: str) -> str:
    """One server-sent event carrying `data` (JSON text): `data: <json>`."""
    return f"data: {data}\n\n"


class View:
    """One response in the making: choices, usage, and the shape of its chunks."""

    CHUNK: type  # the pydantic model of a streamed chunk

    def __init__(
        self,
        model_name: str,
        pieces: Pieces,
        body: rq.SamplingFields,
        rid: str,
        prompts: list[list[int]],
        samples: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.pieces = pieces
        self.body = body
        self.rid = rid
        self.prompts = prompts
        self.samples = samples or body.n  # per prompt (best_of draws more than it returns)
        self.choices = [Choice() for _ in range(len(prompts) * self.samples)]
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's continuous_usage_stats: the usage so far in every chunk
        self.usage_always = self.include_usage and bool(options and options.continuous_usage_stats)
        self.created = int(time.time())  # every chunk carries the same, as OpenAI's do
        self.generated = True  # False: max_tokens 0, the generated token is left out
        self._text_events: dict[int, tuple[str, str]] = {}  # choice -> around a text delta

    def _chunk_of(self, choices: list, usage: rs.Usage | None = None):
        return self._envelope(self.CHUNK, choices, usage)

    def _envelope(self, model: type, choices: list, usage: rs.Usage | None):
        """A response or chunk of this response: its id, creation time and model name."""
        return model(
            id=self.rid,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
        )

    def add(self, index: int, out: RequestOutput) -> RequestOutput:
        """Gather an output into its choice; what of it the answer shows."""
        if not self.generated:  # max_tokens 0: the one token drawn is left out
            out = replace(out, token_ids=[], text="", logprobs=[], num_output_tokens=0)
        self.choices[index].add(out)
        return out

    def usage(self) -> rs.Usage:
        """The usage so far (in a stream), or of the whole response once every choice ended."""
        done = [c.last for c in self.choices if c.last is not None]
        prompt = sum(len(p) for p in self.prompts)
        decoder = timings = None
        if len(done) == len(self.choices):
            completion = sum(o.num_output_tokens for o in done)
            decoder = [o.decoder_stats for o in done]
            timings = [o.timings for o in done]
            if len(done) == 1:
                decoder, timings = decoder[0], timings[0]
        else:
            completion = sum(len(c.token_ids) for c in self.choices)
        return rs.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=rs.PromptTokensDetails(cached_tokens=self.cached_tokens()),
            decoder=decoder,
            timings=timings,
        )

    def cached_tokens(self) -> int:
        """Prompt tokens read from the prefix cache, each prompt counted once (as in
        `prompt_tokens`): for the sample of it that found the fewest."""
        n = self.samples
        total = 0
        for i in range(len(self.prompts)):
            samples = [c.last for c in self.choices[i * n : (i + 1) * n] if c.last is not None]
            total += min((o.num_cached_tokens for o in samples), default=0)
        return total

    def chunk(self, chunk: rs.Response) -> str:
        """The SSE event of a chunk (with the usage so far, under continuous_usage_stats)."""
        if self.usage_always and getattr(chunk, "usage", 0) is None:
            chunk.usage = self.usage()
        if self.include_usage:
            return sse_event(chunk.model_dump_json())
        return sse_event(chunk.model_dump_json(exclude=_USAGE))

    def event(self, index: int, out: RequestOutput) -> str | None:
        """The SSE event of one output. Most carry only text: those are the choice's text-delta
        event, serialized once with a placeholder, with the text put in its place (the same
        bytes as serializing each chunk, at a tenth of the cost)."""
        if not out.text or out.finished or self.wants_logprobs or self.shaped:
            chunk = self.delta(index, out)
            return None if chunk is None else self.chunk(chunk)
        around = self._text_events.get(index)
        if around is None:
            event = self.chunk(self.delta(index, _PLACEHOLDER))
            before, after = event.split(_PLACEHOLDER_JSON)
            around = self._text_events[index] = (before, after)
        return around[0] + encode_basestring(out.text) + around[1]

    def final_chunk(self) -> rs.Response:
        """The last chunk of a stream with include_usage: no choices, the whole usage."""
        return self._chunk_of([], self.usage())

    @property
    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    @property
    def shaped(self) -> bool:
        """Does a text output take more than its text in its chunk (usage, tool calls, the
        prompt)? Then every chunk is serialized whole."""
        return self.usage_always

    def opening(self) -> list[rs.Response]:
        """The chunks a stream starts with, before any output."""
        return []

    def delta(self, index: int, out: RequestOutput) -> rs.Response | None:
        """The chunk of one output (None: it shows nothing)."""
        raise NotImplementedError

    def response(self) -> rs.Response:
        """The whole response, once every choice has ended."""
        raise NotImplementedError
