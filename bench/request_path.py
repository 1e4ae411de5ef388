"""The path of one streamed request through Stride: every file of `stride/` whose functions run
for it, in the order first reached, with the functions called there and how often.

A real server on loopback (uvicorn in this process, the step loop on a thread: the CPU layout;
a GPU server's engine process, `scheduler/process.py` and its pipe, is not on the path), the
embedded model unless `--model`, one streamed chat completion with the decoder named by
`--decoder`; calls are recorded only while that request runs (after a warm-up request), in every
thread. How many files and calls one request passes through, measured on the code as it is:

    python bench/request_path.py --decoder eagle --tokens 16
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.engine.config import EngineConfig  # noqa: E402
from stride.server.app import ServerConfig, create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "stride"


class Recorder:
    """Calls into `stride/` files while `on`, by file (first reached first) and function."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, collections.Counter[str]] = {}
        self._root = str(ROOT)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        path = frame.f_code.co_filename
        if path.startswith(self._root):
            name = path[len(self._root) - len("stride") :]
            self.calls.setdefault(name, collections.Counter())[frame.f_code.co_qualname] += 1


def stream(url: str, decoder: str, tokens: int) -> str:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three rivers of Europe."}],
        "max_tokens": tokens,
        "stream": True,
        "temperature": 0,
        "decoder": decoder,
    }
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded one)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU path, on a thread")
    ap.add_argument("--decoder", default="eagle", help="the decoder (a name or a shorthand)")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens")
    ap.add_argument("--json", type=Path, default=None, help="write the path here")
    args = ap.parse_args()

    recorder = Recorder()
    threading.setprofile(recorder)  # (threads started from now on: the server's, the loop's)
    sys.setprofile(recorder)
    engine = EngineConfig(model=args.model, device=args.device)
    app = create_app(ServerConfig(engine=engine, engine_process=False))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stream(url, args.decoder, args.tokens)  # warm-up: first-use imports and caches
    recorder.on = True
    text = stream(url, args.decoder, args.tokens)
    recorder.on = False
    server.should_exit = True
    print(f"{args.decoder}, {args.tokens} tokens: {text!r}")
    for i, (name, funcs) in enumerate(recorder.calls.items(), 1):
        top = ", ".join(f"{f} ×{n}" if n > 1 else f for f, n in funcs.most_common(6))
        more = f" (+{len(funcs) - 6})" if len(funcs) > 6 else ""
        print(f"{i:3d} {name}: {top}{more}")
    print(f"{len(recorder.calls)} files, {sum(len(f) for f in recorder.calls.values())} functions")
    if args.json:
        path = {name: dict(funcs) for name, funcs in recorder.calls.items()}
        args.json.write_text(json.dumps(path, indent=1) + "\n")


if __name__ == "__main__":
    main()
