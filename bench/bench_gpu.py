"""Stride's engine against Hugging Face transformers on one GPU, at the memory-bandwidth limit.

In one run, for each model shape (random bf16 weights of the real shapes; speed does not depend
on weight values), on the same card:
  - transformers `generate` at batch 1 and batch 256 (128 prompt tokens, 128 new tokens);
  - transformers continuous batching (`generate_batch`, paged attention) for 256 requests;
  - Stride's engine: batch-1 decode tok/s and its share of the HBM roofline (weight bytes x tok/s
    / card bandwidth), then output tok/s for 1 ... 256 concurrent requests (128 in, 128 out),
    with and without CUDA graphs at batch 1 and 256.
Optional parts: `--greedy-check` compares GPU greedy outputs (bf16 and fp32) with a CPU fp32
reference made by `--write-reference` on the default model; `--http` drives `stride serve`
with 64 and 256 concurrent streams.

    python bench/bench_gpu.py --shapes smollm2-135m,llama-8b --json results.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.engine import loader  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.gguf_file import transformers_kwargs  # noqa: E402
from stride.engine.model import CausalLM  # noqa: E402
from stride.engine.runner import ModelRunner  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # a CPU smoke test of this script
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, SXM datasheets
PROMPT, NEW = 128, 128

RESULTS: dict = {}
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
REPLAY_BATCHES = (1, 2, 4, 8, 64, 256)  # decode graphs timed alone


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def record(key: str, value) -> None:
    """Keep every number, and rewrite the JSON at once: a run cut short still leaves its results."""
    RESULTS[key] = value
    print(f"{key}: {value}", flush=True)
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(RESULTS, indent=1))


def llama_config(shape: str):
    from transformers import LlamaConfig

    fields = dict(SHAPES[shape])
    theta = fields.pop("rope_theta")
    config = LlamaConfig(
        **fields,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    config.rope_theta = theta
    return config


def word_tokenizer(vocab: int):
    """A tokenizer with one word per id: the detokenizer has something to do, nothing to learn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def random_hf_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(ARGS.device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPE[ARGS.device], attn_implementation="sdpa"
        )
    return model.eval()


def stride_engine(state: dict, config, tokenizer) -> Engine:
    """Stride's engine over the very tensors of `state` (no copy); `state` is emptied, so that
    the engine alone owns them and can concatenate its fused weights without doubling memory."""

    with torch.device("meta"):
        net = CausalLM(config)
    net.load_state_dict(state, strict=False, assign=True)
    state.clear()
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.rotary = loader.rotary_embedding(config, torch.device(ARGS.device))
    path = Path(tempfile.mkdtemp())
    loaded = loader.LoadedModel("random", path, config, tokenizer, net.eval())
    config_ = EngineConfig(model="random", device=ARGS.device, dtype=str(DTYPE[ARGS.device])[6:])
    return Engine(config_, loaded)


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all weight bytes, bytes a decode step reads: all but the input embedding if untied)."""
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    return total, total - (0 if tied else embed.numel() * embed.element_size())


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, PROMPT), generator=g).tolist()


# ---- transformers ----------------------------------------------------------------------------


def hf_generate(model, batch: int, vocab: int) -> float:
    ids = torch.tensor(prompts(batch, vocab), device=ARGS.device)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    sync()
    return (out.shape[1] - PROMPT) * batch / (time.perf_counter() - t0)


def hf_continuous(model, n: int, vocab: int) -> dict:
    from transformers import GenerationConfig

    impl = model.config._attn_implementation
    try:
        model.set_attn_implementation("paged|sdpa")
    except Exception as e:  # older/newer transformers pick their own paged implementation
        print(f"paged|sdpa not settable ({e}); generate_batch picks", flush=True)
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(prompts(8, vocab, seed=1), generation_config=gen)  # warm-up
    sync()
    t0 = time.perf_counter()
    outs = model.generate_batch(prompts(n, vocab), generation_config=gen)
    sync()
    elapsed = time.perf_counter() - t0
    used = model.config._attn_implementation
    model.set_attn_implementation(impl)
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"tok_s": tokens / elapsed, "tokens": tokens, "attn": used}


# ---- Stride -----------------------------------------------------------------------------------


def run_core(core: EngineCore, batch: list[list[int]], new: int = NEW) -> dict:
    """Submit every prompt at once, step until all finish; output tok/s and decode tok/s."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(batch):
        core.add(GenerateRequest(f"r{i}-{t0}", ids, params))
    tokens, first = 0, None
    steps = 0
    while core.has_work:
        for out in core.step():
            tokens += len(out.token_ids)
        steps += 1
        if first is None and tokens:
            first = (time.perf_counter(), tokens)
    end = time.perf_counter()
    return {
        "tok_s": tokens / (end - t0),
        "decode_tok_s": (tokens - first[1]) / (end - first[0]),
        "tokens": tokens,
        "steps": steps,
    }


def bench_stride(core: EngineCore, vocab: int, shape: str, bytes_read: int, bw: dict) -> None:
    runner = core.engine.runner
    run_core(core, prompts(4, vocab, seed=2), new=16)  # warm-up
    b1 = run_core(core, prompts(1, vocab))
    record(f"{shape}/stride/batch1_tok_s", round(b1["decode_tok_s"], 1))
    executor = core.executor
    executor.overlap = False  # ablation: every launch waited for before the next is prepared
    waited = run_core(core, prompts(1, vocab))["decode_tok_s"]
    record(f"{shape}/stride_no_overlap/batch1_tok_s", round(waited, 1))
    steps, executor.burst_steps = executor.burst_steps, 1  # ablation: a sync every token
    single = run_core(core, prompts(1, vocab))["decode_tok_s"]
    record(f"{shape}/stride_no_fused_steps/batch1_tok_s", round(single, 1))
    executor.burst_steps, executor.overlap = steps, True
    for name, rate in bw.items():
        record(
            f"{shape}/stride/batch1_roofline_{name}",
            round(bytes_read * b1["decode_tok_s"] / rate, 3),
        )
    for n in map(int, ARGS.concurrency.split(",")):
        r = run_core(core, prompts(n, vocab, seed=n))
        record(f"{shape}/stride/concurrent_{n}_tok_s", round(r["tok_s"], 1))
    if runner.graphs is None:
        return
    for b in REPLAY_BATCHES:
        record(f"{shape}/stride/graph_replay_ms_batch{b}", round(replay_ms(runner, b), 3))
    if ARGS.no_ablations:
        return
    # Ablations on the same engine and cache: module-by-module layers (still CUDA graphs), and
    # fused kernels without CUDA graphs.
    engine = core.engine
    variants = {
        "stride_graphs_unfused": ModelRunner(
            engine.model, engine.cache, engine.device, fused_kernels=False
        ),
        "stride_fused_no_graphs": ModelRunner(
            engine.model, engine.cache, engine.device, cuda_graphs=False, fused_kernels=False
        ),
    }
    variants["stride_fused_no_graphs"].forward_fn = runner.forward_fn  # no second weight concat
    if runner.forward_fn is not engine.model:  # the same kernels, launched without PDL
        no_pdl = ModelRunner(
            engine.model, engine.cache, engine.device, cuda_graphs=False, fused_kernels=False
        )
        no_pdl.forward_fn = runner.forward_fn
        os.environ["STRIDE_PDL"] = "0"
        g = runner.graphs
        no_pdl.graphs = DecodeGraphs(engine.model, g.forward, g.cache, g.max_batch, g.max_blocks)
        del os.environ["STRIDE_PDL"]
        variants["stride_no_pdl"] = no_pdl
        if runner.forward_fn.few_rows > 1:  # the fused GEMV for one row only, cuBLAS for more
            one_row = ModelRunner(
                engine.model, engine.cache, engine.device, cuda_graphs=False, fused_kernels=False
            )
            one_row.forward_fn = copy.copy(runner.forward_fn)
            one_row.forward_fn.few_rows = 1
            one_row.graphs = DecodeGraphs(engine.model, one_row.forward_fn, g.cache, g.max_batch,
                                          g.max_blocks)  # fmt: skip
            variants["stride_one_row_gemv"] = one_row
    for name, variant in variants.items():
        engine.runner = variant
        run_core(core, prompts(2, vocab, seed=2), new=8)
        b1 = run_core(core, prompts(1, vocab))["decode_tok_s"]
        record(f"{shape}/{name}/batch1_tok_s", round(b1, 1))
        n = int(ARGS.concurrency.split(",")[-1])
        r = run_core(core, prompts(n, vocab, seed=n))
        record(f"{shape}/{name}/concurrent_{n}_tok_s", round(r["tok_s"], 1))
        if variant.graphs is not None:
            for b in REPLAY_BATCHES[:4]:
                ms = round(replay_ms(variant, b), 3)
                record(f"{shape}/{name}/graph_replay_ms_batch{b}", ms)
        del variant
    engine.runner = runner


def replay_ms(runner: ModelRunner, batch: int) -> float:
    """GPU time of one decode step (graph replay alone): the step time minus this is host time."""
    graphs = runner.graphs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(batch)
    start.record()
    for _ in range(50):
        graphs.replay(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 50


def bench_shape(shape: str, bw: dict) -> None:
    config = llama_config(shape)
    hf = random_hf_model(config)
    total, read = weight_bytes(hf)
    record(f"{shape}/weight_bytes", total)
    record(f"{shape}/bytes_read_per_token", read)
    vocab = config.vocab_size
    if not ARGS.skip_hf:
        record(f"{shape}/hf_generate/batch1_tok_s", round(hf_generate(hf, 1, vocab), 1))
        record(f"{shape}/hf_generate/batch256_tok_s", round(hf_generate(hf, 256, vocab), 1))
        free_gpu()
        try:
            cb = hf_continuous(hf, 256, vocab)
            record(
                f"{shape}/hf_generate_batch/concurrent_256",
                {k: v if isinstance(v, str) else round(v, 1) for k, v in cb.items()},
            )
        except Exception as e:
            record(f"{shape}/hf_generate_batch/error", repr(e)[:300])
        free_gpu()
    state = hf.state_dict()
    del hf
    free_gpu()
    t0 = time.perf_counter()
    engine = stride_engine(state, config, word_tokenizer(vocab))
    record(f"{shape}/stride/startup_s", round(time.perf_counter() - t0, 1))
    record(f"{shape}/stride/kv_blocks", engine.cache.num_blocks)
    bench_stride(EngineCore(engine), vocab, shape, read, bw)
    del engine
    free_gpu()


def copy_bandwidth() -> float:
    """Achievable HBM bandwidth: a 2 GiB device-to-device copy, bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (2 << 30) / sorted(times)[len(times) // 2]


# ---- greedy outputs: GPU against the CPU fp32 reference ----------------------------------------


def greedy_outputs(engine: Engine, prompt_ids: list[list[int]], new: int) -> list[list[int]]:
    core = EngineCore(engine)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompt_ids):
        core.add(GenerateRequest(f"g{i}", ids, params))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompt_ids))}
    while core.has_work:
        for o in core.step():
            out[o.request_id].extend(o.token_ids)
    return [out[f"g{i}"] for i in range(len(prompt_ids))]


CHECK_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Say hello in Spanish.",
    "What is 12 times 7?",
    "Name a famous painter.",
]


def write_reference(path: Path, new: int = 48) -> None:
    engine = Engine(EngineConfig(device="cpu", dtype="float32", kv_cache_memory=64 << 20))
    tok = engine.tokenizer
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in CHECK_PROMPTS
    ]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    outs = greedy_outputs(engine, ids, new)
    path.write_text(json.dumps({"prompt_ids": ids, "cpu_fp32": outs, "new": new}))


def greedy_check(model_dir: str, reference: Path) -> None:
    """GPU greedy outputs against the CPU fp32 reference, in fp32 (expected: identical) and bf16.

    bf16 rounds differently from fp32, so a bf16 output may leave the reference where fp32's
    two best tokens are nearly tied. For each bf16 output that does, the fp32 logits at its
    first divergence (transformers, fp32, on the GPU, after the common prefix) say how near:
    the gap between fp32's best logit and that of the token bf16 chose, and its rank.
    """
    ref = json.loads(reference.read_text())
    diverged: list[tuple[int, int, int]] = []  # (prompt, position, bf16's token)
    for dtype in ("float32", "bfloat16"):
        engine = Engine(
            EngineConfig(model=model_dir, device=ARGS.device, dtype=dtype, kv_cache_memory=2 << 30)
        )
        path = engine.path
        outs = greedy_outputs(engine, ref["prompt_ids"], ref["new"])
        prefix = []
        for i, (a, b) in enumerate(zip(outs, ref["cpu_fp32"], strict=True)):
            n = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
            prefix.append(n)
            if dtype == "bfloat16" and n < len(b):
                diverged.append((i, n, a[n]))
        equal = sum(a == b for a, b in zip(outs, ref["cpu_fp32"], strict=True))
        record(
            f"greedy/{dtype}_gpu_vs_cpu_fp32",
            {"equal": f"{equal}/{len(outs)}", "common_prefix": prefix, "new": ref["new"]},
        )
        del engine
        free_gpu()
    if diverged:
        record("greedy/bfloat16_first_divergence_fp32_gap", divergence_gaps(path, ref, diverged))


def divergence_gaps(path: Path, ref: dict, diverged: list[tuple[int, int, int]]) -> dict:
    from transformers import AutoModelForCausalLM

    kwargs = transformers_kwargs(path)
    hf = AutoModelForCausalLM.from_pretrained(path, **kwargs, dtype=torch.float32)
    hf = hf.to(ARGS.device).eval()
    gaps, ranks = [], []
    for i, n, token in diverged:
        ids = ref["prompt_ids"][i] + ref["cpu_fp32"][i][:n]
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=ARGS.device)).logits[0, -1]
        gaps.append(round(float(logits.max() - logits[token]), 4))
        ranks.append(int((logits > logits[token]).sum()) + 1)
    del hf
    free_gpu()
    return {"max": max(gaps), "gaps": gaps, "ranks_in_fp32": ranks}


# ---- end to end through HTTP --------------------------------------------------------------------


async def http_streams(url: str, n: int, vocab: int, model: str, seed: int) -> dict:
    """`n` concurrent streams from this process: (first start, last end, output tokens)."""
    import httpx

    async def one(client, ids):
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": NEW,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usage = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if '"usage":{' in line:  # only the last chunk: parsing every one costs the client
                    usage = json.loads(line[6:])["usage"]["completion_tokens"]
        return usage

    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, ids) for ids in prompts(2, vocab, seed=3)))
        start = time.time()
        tokens = await asyncio.gather(*(one(client, ids) for ids in prompts(n, vocab, seed=seed)))
        return {"start": start, "end": time.time(), "tokens": sum(tokens)}


def _client_process(args: tuple) -> dict:
    return asyncio.run(http_streams(*args))


def http_load(url: str, n: int, vocab: int, model: str, clients: int = 4) -> dict:
    """`n` streams spread over `clients` processes, so that the load generator (one asyncio
    process parses ~10k SSE events/s) is not what gets measured; tok/s over the union of their
    wall times."""
    from concurrent.futures import ProcessPoolExecutor

    shares = [n // clients + (i < n % clients) for i in range(clients)]
    jobs = [(url, k, vocab, model, n * 100 + i) for i, k in enumerate(shares) if k]
    with ProcessPoolExecutor(len(jobs)) as pool:
        parts = list(pool.map(_client_process, jobs))
    elapsed = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    return {"tok_s": round(tokens / elapsed, 1), "tokens": tokens, "client_processes": len(jobs)}


def bench_http(model_dir: str) -> None:
    """Streams through `stride serve` at 64 and 256, then the engine alone on the same model."""
    port = 8123
    device = ARGS.device
    vocab = _vocab_size(model_dir)
    cmd = [sys.executable, "-m", "stride.server.cli", "serve", "--model", model_dir]
    cmd += ["--port", str(port), "--device", device, "--log-level", "warning"]
    cmd += ["--gpu-memory-utilization", "0.3"] + ARGS.serve_args.split()
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        for n in ARGS.http_streams:
            r = http_load(f"http://127.0.0.1:{port}", n, vocab, model, ARGS.http_clients)
            record(f"http/concurrent_{n}", r)
    finally:
        server.terminate()
        server.wait(30)
    if device == "cuda":
        free_gpu()
    engine = Engine(EngineConfig(model=model_dir, device=device, gpu_memory_utilization=0.3))
    core = EngineCore(engine)
    run_core(core, prompts(8, vocab, seed=3), new=16)
    for n in ARGS.http_streams:
        r = run_core(core, prompts(n, vocab, seed=n))
        record(f"http/engine_same_model_concurrent_{n}_tok_s", round(r["tok_s"], 1))


def _vocab_size(model_dir: str) -> int:
    """The model's vocabulary (prompts are random ids below it); SmolLM2's for a GGUF."""
    config = Path(model_dir) / "config.json"
    return json.loads(config.read_text())["vocab_size"] if config.exists() else 49152


def main() -> None:
    if ARGS.write_reference:
        write_reference(Path(ARGS.write_reference))
        return
    name = torch.cuda.get_device_name() if ARGS.device == "cuda" else "cpu"
    record("card", name)
    record("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    record(
        "versions",
        {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    )
    record("command", " ".join(sys.argv))
    measured = copy_bandwidth() if ARGS.device == "cuda" else 1e11
    record("copy_bandwidth_GBps", round(measured / 1e9))
    bw = {"measured_copy": measured}
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in name), None)
    if peak:
        bw["datasheet"] = peak
    if ARGS.greedy_check:
        greedy_check(ARGS.model_dir, Path(ARGS.greedy_check))
    if ARGS.http:
        bench_http(ARGS.model_dir)
    for shape in filter(None, ARGS.shapes.split(",")):
        bench_shape(shape, bw)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-8b")
    parser.add_argument("--json", help="write every result here as it is measured")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    parser.add_argument("--concurrency", default="1,8,32,64,128,256")
    parser.add_argument("--skip-hf", action="store_true", help="Stride only")
    parser.add_argument(
        "--no-ablations", action="store_true", help="no unfused / ungraphed / no-PDL variants"
    )
    parser.add_argument("--model-dir", help="the default model as a Hugging Face directory")
    parser.add_argument("--greedy-check", help="reference JSON from --write-reference")
    parser.add_argument(
        "--http", action="store_true", help="through `stride serve` (needs --model-dir)"
    )
    parser.add_argument("--write-reference", help="CPU: write the greedy reference JSON here")
    parser.add_argument(
        "--http-streams",
        default=[64, 256],
        type=lambda t: [int(x) for x in t.split(",")],
        help="concurrent streams for --http",
    )
    parser.add_argument("--http-clients", type=int, default=4, help="load-generator processes")
    parser.add_argument("--serve-args", default="", help="more `stride serve` flags for --http")
    ARGS = parser.parse_args()
    main()
