"""`stride serve --tensor-parallel-size 2` on the CPU: it answers over HTTP what transformers
would, and SIGTERM drains the server, then stops every worker (none is left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.servers import (
    LAUNCH,
    PROMPT_IDS,
    ROOT,
    descendants,
    free_port,
    hf_greedy,
    wait_gone,
    wait_healthy,
)


def workers_of(pid: int) -> set[int]:
    return {
        p
        for p in descendants(pid)
        if b"stride.engine.worker" in Path(f"/proc/{p}/cmdline").read_bytes()
    }


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize(
    "device, engine_process",
    [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=two_gpus)],
    ids=["cpu-engine-thread", "cpu-engine-process", "cuda-engine-process"],
)
def test_serves_and_sigterm_stops_every_worker(tiny_dir, tiny_hf, device, engine_process):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", LAUNCH, "serve", "--model", str(tiny_dir), "--device", device,
           "--dtype", "float32", "--tensor-parallel-size", "2", "--kv-cache-memory", "8MiB",
           "--port", str(port), "--log-level", "warning",
           "--engine-process" if engine_process else "--no-engine-process"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_healthy(url, proc)
        workers = workers_of(proc.pid)
        assert len(workers) == 1
        body = {"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        expected = AutoTokenizer.from_pretrained(tiny_dir).decode(
            hf_greedy(tiny_hf, PROMPT_IDS, 8), skip_special_tokens=True
        )
        assert r.json()["choices"][0]["text"] == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_gone(workers, timeout=30)
        assert "exited with code" not in proc.stdout.read()  # stopped, not failed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
