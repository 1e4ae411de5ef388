"""Decoders through `stride serve`, as a client sees them: output tok/s against `ar`.

One server on the default model (or `--model`); chat requests that name their decoder, greedy
(or sampled at `--temperature`, each request seeded by its index), on held-out prompts
(loadtest's built-in ones plus `bench/data/heldout_prompts.jsonl`, none from the training
prompt generator). At each concurrency c, every decoder answers the same
`max(--prompts, c)` requests with c in flight at once; with `--repeats N` the decoders take N
rounds in turn and each one's best round is reported (single runs on a GPU move by ±10 %).
Reported per decoder: output tok/s (wall time of the round, prefills included), × `ar` at the
same concurrency, and tokens committed per forward pass (`usage.decoder`, summed over requests).

    python bench/bench_serve_decoders.py --device cpu --prompts 4 --tokens 16 --concurrency 1,2
    python bench/bench_serve_decoders.py --device cuda --prompts 64 --tokens 128 \
        --concurrency 1,8,64 --decoders ar,jacobi,lookahead --repeats 3 --json serve.json
    python bench/bench_serve_decoders.py --device cuda --concurrency 1 --temperature 0.7 \
        --decoders 'ar,eagle,ngram={"type": "speculative", "draft": "ngram"}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.prompts import BUILTIN_PROMPTS  # noqa: E402
from stride.train.prompts import read_prompts  # noqa: E402

HELDOUT = Path(__file__).parent / "data" / "heldout_prompts.jsonl"

DECODERS: dict[str, str | dict] = {
    "ar": "ar",
    "jacobi": {"type": "refine", "method": "jacobi"},
    "lookahead": {"type": "refine", "method": "lookahead"},
    "introspective": {"type": "refine", "method": "introspective"},
    "eagle": {"type": "speculative"},
}


def heldout_messages() -> list[list[dict]]:
    """The held-out chat prompts as message lists, in a fixed order."""
    out = [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS]
    for p in read_prompts(HELDOUT):
        out.append(p if isinstance(p, list) else [{"role": "user", "content": p}])
    return out


def decoder_names(text: str) -> list[str]:
    """`--decoders`, split at the commas outside JSON specs."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "{[") - (ch in "}]")
        if ch == "," and not depth:
            names.append(text[start:i])
            start = i + 1
    return [*names, text[start:]]


def decoder_spec(name: str) -> str | dict:
    """A name from DECODERS, or `label={json}` for any other decoder spec."""
    if "=" in name:
        return json.loads(name.split("=", 1)[1])
    return DECODERS[name]


async def one_round(url: str, model: str, decoder: str | dict, messages: list, c: int, args):
    """Every prompt once, c in flight: (seconds, output tokens, forward passes)."""
    gate = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)

    async def ask(client: httpx.AsyncClient, i: int, m: list) -> tuple[int, int]:
        body = {
            "model": model,
            "messages": m,
            "max_tokens": args.tokens,
            "temperature": args.temperature,
            "seed": i,
            "decoder": decoder,
            "ignore_eos": args.ignore_eos,
        }
        async with gate:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
        usage = r.json()["usage"]
        stats = usage.get("decoder") or {}
        return usage["completion_tokens"], stats.get("forward_passes", 0)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(ask(client, i, m) for i, m in enumerate(messages)))
        seconds = time.perf_counter() - start
    return seconds, sum(t for t, _ in done), sum(p for _, p in done)


def card(device: str) -> str:
    """The server's device, as this process sees it (the same machine)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "stride.server.cli", "serve", "--port", str(args.port)]
    cmd += ["--device", args.device, "--log-level", "warning"] + args.serve_args.split()
    if args.model:
        cmd += ["--model", args.model]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{args.port}"
    for _ in range(1200):
        if server.poll() is not None:
            raise SystemExit(f"stride serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise SystemExit("stride serve did not become healthy in 10 minutes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=16, help="requests a round (at least c)")
    ap.add_argument("--tokens", type=int, default=128, help="max new tokens per request")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--decoders", default="ar,jacobi,lookahead", help="names, or label={json}")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of all; each one's best")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--serve-args", default="", help="more `stride serve` flags")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    pool = heldout_messages()
    names = decoder_names(args.decoders)
    labels = [n.split("=", 1)[0] for n in names]
    server, url = start_server(args)
    results = []
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for name in names:  # warm-up: each decoder's first requests build what it keeps
            asyncio.run(one_round(url, model, decoder_spec(name), pool[:2], 2, args))
        for c in map(int, args.concurrency.split(",")):
            count = max(args.prompts, c)
            messages = [pool[i % len(pool)] for i in range(count)]
            best: dict[str, tuple[float, int, int]] = {}
            for _ in range(args.repeats):
                for name, label in zip(names, labels, strict=True):
                    got = asyncio.run(one_round(url, model, decoder_spec(name), messages, c, args))
                    if label not in best or got[1] / got[0] > best[label][1] / best[label][0]:
                        best[label] = got
            base = best["ar"][1] / best["ar"][0] if "ar" in best else None
            for label, (seconds, tokens, passes) in best.items():
                row = {
                    "decoder": label,
                    "concurrency": c,
                    "requests": count,
                    "tokens": tokens,
                    "tok_s": round(tokens / seconds, 1),
                    "x_ar": round(tokens / seconds / base, 3) if base else None,
                    "tokens_per_pass": round(tokens / passes, 3) if passes else None,
                }
                results.append(row)
                print(
                    f"c{c:<4} {label:<16} {row['tok_s']:>10.1f} tok/s  x ar {row['x_ar']}  "
                    f"tokens/pass {row['tokens_per_pass']}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(30)
    if args.json:
        meta = {
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "card": card(args.device),
        }
        Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
