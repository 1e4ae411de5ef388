"""/v1/chat/completions as a view: assistant messages, with tool calls parsed out of the answer
(`tools`) as a whole or delta by delta. The first chunk of each choice says its role; later
deltas leave the role out.

An answer whose tool calls are whole finishes with `tool_calls` (`function_call` for the
deprecated `functions`), also where it reached max_tokens right as the last call closed.
"""

from __future__ import annotations

from stride.scheduler.outputs import RequestOutput
from stride.server import request_schemas as rq
from stride.server import response_schemas as rs
from stride.server.logprobs import Pieces
from stride.server.tools import AnswerParser, Call, Tools, split_answer
from stride.server.views import Choice, View


class ChatView(View):
    CHUNK = rs.ChatCompletionChunk
    body: rq.ChatCompletionRequest

    def __init__(
        self,
        model_name: str,
        pieces: Pieces,
        body: rq.ChatCompletionRequest,
        rid: str,
        prompts: list[list[int]],
        tools: Tools | None = None,
    ) -> None:
        super().__init__(model_name, pieces, body, rid, prompts)
        self.tools = tools
        self.parsers = [AnswerParser(tools) for _ in self.choices] if tools is not None else []
        self.announced: list[set[str]] = [set() for _ in self.choices]  # calls begun, by id

    def response(self) -> rs.ChatCompletionResponse:
        choices = []
        for i, c in enumerate(self.choices):
            message, reason = self._message(c)
            choices.append(
                rs.ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self.pieces.chat_logprobs(c.logprobs) if self.body.logprobs else None,
                    finish_reason=reason,
                    stop_reason=c.last.stop_reason,
                )
            )
        response = self._envelope(rs.ChatCompletionResponse, choices, self.usage())
        if self.body.prompt_logprobs is not None:
            first = self.choices[0].prompt_logprobs
            response.prompt_logprobs = self.pieces.vllm_prompt_logprobs(self.prompts[0], first)
        return response

    def _message(self, c: Choice) -> tuple[rs.AssistantMessage, str | None]:
        """The answer, with its tool calls parsed out (see `tools`), and its finish reason."""
        reason = c.last.finish_reason
        if self.tools is None:
            return rs.AssistantMessage(content=c.text), reason
        content, calls, whole = split_answer(c.text, self.tools)
        if not calls:
            return rs.AssistantMessage(content=content), reason
        reason = self._called(reason, whole)
        functions = [rs.CalledFunction(name=k.name, arguments=k.arguments) for k in calls]
        if self.tools.legacy:
            return rs.AssistantMessage(content=content, function_call=functions[0]), reason
        pairs = zip(calls, functions, strict=True)
        tool_calls = [rs.CalledTool(id=k.id, function=f) for k, f in pairs]
        return rs.AssistantMessage(content=content, tool_calls=tool_calls), reason

    def _called(self, reason: str | None, whole: bool) -> str | None:
        """An answer that calls tools says so where it stopped of its own accord, or reached
        max_tokens with its calls whole."""
        if reason != "stop" and not (reason == "length" and whole):
            return reason
        return "function_call" if self.tools is not None and self.tools.legacy else "tool_calls"

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.body.logprobs)

    @property
    def shaped(self) -> bool:
        return self.usage_always or self.tools is not None

    def opening(self) -> list[rs.Response]:
        return [
            self._chunk_of(
                [rs.ChatChunkChoice(index=i, delta=rs.Delta(role="assistant", content=""))]
            )
            for i in range(len(self.choices))
        ]

    def delta(self, index: int, out: RequestOutput) -> rs.Response | None:
        content, calls, reason = out.text, [], out.finish_reason
        if self.tools is not None:
            parser = self.parsers[index]
            piece = parser.feed(out.text)
            content, calls = piece.content, piece.calls
            if out.finished:
                rest = parser.finish()
                content, calls = content + rest.content, calls + rest.calls
                if parser.calls:
                    reason = self._called(reason, parser.whole)
        wants_logprobs = self.body.logprobs and out.token_ids
        if not (content or calls or out.finished or wants_logprobs):
            return None
        delta = rs.Delta(content=content or None)
        if calls:
            self._add_calls(index, delta, calls)
        choice = rs.ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=self.pieces.chat_logprobs(out.logprobs) if self.body.logprobs else None,
            finish_reason=reason,
            stop_reason=out.stop_reason,
        )
        return self._chunk_of([choice])

    def _add_calls(self, index: int, delta: rs.Delta, calls: list[Call]) -> None:
        """Tool-call deltas as the SDK accumulates them: a call's first one carries its index,
        id, type and name; later ones (a named call's arguments as they come) more arguments."""
        made = self.parsers[index].calls
        begun = self.announced[index]
        deltas = []
        for call in calls:
            first = call.id not in begun
            begun.add(call.id)
            function = rs.FunctionDelta(name=call.name if first else None, arguments=call.arguments)
            if self.tools.legacy:
                delta.function_call = function
                continue
            at = next(i for i, made_call in enumerate(made) if made_call.id == call.id)
            deltas.append(
                rs.ToolCallDelta(index=at, id=call.id if first else None,
                                type="function" if first else None, function=function)
            )  # fmt: skip
        delta.tool_calls = deltas or None
