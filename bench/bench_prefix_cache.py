"""Prefix caching on against off, in one process on one engine: time to first token, throughput.

Two workloads, each run with caching off, then on, over the same prompts (the cache's switch is
flipped on the live engine; every workload draws fresh random tokens, so nothing cached by an
earlier one helps a later one):
  - shared system prompt: a `--system-tokens` system prompt and a `--user-tokens` user turn per
    request, `--max-tokens` greedy tokens out; at each `--concurrency` c, c requests are kept in
    flight until `--requests` (per unit of c) have run. With caching on, one request primes the
    cache first (the steady state of a server whose system prompt is in use).
  - multi-turn conversation: c conversations at once, `--turns` turns each, where a turn's
    prompt is the conversation so far (system prompt, every user turn and answer) plus a new
    user turn.
Time to first token is measured at the engine, from a request's admission to the step that
returns its first token (no HTTP). Throughput is output tokens over the workload's wall time.
Shapes: `default` (the embedded SmolLM2-135M-Instruct, real weights) and those of
bench/bench_gpu.py (`llama-8b`: random bf16 weights of Llama-3-8B's shapes; `tiny` for a CPU
smoke test). Greedy outputs with caching on and off are compared (exact in fp32; bf16 may differ
by rounding where the cached K/V were computed in another batch shape).

    python bench/bench_prefix_cache.py --json prefix-cache.json               # GPU
    python bench/bench_prefix_cache.py --device cpu --shapes tiny --system-tokens 128 \\
        --user-tokens 8 --max-tokens 8 --requests 2 --concurrency 1,4 --turns 3   # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import llama_config, word_tokenizer  # noqa: E402

from stride.engine import loader  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.model import CausalLM  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402

RESULTS: dict = {}


def record(key: str, value) -> None:
    """Keep every number and rewrite the JSON at once: a run cut short still leaves its results."""
    RESULTS[key] = value
    print(f"{key}: {json.dumps(value)}", flush=True)
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(RESULTS, indent=1))


# ---- engines ------------------------------------------------------------------------------------


def dtype_name() -> str:
    return "bfloat16" if ARGS.device == "cuda" else "float32"


def default_engine() -> Engine:
    return Engine(EngineConfig(device=ARGS.device, dtype=dtype_name()))


def random_engine(shape: str) -> Engine:
    """Stride's engine over random weights of `shape` (speed does not depend on their values),
    made on the device directly: no transformers model, no second copy."""
    config = llama_config(shape)
    dtype = getattr(torch, dtype_name())
    device = torch.device(ARGS.device)
    with torch.device("meta"):
        net = CausalLM(config)
    net = net.to(dtype).to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for pname, p in net.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.rotary = loader.rotary_embedding(config, device)
    tokenizer = word_tokenizer(config.vocab_size)
    loaded = loader.LoadedModel(shape, Path(tempfile.mkdtemp()), config, tokenizer, net.eval())
    return Engine(EngineConfig(model=shape, device=ARGS.device, dtype=dtype_name()), loaded)


# ---- driving the engine -------------------------------------------------------------------------


class Driver:
    """Keeps requests in flight on an engine core and times each one's first token."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.params = SamplingParams(max_tokens=ARGS.max_tokens, temperature=0.0, ignore_eos=True)
        self.added: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.count = 0

    def add(self, prompt: list[int]) -> str:
        self.count += 1
        rid = f"r{self.count}"
        self.core.add(GenerateRequest(rid, prompt, self.params))
        self.added[rid] = time.perf_counter()
        self.tokens[rid] = []
        return rid

    def step(self) -> list[str]:
        """One engine step; returns the requests it finished."""
        finished = []
        outs = self.core.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if out.token_ids and rid not in self.ttft:
                self.ttft[rid] = now - self.added[rid]
            self.tokens[rid] += out.token_ids
            if out.finished:
                self.cached[rid] = out.num_cached_tokens
                finished.append(rid)
        return finished

    def drain(self) -> None:
        while self.core.has_work:
            self.step()


def random_tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def summary(driver: Driver, rids: list[str], seconds: float) -> dict:
    ttft = [driver.ttft[r] for r in rids]
    out_tokens = sum(len(driver.tokens[r]) for r in rids)
    return {
        "requests": len(rids),
        "ttft_p50_ms": round(1e3 * statistics.median(ttft), 2),
        "ttft_p90_ms": round(1e3 * sorted(ttft)[math.ceil(0.9 * len(ttft)) - 1], 2),
        "output_tok_s": round(out_tokens / seconds, 1),
        "requests_s": round(len(rids) / seconds, 2),
        "cached_prompt_tokens_mean": round(statistics.mean(driver.cached[r] for r in rids), 1),
    }


def shared_system(core: EngineCore, c: int, caching: bool, seed: int) -> tuple[dict, list]:
    """c requests in flight (closed loop), each a fixed system prompt plus its own user turn."""
    vocab = core.engine.hf_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    system = random_tokens(ARGS.system_tokens, vocab, gen)
    prompts = [
        system + random_tokens(ARGS.user_tokens, vocab, gen) for _ in range(ARGS.requests * c)
    ]
    driver = Driver(core)
    core.engine.cache.prefix_caching = caching
    if caching:  # prime the cache with the system prompt, as a server in use has it
        driver.add(system + random_tokens(ARGS.user_tokens, vocab, gen))
        driver.drain()
    todo = list(prompts)
    rids: list[str] = []
    start = time.perf_counter()
    while todo and len(rids) < c:
        rids.append(driver.add(todo.pop(0)))
    while core.has_work:
        for _ in driver.step():
            if todo:
                rids.append(driver.add(todo.pop(0)))
    seconds = time.perf_counter() - start
    return summary(driver, rids, seconds), [driver.tokens[r] for r in rids]


def multi_turn(core: EngineCore, c: int, caching: bool, seed: int) -> tuple[dict, list]:
    """c conversations at once: each turn's prompt is the conversation so far + a user turn."""
    vocab = core.engine.hf_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    system = random_tokens(ARGS.system_tokens, vocab, gen)
    turns = [
        [random_tokens(ARGS.user_tokens, vocab, gen) for _ in range(ARGS.turns)] for _ in range(c)
    ]
    driver = Driver(core)
    core.engine.cache.prefix_caching = caching
    history = [list(system) for _ in range(c)]
    turn = [0] * c
    owner: dict[str, int] = {}
    rids: list[str] = []
    last_turn: list[str] = []

    def next_turn(i: int) -> None:
        history[i] += turns[i][turn[i]]
        rid = driver.add(list(history[i]))
        owner[rid] = i
        rids.append(rid)
        if turn[i] == ARGS.turns - 1:
            last_turn.append(rid)

    start = time.perf_counter()
    for i in range(c):
        next_turn(i)
    while core.has_work:
        for rid in driver.step():
            i = owner[rid]
            history[i] += driver.tokens[rid]  # the answer joins the conversation
            turn[i] += 1
            if turn[i] < ARGS.turns:
                next_turn(i)
    seconds = time.perf_counter() - start
    out = summary(driver, rids, seconds)
    out["last_turn_ttft_p50_ms"] = round(
        1e3 * statistics.median(driver.ttft[r] for r in last_turn), 2
    )
    out["last_turn_prompt_tokens"] = len(history[0]) - len(driver.tokens[last_turn[0]])
    return out, [driver.tokens[r] for r in rids]


WORKLOADS = {"shared_system": shared_system, "multi_turn": multi_turn}


def bench_shape(shape: str) -> None:
    t0 = time.perf_counter()
    engine = default_engine() if shape == "default" else random_engine(shape)
    record(f"{shape}/startup_s", round(time.perf_counter() - t0, 1))
    record(f"{shape}/kv_blocks", engine.cache.num_blocks)
    core = EngineCore(engine)
    vocab = engine.hf_config.vocab_size
    warm = Driver(core)  # compile, allocate, capture: nothing of it counts
    for _ in range(2):
        warm.add(random_tokens(ARGS.system_tokens, vocab, torch.Generator().manual_seed(99)))
    warm.drain()
    for w, (name, workload) in enumerate(WORKLOADS.items()):
        for c in ARGS.concurrency:
            seed = 1000 * w + c
            off, off_tokens = workload(core, c, False, seed)
            on, on_tokens = workload(core, c, True, seed)
            equal = sum(a == b for a, b in zip(off_tokens, on_tokens, strict=True))
            record(
                f"{shape}/{name}/c{c}",
                {
                    "off": off,
                    "on": on,
                    "ttft_p50_speedup": round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 2),
                    "throughput_speedup": round(on["output_tok_s"] / off["output_tok_s"], 2),
                    "same_greedy_outputs": f"{equal}/{len(off_tokens)}",
                },
            )
    del warm, core, engine
    gc.unfreeze()  # (EngineCore froze the heap) so that the next shape finds the memory free
    gc.collect()
    if ARGS.device == "cuda":
        torch.cuda.empty_cache()


def table() -> str:
    rows = ["| shape / workload / c | TTFT p50 off → on (ms) | × | output tok/s off → on | × |",
            "|---|---:|---:|---:|---:|"]  # fmt: skip
    for key, r in RESULTS.items():
        if isinstance(r, dict) and "ttft_p50_speedup" in r:
            off, on = r["off"], r["on"]
            rows.append(
                f"| {key} | {off['ttft_p50_ms']} → {on['ttft_p50_ms']} | {r['ttft_p50_speedup']}"
                f" | {off['output_tok_s']} → {on['output_tok_s']} | {r['throughput_speedup']} |"
            )
    return "\n".join(rows)


def main() -> None:
    card = torch.cuda.get_device_name() if ARGS.device == "cuda" else "cpu"
    record("card", card)
    record("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    record("command", " ".join(sys.argv))
    record("versions", {"torch": torch.__version__})
    settings = ("system_tokens", "user_tokens", "max_tokens", "requests", "turns", "concurrency")
    record("settings", {k: getattr(ARGS, k) for k in settings})
    for shape in ARGS.shapes:
        bench_shape(shape)
    print(table())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="default,llama-8b", type=lambda t: t.split(","))
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    parser.add_argument("--json", help="write every result here as it is measured")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per answer")
    parser.add_argument(
        "--concurrency", default=[1, 16], type=lambda t: [int(x) for x in t.split(",")]
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per unit of concurrency")
    parser.add_argument("--turns", type=int, default=8, help="multi-turn: turns per conversation")
    ARGS = parser.parse_args()
    main()
