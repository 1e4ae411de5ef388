"""Property-based fuzzing of the completions and chat routes from the server's own /openapi.json.

Schemathesis generates bodies from the published schema (valid ones and, in negative mode,
invalid ones); every answer must be a non-5xx status the schema documents, with a body that
conforms to it. Generation is kept small (few examples, few tokens) so the run stays fast.
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

from stride.engine.engine import EngineConfig
from stride.server.app import ServerConfig
from tests.server_harness import LiveServer

CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20)
    live = LiveServer(ServerConfig(engine=engine))
    yield live
    live.stop()


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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz(server, path, mode):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operation = schema[path]["POST"]
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        case.body = bounded(case.body)
        response = case.call(base_url=server.url, timeout=60)
        case.validate_response(response, checks=checks)

    check()
    server.wait_idle()
