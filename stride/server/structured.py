"""Structured outputs at the HTTP edge: which grammar a request asks its output to follow.

OpenAI's `response_format` (`json_object`, `json_schema`) on chat, and on both routes vLLM's
names, so that clients written for vLLM work unchanged: `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` (Lark, or GBNF as vLLM's xgrammar backend takes it) and their
newer spelling under `structured_outputs`. At most one may be given. The grammar is compiled here
without the tokenizer (`decoders.grammar.check`), so a bad schema, regex or grammar is a 400
before anything is submitted; the engine compiles it again against the tokenizer (cached).
"""

from __future__ import annotations

import json
from typing import Any

from stride.decoders.grammar import GrammarError, check
from stride.engine.sequence import Constraint
from stride.server import request_schemas as rq
from stride.server.errors import APIError

ANY_OBJECT = json.dumps({"type": "object"})


def constraint_of(body: rq.SamplingFields) -> Constraint | None:
    """The request's constraint (checked), or None; a 400 for two of them or a bad one."""
    found = _requested(body)
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise APIError("invalid_request", f"give at most one output constraint; got {names}",
                       found[1][0])  # fmt: skip
    if not found:
        return None
    param, constraint = found[0]
    checked(constraint, param)
    return constraint


def checked(constraint: Constraint, param: str) -> Constraint:
    try:
        check(constraint)
    except GrammarError as e:
        raise APIError("invalid_request", f"{param}: {e}", param) from e
    return constraint


def _requested(body: rq.SamplingFields) -> list[tuple[str, Constraint]]:
    found: list[tuple[str, Constraint]] = []
    fmt = body.response_format
    if isinstance(fmt, rq.JSONObjectFormat):
        found.append(("response_format", Constraint("json_schema", ANY_OBJECT)))
    elif isinstance(fmt, rq.JSONSchemaResponseFormat):
        schema = fmt.json_schema.schema_
        spec = ANY_OBJECT if schema is None else json.dumps(schema)
        found.append(("response_format", Constraint("json_schema", spec)))
    found += _vllm("guided_", body.guided_json, body.guided_regex, body.guided_choice,
                   body.guided_grammar, False)  # fmt: skip
    so = body.structured_outputs
    if so is not None:
        found += _vllm("structured_outputs.", so.json_, so.regex, so.choice, so.grammar,
                       bool(so.json_object))  # fmt: skip
    return found


def _vllm(
    prefix: str,
    schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
    json_object: bool,
) -> list[tuple[str, Constraint]]:
    found: list[tuple[str, Constraint]] = []
    if schema is not None:
        param = prefix + "json"
        if isinstance(schema, str):  # a schema as JSON text
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise APIError("invalid_request", f"{param}: not JSON: {e}", param) from e
        found.append((param, Constraint("json_schema", json.dumps(schema))))
    if regex is not None:
        found.append((prefix + "regex", Constraint("regex", regex)))
    if choice is not None:
        found.append((prefix + "choice", Constraint("choice", json.dumps(choice))))
    if grammar is not None:
        found.append((prefix + "grammar", Constraint("grammar", grammar)))
    if json_object:
        found.append((prefix + "json_object", Constraint("json_schema", ANY_OBJECT)))
    return found
