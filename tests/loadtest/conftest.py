"""The load tests' fixture: a live server (`stride serve`) on the tiny model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tiny_server(tiny_dir, tmp_path):
    """`stride serve` on the tiny model, on a loopback port, stopped after the test."""
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    command = [sys.executable, "-m", "stride.server.cli", "serve", "--model", str(tiny_dir),
               "--host", "127.0.0.1", "--port", str(port),
               "--kv-cache-memory", "64MiB"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no OpenMP spin-waits fighting the test
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
