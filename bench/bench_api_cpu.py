"""CPU seconds the HTTP edge spends per streamed token, on any machine (CPU is enough).

Starts `stride serve` on a tiny random model with the step loop in its own process, streams
`--streams` concurrent `/v1/completions` of `--tokens` tokens each (ignore_eos), and reads the
user+system CPU time of every process of the server from /proc before and after. The engine
process is reported apart: what is left is what serving costs per token, the figure that caps
throughput through HTTP once the engine is faster than one API process.

    python bench/bench_api_cpu.py --api-servers 1
    python bench/bench_api_cpu.py --api-servers 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.models import make_model_dir  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def roles(server: int) -> dict[str, int]:
    """The server's processes by role. The engine process is the first child started (lowest
    pid) of whichever process starts it: the server itself with one API process, the
    supervisor with several; the resource tracker is left out."""
    kids = sorted(p for p in children(server) if b"resource_tracker" not in _cmdline(p))
    if not kids:
        raise RuntimeError("no engine process: is --engine-process on?")
    found = {"server": server, "engine": kids[0]}
    found.update({f"api-{i + 1}": p for i, p in enumerate(kids[1:])})
    return found


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


async def stream_all(url: str, streams: int, tokens: int) -> int:
    body = {"prompt": "Hello, world!", "max_tokens": tokens, "temperature": 0.0}
    body |= {"ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> int:
        n = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                n += line.startswith("data: {")
        return n

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        events = await asyncio.gather(*(one(client) for _ in range(streams)))
    return sum(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api-servers", type=int, help="default: the server's own")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model_dir(Path(tmp) / "tiny")
        port = 18000 + os.getpid() % 1000
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "stride.server.cli", "serve", "--model", str(model)]
        cmd += ["--device", "cpu", "--engine-process", "--kv-cache-memory", "64MiB"]
        cmd += ["--port", str(port), "--log-level", "warning"]
        if args.api_servers is not None:
            cmd += ["--api-servers", str(args.api_servers)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(cmd, cwd=ROOT, env=env)
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            asyncio.run(stream_all(url, 4, 8))  # warm up every code path
            procs = roles(server.pid)
            for _ in range(args.rounds):
                before = {r: cpu_seconds(p) for r, p in procs.items()}
                t0 = time.perf_counter()
                events = asyncio.run(stream_all(url, args.streams, args.tokens))
                wall = time.perf_counter() - t0
                used = {r: cpu_seconds(p) - before[r] for r, p in procs.items()}
                edge = sum(v for r, v in used.items() if r != "engine")
                tokens = args.streams * args.tokens
                print(
                    f"api_servers={args.api_servers} tokens={tokens} events={events} "
                    f"wall={wall:.2f}s edge_cpu={edge:.2f}s "
                    f"edge_us_per_token={edge / tokens * 1e6:.0f} "
                    f"engine_us_per_token={used['engine'] / tokens * 1e6:.0f} "
                    + " ".join(f"{r}={v:.2f}" for r, v in used.items())
                )
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
