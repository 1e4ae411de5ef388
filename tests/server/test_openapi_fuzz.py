"""Property-based fuzzing of every POST route from the server's own /openapi.json.

Schemathesis generates bodies from the published schema: its coverage phase (boundary values of
every field: minimum, maximum, one past each, empty and missing, wrong types; valid and invalid)
and then random ones (positive and, in negative mode, schema-violating), at least 1,000 cases
per route in all. Every answer must be a non-5xx status the schema documents, with a body that
conforms to it; schema-violating bodies must be refused. Generation is kept cheap (a few tokens
and samples) so the run stays fast.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from stride.engine.config import EngineConfig
from stride.server.app import ServerConfig
from tests.helpers.servers import LiveServer

CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
MAX_TOKENS = 4
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
CASES_PER_ROUTE = 1000
FUZZED_PER_MODE = 400  # random cases per generation mode, on top of the coverage phase's


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20)
    live = LiveServer(ServerConfig(engine=engine))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def bounded(body):
    """Keep generation cheap: a few tokens and samples; no deadlines (a 504 is by design)."""
    if not isinstance(body, dict):
        return body
    body.pop("timeout", None)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value < 10**5:
            body[key] = MAX_TOKENS  # huge ones stay: they must be a 400, not a 5xx
        if key in body and value is None:  # null: "as many as fit", too slow here
            body[key] = MAX_TOKENS
    if "messages" in body and not body.get("max_tokens") and not body.get("max_completion_tokens"):
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    return body


def call(server, case) -> None:
    case.body = bounded(case.body)
    response = case.call(base_url=server.url, timeout=60)
    negative = case.meta.generation.mode is GenerationMode.NEGATIVE
    case.validate_response(response, checks=CHECKS + ([negative_data_rejection] * negative))


@pytest.mark.parametrize("path", ROUTES)
def test_fuzz(server, schema, path):
    operation = schema[path]["POST"]
    config = schema.config.generation_for(operation=operation)
    coverage = list(
        schema.iter_coverage_cases(
            operation, generation_modes=list(GenerationMode), generation_config=config
        )
    )
    for case in coverage:  # boundary values, valid and not
        call(server, case)
    fuzzed = 0
    per_mode = max(FUZZED_PER_MODE, (CASES_PER_ROUTE - len(coverage) + 1) // 2)
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @settings(
            max_examples=per_mode,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            nonlocal fuzzed
            fuzzed += 1
            call(server, case)

        check()
    assert len(coverage) + fuzzed >= CASES_PER_ROUTE
    server.wait_idle()
