"""Tool calls: tools rendered through the chat template, calls constrained or parsed, streamed.

`tool_choice` decides what the output is:
- `none` (the default without tools): text; the tools are not shown to the model.
- `auto` (the default with tools): free text, parsed for calls afterwards: `<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen, SmolLM), or an answer that is
  nothing but such a JSON object, or a list of them (Llama 3's JSON form; `"parameters"` is read
  as `"arguments"`). Only calls of tools on offer count; what surrounds them is the content.
- `required`: the output is constrained to a JSON list of calls, each `{"name", "arguments"}`
  with arguments valid under that tool's schema (one call if `parallel_tool_calls` is false).
- a named function: the output is constrained to that function's arguments.
`allowed_tools` narrows the tools to some of them, in mode `auto` or `required`. The deprecated
`functions` and `function_call` are the same with one call at most, answered as `function_call`.

The tools reach the model through its chat template (`apply_chat_template(tools=...)`). A
template that has no place for them (it never reads `tools`) gets them in the system message
instead, in the Hermes format that `auto` parses; one that never reads `tool_calls` gets earlier
calls as `<tool_call>` text in the assistant's content.

Streaming: a named call streams its arguments as they come; `auto` streams text until something
may start a call (`<tool_call>` or a JSON object at the very start), holds it until the call is
whole, then sends it as one tool-call delta (id, name and arguments: what the SDK accumulates);
`required` sends its calls when the list is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from stride.engine.sequence import Constraint
from stride.server import request_schemas as rq
from stride.server.errors import APIError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Tools:
    """A chat request's tools, resolved: what is on offer and what the answer must be."""

    functions: list[rq.FunctionDefinition]
    mode: Literal["auto", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True
    legacy: bool = False  # asked through `functions`: answered with `function_call`

    @property
    def names(self) -> set[str]:
        return {f.name for f in self.functions}

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as a chat template reads them."""
        return [{"type": "function", "function": _definition(f)} for f in self.functions]

    def constraint(self) -> Constraint | None:
        """The grammar of a required or named call; None for auto."""
        if self.mode == "named":
            return Constraint("json_schema", json.dumps(_parameters(self._function(self.name))))
        if self.mode == "required":
            items = {"anyOf": [_call(f) for f in self.functions]}
            calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
            if not self.parallel:
                calls["maxItems"] = 1
            return Constraint("json_schema", json.dumps(calls))
        return None

    def _function(self, name: str | None) -> rq.FunctionDefinition:
        return next(f for f in self.functions if f.name == name)


def _definition(f: rq.FunctionDefinition) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        out["description"] = f.description
    out["parameters"] = _parameters(f)
    return out


def _parameters(f: rq.FunctionDefinition) -> dict[str, Any]:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def _call(f: rq.FunctionDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": _parameters(f)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def resolve(body: rq.ChatCompletionRequest) -> Tools | None:
    """The request's tools, or None when the answer is plain text (no tools, or `none`)."""
    functions = [t.function for t in body.tools or []]
    choice: Any = body.tool_choice
    legacy = body.functions is not None or body.function_call is not None
    if legacy:
        if body.tools is not None or body.tool_choice is not None:
            raise APIError("invalid_request", "give tools or functions, not both", "functions")
        functions = list(body.functions or [])
        choice = body.function_call
        if isinstance(choice, rq.FunctionName):
            choice = rq.NamedToolChoice(type="function", function=choice)
    if len({f.name for f in functions}) < len(functions):
        raise APIError("invalid_request", "tool names must be unique", "tools")
    param = "function_call" if legacy else "tool_choice"
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise APIError("invalid_request", f"{param} needs tools to choose from", param)
    names = {f.name for f in functions}
    parallel = body.parallel_tool_calls and not legacy
    if isinstance(choice, rq.NamedToolChoice):
        _known(choice.function.name, names, param)
        return Tools(functions, "named", choice.function.name, parallel, legacy)
    if isinstance(choice, rq.AllowedToolsChoice):
        allowed = [t.function.name for t in choice.allowed_tools.tools]
        for name in allowed:
            _known(name, names, param)
        functions = [f for f in functions if f.name in allowed]
        choice = choice.allowed_tools.mode
    return Tools(functions, choice, None, parallel, legacy)


def _known(name: str, names: set[str], param: str) -> None:
    if name not in names:
        raise APIError("invalid_request", f"{param} names {name!r}, which is not among the tools",
                       param)  # fmt: skip


# ---- the prompt ------------------------------------------------------------------------------


def template_messages(
    messages: list[rq.ChatMessage], tools: Tools | None, template: str
) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (and, for a template that cannot show
    tools or calls, with those written into the text)."""
    calls_in_text = "tool_calls" not in template
    out = [_message(m, calls_in_text) for m in messages]
    if tools is not None and "tools" not in template:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def tools_prompt(tools: Tools) -> str:
    """The Hermes format's description of the tools (what `auto` parses back)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.template_tools())
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CALL_CLOSE}"
    )


def _message(m: rq.ChatMessage, calls_in_text: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": content_text(m)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    calls = list(m.tool_calls or [])
    if m.function_call is not None:
        calls.append(rq.ToolCall(id="call_legacy", function=m.function_call))
    if calls:
        if calls_in_text:
            text = "\n".join(
                f"{CALL_OPEN}\n{json.dumps(_call_dict(c), ensure_ascii=False)}\n{CALL_CLOSE}"
                for c in calls
            )
            out["content"] = f"{out['content']}\n{text}".strip()
        else:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": _call_dict(c)} for c in calls
            ]
    return out


def _call_dict(call: rq.ToolCall) -> dict[str, Any]:
    """A call as templates read it: arguments as an object where they are one."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"name": call.function.name, "arguments": arguments}


def content_text(m: rq.ChatMessage) -> str:
    """A message's text; a part the model cannot read (an image, audio, a file) is a 400."""
    content = m.content
    if content is None:
        return m.refusal or ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, rq.TextPart):
            texts.append(part.text)
        elif isinstance(part, rq.RefusalPart):
            texts.append(part.refusal)
        else:
            raise APIError(
                "invalid_request",
                f"content parts of type {part.type!r} are not supported: this server reads text",
                "messages",
            )
    return "".join(texts)


# ---- the answer ------------------------------------------------------------------------------


@dataclass
class Call:
    id: str
    name: str
    arguments: str


def new_call(name: str, arguments: str) -> Call:
    return Call(f"call_{uuid.uuid4().hex[:24]}", name, arguments)


def parse_call(text: str, names: set[str]) -> Call | None:
    """One call's JSON (`{"name": ..., "arguments" | "parameters": {...}}`) naming a tool on
    offer, or None."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return _as_call(data, names)


def _as_call(data: Any, names: set[str]) -> Call | None:
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_call(data["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class Delta:
    """What a piece of the answer adds: text, and calls made whole (or, for a named call, a
    piece of its arguments: `Call` with the same id again)."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)


class AnswerParser:
    """Turns a choice's text, piece by piece, into content and tool calls (see the module
    docstring); `calls` holds every call made so far."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.calls: list[Call] = []
        self._held = ""  # text not yet sent: maybe the start of a call
        self._bare: bool | None = None  # auto: the answer starts as JSON (a bare call?)
        self._sent_text = False
        self._after = ""  # text sent since the last call

    @property
    def whole(self) -> bool:
        """Is the answer so far calls made whole, and nothing after them cut short? (What an
        answer that reached max_tokens right as its last call closed is.)"""
        if not self.calls or self._held.strip() or self._after.strip():
            return False
        if self.tools.mode != "named":
            return True
        try:
            return isinstance(json.loads(self.calls[0].arguments), dict)
        except ValueError:
            return False

    def feed(self, text: str) -> Delta:
        mode = self.tools.mode
        if mode == "named":
            if not text:
                return Delta()
            if not self.calls:
                self.calls.append(new_call(self.tools.name or "", ""))
            call = self.calls[0]
            call.arguments += text
            return Delta(calls=[Call(call.id, call.name, text)])
        self._held += text
        if mode == "required":
            return Delta()
        return self._auto(final=False)

    def finish(self) -> Delta:
        """The end of the answer: whatever was held, as calls or as text."""
        if self.tools.mode == "named":
            return Delta()
        if self.tools.mode == "required":
            held, self._held = self._held, ""
            calls = self._list(held)
            if calls is None:
                return Delta(content=held)
            self.calls += calls
            return Delta(calls=calls)
        return self._auto(final=True)

    def _auto(self, final: bool) -> Delta:
        out = Delta()
        if self._bare is None and not self._sent_text:
            start = self._held.lstrip()
            if not start:
                return out
            self._bare = start[0] in "{["
        if self._bare:
            if not final:
                return out
            held, self._held = self._held, ""
            calls = self._list(held)
            if calls is None:
                call = parse_call(held, self.tools.names)
                calls = [] if call is None else [call]
            if calls:
                self._add(calls, out)
            else:
                out.content = held
            return out
        while True:
            at = self._held.find(CALL_OPEN)
            if at < 0:
                keep = 0 if final else _partial_tag(self._held)
                self._text(self._held[: len(self._held) - keep], out)
                self._held = self._held[len(self._held) - keep :]
                return out
            self._text(self._held[:at], out)
            self._held = self._held[at:]
            end = self._held.find(CALL_CLOSE)
            if end < 0 and not final:
                return out
            body = self._held[len(CALL_OPEN) : end if end >= 0 else None]
            self._held = self._held[end + len(CALL_CLOSE) :] if end >= 0 else ""
            call = parse_call(body.strip(), self.tools.names)
            if call is None:
                self._text(CALL_OPEN + body + (CALL_CLOSE if end >= 0 else ""), out)
            else:
                self._add([call], out)

    def _text(self, text: str, out: Delta) -> None:
        if text:
            out.content += text
            self._sent_text = True
            self._after += text

    def _add(self, calls: list[Call], out: Delta) -> None:
        if not self.tools.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls += calls
        out.calls += calls
        self._after = ""

    def _list(self, text: str) -> list[Call] | None:
        """A JSON list of calls (the required form, or Llama's), or None."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, list) or not data:
            return None
        calls = [_as_call(d, self.tools.names) for d in data]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` may be the start of `<tool_call>`."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def split_answer(text: str, tools: Tools) -> tuple[str | None, list[Call], bool]:
    """A whole answer as (content, calls, are the calls whole): what the non-streaming response
    says."""
    parser = AnswerParser(tools)
    first, last = parser.feed(text), parser.finish()
    if tools.mode == "named":
        return (None if parser.calls else text), parser.calls, parser.whole
    content = first.content + last.content
    if parser.calls:
        return content.strip() or None, parser.calls, parser.whole
    return content, parser.calls, False
