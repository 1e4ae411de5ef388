"""`stride serve`: flags (each also a `STRIDE_*` environment variable), uvicorn, graceful drain.

On the first SIGTERM/SIGINT the server keeps its socket but answers new requests with 503 and
`/health` with 503 (so a load balancer stops routing), waits for the requests in flight to finish
(at most `--shutdown-timeout` seconds), then exits 0. A second signal exits at once.
With `--api-servers N` > 1 this process supervises N API processes that do all of that
(see `stride.server.api_servers`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from types import FrameType

import uvicorn

from stride.decoders.base import DecoderError
from stride.decoders.registry import DecodersConfig, parse_spec
from stride.engine.engine import EngineConfig
from stride.scheduler.policy import SchedulerConfig
from stride.scheduler.supervision import SupervisionConfig
from stride.server.app import Lifecycle, ServerConfig, create_app, use_engine_process

log = logging.getLogger("stride")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `2GiB`, `1.5G` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_decoder(text: str) -> str | dict:
    """A decoder name, or a JSON object with 'type' and options; checked against the registry."""
    spec = json.loads(text) if text.lstrip().startswith("{") else text
    try:
        parse_spec(spec, "ar")
    except DecoderError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return spec


def _flag(
    parser: argparse._ActionsContainer, name: str, help: str, default=None, type=str, **kw
) -> None:
    """--name, defaulting to $STRIDE_NAME, else `default`."""
    env = "STRIDE_" + name.upper().replace("-", "_")
    value = os.environ.get(env)
    if value is not None and kw.get("action") == "store_true":
        default = value.lower() in {"1", "true", "yes", "on"}
    elif value is not None:
        default = type(value)
    if kw.get("action") != "store_true":
        kw["type"] = type
    parser.add_argument(f"--{name}", default=default, help=f"{help} [${env}]", **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stride", description="Stride inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")

    m = p.add_argument_group("model")
    _flag(m, "model", "model: a Hugging Face directory, hub id or .gguf (default: SmolLM2-135M)")
    _flag(m, "served-model-name", "the name clients use (default: the model's)")
    _flag(m, "dtype", "float32, bfloat16, float16 or auto", "auto")
    _flag(m, "device", "cpu, cuda, cuda:N or auto", "auto")
    _flag(m, "max-model-len", "cap on prompt + output tokens", type=int)
    _flag(m, "trust-remote-code", "allow models that need their own code", action="store_true")

    e = p.add_argument_group("engine")
    _flag(
        e,
        "kv-cache-memory",
        "KV-cache size, e.g. 2GiB (default: a share of free memory)",
        type=parse_bytes,
    )
    _flag(e, "gpu-memory-utilization", "share of free GPU memory for the KV cache", 0.85, float)
    _flag(e, "max-num-seqs", "most sequences in one step", 256, int)
    _flag(e, "max-num-batched-tokens", "most tokens in one step", 2048, int)
    _flag(e, "max-waiting", "queue size; beyond it requests get 429", 1024, int)
    _flag(e, "fused-decode-steps", "greedy decode steps per host sync for <= 8 streams "
          "(default 8 with CUDA graphs; 1 = off, also for the chained 1-step bursts of larger "
          "greedy batches)", None, int)  # fmt: skip

    _flag(e, "max-engine-restarts", "engine restarts allowed within --engine-restart-window; "
          "one more and the server exits non-zero", 5, int)  # fmt: skip
    _flag(e, "engine-restart-window", "seconds over which engine restarts are counted", 300.0,
          float)  # fmt: skip
    _flag(e, "watchdog-timeout", "seconds without an engine step, with requests in flight, "
          "before /health says 503 (stuck)", 30.0, float)  # fmt: skip

    env = os.environ.get("STRIDE_ENGINE_PROCESS")
    e.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None if env is None else env.lower() in {"1", "true", "yes", "on"},
        help="run the step loop in its own process (default: on for CUDA, off for CPU) "
        "[$STRIDE_ENGINE_PROCESS]",
    )

    d = p.add_argument_group("decoders")
    _flag(
        d, "decoder", 'default decoder: a name or JSON like \'{"type": "ar"}\'', "ar", parse_decoder
    )
    _flag(d, "draft-model", "speculative decoding's draft model")
    _flag(d, "num-speculative-tokens", "speculative decoding's default K", 4, int)
    _flag(d, "diffusion-model", "a masked diffusion LM for the refine decoder")

    h = p.add_argument_group("http")
    _flag(h, "host", "address to listen on", "127.0.0.1")
    _flag(h, "port", "port to listen on", 8000, int)
    _flag(h, "api-key", "require 'Authorization: Bearer KEY' (not on /health)")
    _flag(h, "protect-metrics", "require the API key on /metrics too", action="store_true")
    _flag(h, "metrics-users", "users with their own metrics label, e.g. a,b (others: other)")
    _flag(h, "shutdown-timeout", "seconds to drain requests in flight on SIGTERM", 30.0, float)
    _flag(h, "max-request-body", "largest request body (beyond: 413)", "4MiB", parse_bytes)
    _flag(h, "api-servers", "HTTP processes in front of the engine process (default: 1 on CPU, "
          "on CUDA one per 4 cores, at most 4)", None, int)  # fmt: skip
    _flag(h, "log-level", "debug, info, warning or error", "info")
    return parser


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        engine=EngineConfig(
            model=args.model,
            served_name=args.served_model_name,
            device=args.device,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            fused_decode_steps=args.fused_decode_steps,
        ),
        decoders=DecodersConfig(
            default=args.decoder,
            draft_model=args.draft_model,
            num_speculative_tokens=args.num_speculative_tokens,
            diffusion_model=args.diffusion_model,
            trust_remote_code=args.trust_remote_code,
        ),
        api_key=args.api_key,
        protect_metrics=args.protect_metrics,
        metrics_users=args.metrics_users,
        engine_process=args.engine_process,
        supervision=SupervisionConfig(
            max_restarts=args.max_engine_restarts,
            restart_window=args.engine_restart_window,
            watchdog_timeout=args.watchdog_timeout,
        ),
        max_request_body=args.max_request_body,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, with a first signal that drains instead of closing the socket.

    `only_sigterm`: one of several API processes, which a terminal's Ctrl-C reaches too; their
    parent turns it into one SIGTERM each, so a SIGINT of their own is ignored.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        timeout: float,
        only_sigterm: bool = False,
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.timeout = timeout
        self.only_sigterm = only_sigterm
        self.deadline: float | None = None
        self.failed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.only_sigterm and sig != signal.SIGTERM:
            return
        if self.deadline is None and not self.should_exit:
            log.warning(
                "%s: draining %d requests (at most %.0f s)",
                signal.Signals(sig).name,
                self.lifecycle.in_flight,
                self.timeout,
            )
            self.lifecycle.begin_drain()
            self.deadline = time.monotonic() + self.timeout
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None and not self.should_exit:
            if self.lifecycle.idle:
                self.should_exit = True
            elif time.monotonic() >= self.deadline:
                log.warning("shutdown timeout: %d requests cut off", self.lifecycle.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)


def serve(args: argparse.Namespace) -> int:
    setup_logging(args)
    config = server_config(args)
    n = args.api_servers
    if n is None:
        n = default_api_servers(config)
    elif n < 1 or (n > 1 and config.engine_process is False):
        log.error("--api-servers %d: give 1, or more with the engine process", n)
        return 2
    if n > 1:
        from stride.server.api_servers import serve_many  # it imports this module

        return serve_many(args, config, n)
    return run_server(args, config)


def default_api_servers(config: ServerConfig) -> int:
    """One API process where the engine thread shares it (CPU); on CUDA one per 4 cores, at
    most 4: one asyncio process streams about half of what the engine makes at 256 streams on
    an H200, and the engine process, tokenizers and the OS need cores too."""
    if not use_engine_process(config):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cores or 1) // 4))


def setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run_server(
    args: argparse.Namespace,
    server_config: ServerConfig,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve on `args.host:args.port`, or on `sockets` (one API process of several)."""
    level = args.log_level.upper()
    app = create_app(server_config)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=2,
        access_log=level == "DEBUG",
    )
    only_sigterm = sockets is not None
    server = DrainingServer(config, app.state.lifecycle, args.shutdown_timeout, only_sigterm)

    def failed(message: str) -> None:
        log.error("cannot serve: %s", message)
        server.failed = server.should_exit = True

    app.state.lifecycle.on_failure = failed
    server.run(sockets=sockets)
    return 1 if server.failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
