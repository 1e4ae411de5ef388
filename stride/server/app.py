"""The FastAPI app: its configuration, routes, and the model loading in the background.

`create_app(config)` returns an app that answers at once: `/health` says 503 while the model
loads on a worker thread, and generation routes say `model_loading`. Once loaded, the engine
client sits on `app.state.client` (hooks such as metrics attach there) and `app.state.serving`.
`app.state.lifecycle` says where the server stands and drains it (`lifecycle`): the CLI calls
`begin_drain()` on SIGTERM and `cut_off()` at the drain deadline. `/health` is 503 too while the
engine is dead (being restarted), stuck (the watchdog), or given up on (then the CLI exits
non-zero). Every request's body is bounded (`max_request_body`: 413 before the rest is read),
and its arrival time is noted: deadlines run from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Annotated, Any

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from stride import adapters, drafts
from stride.decoders.base import DecodersConfig
from stride.engine.config import EngineConfig
from stride.engine.loader import served_name
from stride.metrics.edge import MetricsMiddleware
from stride.metrics.registry import Metrics
from stride.scheduler.client import BaseClient, EngineClient
from stride.scheduler.core import CoreConfig
from stride.scheduler.policy import SchedulerConfig
from stride.scheduler.process import ProcessEngineClient
from stride.scheduler.supervision import SupervisionConfig
from stride.server import errors
from stride.server import request_schemas as rq
from stride.server import response_schemas as rs
from stride.server.auth import APIKeyMiddleware
from stride.server.body_limit import BodyLimit
from stride.server.lifecycle import Gate, Lifecycle, Phase
from stride.server.respond import ClientGone, client_gone
from stride.server.serving import Serving
from stride.tracing import Tracing, disabled

log = logging.getLogger(__name__)

MAX_REQUEST_BODY = 4 << 20  # bytes: a full context of token ids or text is far less


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decoders: DecodersConfig = field(default_factory=DecodersConfig)
    api_key: str | None = None
    protect_metrics: bool = False  # with an API key: require it on /metrics too
    metrics_users: str | None = None  # "a,b": users with their own metrics label (else "other")
    engine_process: bool | None = None  # the step loop in its own process; None: on for CUDA
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    max_request_body: int = MAX_REQUEST_BODY
    # One of several API processes: a pipe to the engine process their parent started, where
    # the pipes to the engines it restarts come from, and whether this one records the engine's
    # step numbers (exactly one of them does).
    engine_conn: Connection | None = None
    engine_updates: Connection | None = None
    step_metrics: bool = True
    otlp_traces_endpoint: str | None = None  # request traces over OTLP (`stride.tracing`)

    @property
    def core(self) -> CoreConfig:
        return CoreConfig(self.engine, self.scheduler, self.decoders)


def build_client(config: ServerConfig) -> BaseClient:
    """Load the model and start the step loop (slow: runs on a worker thread).

    On a GPU the loop runs in its own process, so that HTTP handling and the step loop do not
    take turns on one GIL; on a CPU (and for tests, which reach into `client.core`) on a thread.
    Either way a dead engine is restarted (`supervision`): a process with a freshly loaded
    model, or on the thread a core that reuses the dead one's weights (`CoreConfig.build`).
    """
    if config.engine_conn is not None:
        return ProcessEngineClient(
            config.engine_conn, updates=config.engine_updates, supervision=config.supervision
        )
    core = config.core
    if use_engine_process(config):
        return ProcessEngineClient.start(core, config.supervision)
    return EngineClient(core.build(), rebuild=core.build, supervision=config.supervision)


def use_engine_process(config: ServerConfig) -> bool:
    if config.engine_process is not None:
        return config.engine_process
    device = config.engine.device
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def create_app(config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    lifecycle = Lifecycle()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                client = build_client(config)
            except Exception as e:
                log.exception("loading the model failed")
                loop.call_soon_threadsafe(_failed, f"{type(e).__name__}: {e}")
                return
            loop.call_soon_threadsafe(_ready, client)

        def _ready(client: BaseClient) -> None:
            lifecycle.client = app.state.client = client
            if config.step_metrics:
                client.on_step = metrics.on_step
                client.on_restart = metrics.engine_restarted
                metrics.set_peaks(client.model.peak_bandwidth, client.model.peak_flops)
            client.on_give_up = lambda why: loop.call_soon_threadsafe(_failed, why)
            app.state.serving = Serving(
                client, config.decoders.default, lifecycle.running, metrics, tracing
            )
            if lifecycle.phase is Phase.LOADING:
                lifecycle.phase = Phase.READY
            if lifecycle.on_ready is not None:  # before the loop serves anything more
                lifecycle.on_ready()
            log.debug("serving %s", client.model.name)  # the CLI says more once it listens

        def _failed(message: str) -> None:
            lifecycle.phase, lifecycle.error = Phase.FAILED, message
            if lifecycle.on_failure is not None:
                lifecycle.on_failure(message)

        threading.Thread(target=load, name="stride-load", daemon=True).start()
        stats = asyncio.create_task(metrics.log_stats()) if config.step_metrics else None
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            if lifecycle.client is not None:
                lifecycle.client.shutdown()
            if tracing is not None:
                tracing.shutdown()

    app = FastAPI(
        title="Stride",
        summary="OpenAI-compatible inference with a decoding strategy per request",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.lifecycle = lifecycle
    app.state.client = None
    app.state.serving = None
    # From the start, so /metrics shows the queue gauges (at 0) while the model loads.
    name = served_name(config.engine.model, config.engine.served_name)
    decoders = config.decoders
    head, draft_model = drafts.pick(decoders.draft_head, decoders.draft_model, name)
    metrics = app.state.metrics = Metrics(
        name,
        config.metrics_users,
        draft_model=draft_model is not None,
        diffusion=decoders.diffusion_model is not None,
        spec_tokens=decoders.num_speculative_tokens,
        eagle=head is not None,
        introspective=adapters.pick(decoders.mask_adapter, name) is not None,
    )
    tracing = None
    if config.otlp_traces_endpoint and not disabled():
        tracing = Tracing(config.otlp_traces_endpoint)
        log.info("tracing requests to %s", tracing.endpoint)
    app.state.tracing = tracing
    errors.install(app)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_middleware(BodyLimit, limit=config.max_request_body)
    app.add_middleware(Gate, lifecycle=lifecycle)
    if config.api_key:
        app.add_middleware(
            APIKeyMiddleware, api_key=config.api_key, protect_metrics=config.protect_metrics
        )
    app.add_middleware(MetricsMiddleware, get_metrics=lambda: app.state.metrics)  # outermost
    _routes(app)
    return app


def serving(request: Request) -> Serving:
    """The dependency of every route that needs the model: 503 until it is there."""
    lifecycle: Lifecycle = request.app.state.lifecycle
    error = lifecycle.unavailable()
    if error is not None:
        raise error
    return request.app.state.serving


Model = Annotated[Serving, Depends(serving)]

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": rs.ErrorResponse, "description": description}
    for status, description in [
        (400, "invalid request, context length exceeded, unknown decoder"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (429, "the waiting queue is full (see Retry-After)"),
        (503, "loading, draining, or the engine died"),
        (504, "the request's deadline passed"),
    ]
}


SSE_EVENT = {
    "type": "object",
    "description": "one server-sent event",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "a JSON chunk, {error: ...}, or [DONE]"}
    },
}


def _streaming(model: type) -> dict[int | str, dict[str, Any]]:
    ok = {
        "model": model,
        "description": "the response, or server-sent events of chunks when `stream` is true",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    }
    return {200: ok, **ERRORS}


def _routes(app: FastAPI) -> None:
    @app.get("/health", response_model=rs.Health, responses={503: {"model": rs.Health}})
    async def health(request: Request):
        status, detail = request.app.state.lifecycle.health()
        body = rs.Health(status=status, detail=detail)
        return JSONResponse(body.model_dump(), status_code=200 if status == "ok" else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request):
        m: Metrics | None = request.app.state.metrics
        accept = request.headers.get("accept", "")
        body, content_type = m.render(accept) if m is not None else (b"", "text/plain")
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=rs.ModelList, responses=ERRORS)
    async def models(srv: Model):
        card = rs.ModelCard(id=srv.model_name, max_model_len=srv.max_model_len)
        return rs.ModelList(data=[card])

    @app.get("/v1/models/{model:path}", response_model=rs.ModelCard, responses=ERRORS)
    async def model(model: str, srv: Model):
        """One model's card (the SDK's `models.retrieve`); names may hold slashes."""
        srv.inputs.check_model(model)
        return rs.ModelCard(id=srv.model_name, max_model_len=srv.max_model_len)

    @app.get("/tokenizer_info", response_model=rs.TokenizerInfo, responses=ERRORS)
    async def tokenizer_info(srv: Model):
        """The tokenizer's settings, as vLLM's route says them (lm-eval's remote tokenizer)."""
        return srv.inputs.tokenizer_info()

    @app.post(
        "/v1/completions",
        response_model=rs.CompletionResponse,
        responses=_streaming(rs.CompletionResponse),
    )
    async def completions(body: rq.CompletionRequest, request: Request, srv: Model):
        return await srv.completions(request, body)

    @app.post(
        "/v1/chat/completions",
        response_model=rs.ChatCompletionResponse,
        responses=_streaming(rs.ChatCompletionResponse),
    )
    async def chat_completions(body: rq.ChatCompletionRequest, request: Request, srv: Model):
        return await srv.chat(request, body)

    @app.post("/tokenize", response_model=rs.TokenizeResponse, responses=ERRORS)
    async def tokenize(body: rq.TokenizeRequest, srv: Model):
        return await srv.tokenize(body)

    @app.post("/detokenize", response_model=rs.DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: rq.DetokenizeRequest, srv: Model):
        srv.inputs.check_model(body.model)
        srv.inputs.check_ids(body.tokens, "tokens")
        return rs.DetokenizeResponse(prompt=srv.inputs.decode(body.tokens))
