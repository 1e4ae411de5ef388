"""Start-up of the default model: `stride serve` to the first answer, and what the cache holds.

    python bench/bench_startup.py [--runs 2] [--formats]

1. `stride serve` with HOME (and so the model cache) in an empty directory, timed from the
   spawn to /health 200 and to its first answered completion (8 tokens): the first start (which
   converts the GGUF file's tokenizer and config), then `--runs` warm starts.
2. `--formats`: the cache formats weighed for the default model's weights: read straight from
   the GGUF file and dequantized (what Stride does), float32 safetensors (what it did),
   bfloat16 safetensors; size on disk, load time, and how many values bf16/fp16 hold exactly
   (an fp32 run must keep transformers' weights bit for bit).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.engine import loader  # noqa: E402


def start(home: Path, port: int) -> tuple[float, float]:
    """Seconds from spawning `stride serve` to /health 200, and to its first answered request."""
    env = {**os.environ, "HOME": str(home)}
    env.pop("STRIDE_CACHE", None)
    begin = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stride", "serve", "--port", str(port), "--log-level", "error"],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    try:
        while True:
            assert proc.poll() is None, "stride serve exited"
            assert time.monotonic() - begin < 600, "not ready in 600 s"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.monotonic() - begin
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return ready, time.monotonic() - begin
    finally:
        proc.terminate()
        proc.wait(60)


def weigh_formats(runs: int) -> None:
    path = loader.resolve(None)
    cpu = torch.device("cpu")
    weights = loader.load_weights(path, cpu, torch.float32)
    values = torch.cat([w.reshape(-1) for w in weights.values()])
    for dtype in (torch.bfloat16, torch.float16):
        exact = (values.to(dtype).float() == values).float().mean().item()
        print(f"values exact in {str(dtype)[6:]}: {100 * exact:.1f} %")
    gguf = (path / "model.gguf").resolve()
    cached = sum(f.stat().st_size for f in path.iterdir() if not f.is_symlink())
    print(f"GGUF file: {gguf.stat().st_size / 1e6:.0f} MB; the cache: {cached / 1e6:.1f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file

        for dtype in (torch.float32, torch.bfloat16):
            d = Path(tmp) / str(dtype)[6:]
            d.mkdir()
            start = time.perf_counter()
            save_file({k: v.to(dtype).contiguous() for k, v in weights.items()},
                      d / "model.safetensors")  # fmt: skip
            saved = time.perf_counter() - start
            size = (d / "model.safetensors").stat().st_size / 1e6
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                loader.load_weights(d, cpu, dtype)
                times.append(time.perf_counter() - start)
            print(f"{str(dtype)[6:]} safetensors: {size:.0f} MB, written in {saved:.1f} s, "
                  f"loaded in {min(times):.2f} s (best of {runs}, page cache warm)")
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            loader.load_weights(path, cpu, torch.float32)
            times.append(time.perf_counter() - start)
        print(f"GGUF dequantized at load (float32): loaded in {min(times):.2f} s (best of {runs})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="warm starts (and load repeats)")
    ap.add_argument("--port", type=int, default=18765)
    ap.add_argument("--formats", action="store_true", help="also weigh the cache formats")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}, {os.cpu_count()} cores, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="stride-home-") as home:
        for run in range(1 + args.runs):
            ready, answered = start(Path(home), args.port)
            what = "first start (empty cache)" if run == 0 else "later start"
            print(f"{what}: ready in {ready:.1f} s, first answer at {answered:.1f} s")
    if args.formats:
        weigh_formats(args.runs)


if __name__ == "__main__":
    main()
