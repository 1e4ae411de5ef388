"""`stride serve` as a real process: flags and STRIDE_* variables, and the SIGTERM drain."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from stride.server.cli import build_parser, main, parse_bytes, server_config
from tests.helpers.servers import LAUNCH, ROOT, free_port, wait_healthy


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("STRIDE_PORT", "9123")
    monkeypatch.setenv("STRIDE_API_KEY", "k")
    monkeypatch.setenv("STRIDE_TRUST_REMOTE_CODE", "true")
    args = build_parser().parse_args(
        [
            "serve",
            "--kv-cache-memory",
            "512MiB",
            "--decoder",
            '{"type": "ar"}',
            "--max-waiting",
            "3",
            "--fused-decode-steps",
            "1",
            "--load-format",
            "dummy",
        ]
    )
    assert args.port == 9123 and args.api_key == "k"
    config = server_config(args)
    assert config.engine.kv_cache_memory == 512 << 20 and config.engine.random_weights
    assert config.decoders.default == {"type": "ar"} and config.decoders.trust_remote_code
    assert config.scheduler.max_waiting == 3 and config.scheduler.fused_decode_steps == 1
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1000") == 1000
    monkeypatch.setenv("STRIDE_DECODER", "speculative")
    monkeypatch.setenv("STRIDE_ENGINE_PROCESS", "off")
    args = build_parser().parse_args(["serve"])
    assert type(args.decoder) is str and args.decoder == "speculative"  # plain data: pickled
    assert not server_config(args).engine.random_weights
    assert args.engine_process is False and args.trust_remote_code is True


def test_an_unknown_decoder_is_a_one_line_error(capsys):
    assert main(["serve", "--decoder", "nope", "--model", "."]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown decoder 'nope'; valid decoders: ar," in err


def _stride(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stride", *argv],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_and_version_import_nothing_heavy():
    """Building the parser (all `--help` and `--version` need) leaves torch, transformers and
    the FastAPI app unimported; run in a fresh interpreter, as other tests import them all."""
    probe = (
        "import sys; from stride.server.cli import build_parser, version; build_parser(); "
        "print(version(), *(m for m in ('torch', 'transformers', 'fastapi', 'stride.server.app') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.split() == [importlib.metadata.version("stride")]
    version = _stride("--version")
    assert version.returncode == 0 and version.stdout.startswith("stride ")
    serve_help = _stride("serve", "--help").stdout
    for shown in ("(default: 8000) [$STRIDE_PORT]", "(default: ar) [$STRIDE_DECODER]",
                  "(default: 1GiB on CPU; on CUDA --gpu-memory-utilization"):  # fmt: skip
        assert shown in " ".join(serve_help.split()), shown
    from_env = _stride("serve", "--help", STRIDE_PORT="9999").stdout
    assert "(default: '9999' from $STRIDE_PORT)" in " ".join(from_env.split())


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["serve", "--port", "abc"], {}, "argument --port: invalid int value: 'abc'"),
        (["serve"], {"STRIDE_PORT": "abc"}, "invalid int value: 'abc' (from $STRIDE_PORT)"),
        (["serve"], {"STRIDE_KV_CACHE_MEMORY": "lots"}, "not a size: 'lots'"),
        (["serve"], {"STRIDE_PROTECT_METRICS": "maybe"}, "$STRIDE_PROTECT_METRICS='maybe'"),
        (["serve", "--dtype", "fp8"], {}, "'fp8': choose from auto, float32, bfloat16"),
        (["serve", "--model", "/no/such/model"], {}, "/no/such/model: no such directory"),
        (["serve"], {"STRIDE_MODEL": "./absent.gguf"}, "no such directory or .gguf file"),
        (["serve", "--decoder", "{oops"], {}, "argument --decoder: not a decoder name nor JSON"),
        (["serve", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["serve", "--api-servers", "0"], {}, "--api-servers 0: give 1, or more"),
        (["serve", "--port", "99999"], {}, "argument --port: 99999: a port is 0 to 65535"),
        (["serve"], {"STRIDE_PORT": "-1"}, "a port is 0 to 65535 (from $STRIDE_PORT)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, env, message):
    out = _stride(*argv, **env)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert out.stderr.startswith("stride") and "Traceback" not in out.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_a_port_in_use_is_one_line_and_exit_2(tiny_dir, shared):
    """Held by another process (also one that lets others share it, as `--api-servers` does):
    one line before anything loads, with one or several API processes."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(shared))
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        for servers in ("1", "2"):
            out = _stride("serve", "--model", str(tiny_dir), "--device", "cpu", "--port",
                          str(port), "--api-servers", servers, "--engine-process")  # fmt: skip
            assert out.returncode == 2 and out.stdout == "", out.stderr
            said = f"stride serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
            assert out.stderr.count("\n") == 1 and out.stderr.startswith(said), out.stderr
    finally:
        holder.close()


def test_readme_lists_every_flag_with_its_variable_and_default():
    """The configuration table and `stride serve --help` say the same."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Configuration\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help"):
            continue
        env = "STRIDE_" + flag[2:].upper().replace("-", "_")
        (row,) = [r for r in rows if f"`{flag}`" in r.split("|")[1]]
        assert f"`{env}`" in row, flag
        default = action.default
        if isinstance(default, int | float | str) and not isinstance(default, bool):
            cells = [c.strip() for c in row.split("|")]
            if " / " not in cells[1]:  # one flag in the row: its own default cell
                shown = f"{default:g}" if isinstance(default, float) else default
                assert cells[3] == f"`{shown}`", (flag, cells[3], shown)


def test_sigterm_drains_requests_in_flight(tiny_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # One torch thread: OpenMP spin-waits make steps crawl when the test and server share 2 cores.
    env = {**os.environ, "STRIDE_PORT": str(port), "STRIDE_DECODER": "slow", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-c",
        LAUNCH,
        "serve",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--kv-cache-memory",
        "8MiB",
        "--shutdown-timeout",
        "60",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_healthy(url, proc)
        started = [threading.Event() for _ in range(3)]
        results: list[list[dict]] = [[] for _ in range(3)]

        def stream(i: int) -> None:
            body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        results[i].append(json.loads(line[6:]))
                        started[i].set()
                    elif line == "data: [DONE]":
                        results[i].append({"done": True})

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for event in started:
            assert event.wait(60)
        proc.send_signal(signal.SIGTERM)
        health = httpx.get(f"{url}/health", timeout=5)
        while health.status_code == 200:  # until the signal is handled
            health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_draining"
        for t in threads:
            t.join(timeout=60)
        for events in results:  # every request in flight ran to its end
            assert events[-1] == {"done": True}
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_logs_one_format_a_ready_line_and_an_access_line_per_request(tiny_dir):
    """`stride serve` as a person runs it: uvicorn's lines in Stride's format, nothing saying
    "running" before the ready line (URL, model, device, dtype, KV tokens, decoders), and one
    access line per request with its decoder and tokens."""
    port = free_port()
    cmd = [sys.executable, "-m", "stride", "serve", "--model", str(tiny_dir), "--device", "cpu",
           "--kv-cache-memory", "8MiB", "--port", str(port)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        body = {"prompt": "ab", "max_tokens": 3, "temperature": 0, "decoder": "speculative"}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200
        usage = reply.json()["usage"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = proc.stdout.read().splitlines()
    line_format = re.compile(r"\d{4}-\d\d-\d\d [\d:]{8},\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")
    assert all(line_format.match(line) for line in lines), lines
    assert any(" uvicorn.error: " in line for line in lines)  # uvicorn's, in Stride's format
    assert not any("running" in line.lower() for line in lines), lines
    (ready,) = [i for i, line in enumerate(lines) if " ready on " in line]
    said = f"ready on http://127.0.0.1:{port}: {tiny_dir} on cpu (float32), KV cache "
    assert said in lines[ready]
    assert "decoders: ar, speculative/ngram, speculative/early_exit, refine/jacobi" in lines[ready]
    access = [i for i, line in enumerate(lines) if " stride.access: " in line]
    served = [i for i in access if '"POST /v1/completions" 200' in lines[i]]
    assert len(served) == 1 and served[0] > ready
    tokens = (f"decoder=speculative/ngram prompt_tokens={usage['prompt_tokens']} "
              f"completion_tokens={usage['completion_tokens']} ")  # fmt: skip
    assert tokens in lines[served[0]]
    assert not any("/health" in lines[i] for i in access)  # probes: debug only
