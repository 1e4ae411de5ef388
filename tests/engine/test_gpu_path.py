"""The GPU decode path: the paged decode kernel against plain torch, and CUDA-graph decode steps
against the eager path token for token. Skipped where there is no Triton / no GPU (CI)."""

from __future__ import annotations

import json

import pytest
import torch

from stride.engine import fused
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.kernels import decode_attention as attention
from stride.engine.sequence import Constraint, SamplingParams, Sequence
from stride.engine.spans import Span, prepare
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig

needs_triton = pytest.mark.skipif(attention.triton is None, reason="needs triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (4, 4, 64)])
def test_decode_kernel_matches_reference(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    block, num_blocks, dev = 16, 64, torch.device("cuda")
    k_cache = torch.randn(num_blocks * block, kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lengths = [1, 15, 16, 17, 100, 250]
    tables = torch.zeros(len(lengths), 20, dtype=torch.int32, device=dev)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    for i, n in enumerate(lengths):
        for j in range(-(-n // block)):
            tables[i, j] = free.pop()
    meta = attention.DecodeMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long, device=dev),
        block_tables=tables,
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=dev),
        block_size=block,
    )
    q = torch.randn(len(lengths), heads, head_dim, device=dev, dtype=dtype)
    out = attention.decode_attention(q, k_cache, v_cache, meta).float()
    ref = attention.decode_attention_reference(q.double(), k_cache.double(), v_cache.double(), meta)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def _greedy(core: EngineCore, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add(GenerateRequest(f"r{i}", ids, params))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for o in core.step():
            out[o.request_id].extend(o.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


@needs_triton
@needs_cuda
def test_cuda_graph_decode_equals_eager(tiny_dir):
    """fp32 on the GPU: graph replays give the eager path's tokens, with ragged batches that grow
    and shrink across buckets, and requests mixing prefill and decode in one step."""
    engine = Engine(
        EngineConfig(model=str(tiny_dir), device="cuda", dtype="float32", kv_cache_memory=64 << 20)
    )
    assert engine.runner.graphs is not None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 40, 17, 5, 90, 33)]
    core = EngineCore(engine)
    with_graphs = _greedy(core, prompts, 24)
    engine.runner.graphs = None
    eager = _greedy(EngineCore(engine), prompts, 24)
    assert with_graphs == eager


@needs_triton
@needs_cuda
def test_gpu_fp32_greedy_equals_cpu(tiny_dir):
    """The whole GPU path (fused kernels, graphs, paged decode kernel) against the CPU path."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (7, 64, 2, 31)]
    outs = {}
    for device in ("cpu", "cuda"):
        config = EngineConfig(
            model=str(tiny_dir), device=device, dtype="float32", kv_cache_memory=64 << 20
        )
        outs[device] = _greedy(EngineCore(Engine(config)), prompts, 32)
    assert outs["cuda"] == outs["cpu"]


@needs_triton
@needs_cuda
def test_gpu_fp32_constrained_equals_cpu(tiny_dir):
    """Grammar masks copied to the device (through the staging buffer, grown as the batch
    grows, reused step after step) give the CPU's tokens, beside free requests."""
    a, b = {"type": "string", "maxLength": 5}, {"type": "array", "items": {"type": "integer"}}
    schema = {"type": "object", "properties": {"a": a, "b": b}, "required": ["a", "b"]}
    constraint = Constraint("json_schema", json.dumps(schema))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (7, 64, 2, 31, 12, 5)]
    outs = {}
    for device in ("cpu", "cuda"):
        config = EngineConfig(
            model=str(tiny_dir), device=device, dtype="float32", kv_cache_memory=64 << 20
        )
        core = EngineCore(Engine(config))
        out: dict[str, list[int]] = {}
        for wave in (prompts[:1], prompts):  # one row, then six: the buffer grows
            for i, ids in enumerate(wave):
                free = i % 3 == 2
                params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=free,
                                        constraint=None if free else constraint)  # fmt: skip
                core.add(GenerateRequest(f"{len(wave)}-{i}", ids, params))
            while core.has_work:
                for o in core.step():
                    out.setdefault(o.request_id, []).extend(o.token_ids)
        outs[device] = out
    assert outs["cuda"] == outs["cpu"]


def _seeded(i: int) -> SamplingParams:
    """A seeded sampled request's settings, varied: temperature only, top-k, top-p, min-p."""
    return [
        SamplingParams(max_tokens=32, temperature=1.0, seed=i, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.8, top_k=40, seed=i, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=1.2, top_p=0.9, seed=i, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.7, min_p=0.05, seed=i, ignore_eos=True),
    ][i % 4]


@needs_triton
@needs_cuda
def test_gpu_fp32_seeded_sampling_equals_cpu(tiny_dir):
    """Seeded sampled requests beside greedy ones: the GPU path (graphs, device draws in
    multi-step bursts and in launches kept in flight) gives the CPU's tokens, and its bursts
    hold sampled rows."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (7, 64, 2, 31, 12)]
    outs, bursts = {}, []
    for device, steps in (("cpu", 1), ("cuda", 4)):
        config = EngineConfig(
            model=str(tiny_dir), device=device, dtype="float32", kv_cache_memory=64 << 20
        )
        core = EngineCore(Engine(config), SchedulerConfig(fused_decode_steps=steps))
        decode_steps = core.engine.runner.decode_steps

        def counting(seqs, tokens, n, *args, _run=decode_steps, **kwargs):
            if n > 1:
                bursts.append({s.request_id for s in seqs})
            return _run(seqs, tokens, n, *args, **kwargs)

        core.engine.runner.decode_steps = counting
        for i, ids in enumerate(prompts):
            greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            core.add(GenerateRequest(f"r{i}", ids, greedy if i == 4 else _seeded(i)))
        out: dict[str, list[int]] = {}
        while core.has_work:
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        outs[device] = out
    assert outs["cuda"] == outs["cpu"]
    assert any(ids & {"r0", "r1", "r2", "r3"} for ids in bursts)


@needs_triton
def _fp32_engine(tiny_dir, device: str, eager_tokens: list[int], monkeypatch) -> Engine:
    """The tiny model in fp32 on `device`; on CUDA, the length of every span that runs an eager
    pass is appended to `eager_tokens`."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                                 kv_cache_memory=64 << 20))  # fmt: skip
    if device == "cuda":
        eager = engine.runner._forward_eager

        def counting(spans, num_layers):
            eager_tokens.extend(len(c.token_ids) for c in spans)
            return eager(spans, num_layers)

        monkeypatch.setattr(engine.runner, "_forward_eager", counting)
    return engine


@needs_cuda
@pytest.mark.parametrize(
    ("decoder", "options"),
    [
        ("speculative", {"draft": "ngram", "num_speculative_tokens": 4, "adaptive": False}),
        ("refine", {"method": "jacobi", "window": 4}),
        ("refine", {"method": "lookahead", "window": 4, "ngram": 3, "candidates": 2}),
    ],
)
def test_multi_token_spans_replay_as_graph_rows(tiny_dir, decoder, options, monkeypatch):
    """Drafts, Jacobi windows and lookahead's masked branches are scored as graph rows (no
    eager pass once prompts are in), and the tokens still equal the CPU path's in fp32."""
    prompt = [5, 6, 7, 8, 9] * 14  # repetitive (n-gram drafts), longer than MAX_GRAPH_QUERY
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    eager_tokens: list[int] = []
    for device in ("cpu", "cuda"):
        engine = _fp32_engine(tiny_dir, device, eager_tokens, monkeypatch)
        core = EngineCore(engine)
        core.add(GenerateRequest("r", prompt, params, decoder=decoder, decoder_options=options))
        tokens = []
        while core.has_work:
            for o in core.step():
                tokens += o.token_ids
        outs[device] = tokens
    assert outs["cuda"] == outs["cpu"]
    # Only the prompt's span (with the first proposal riding along) ran eagerly.
    assert len(eager_tokens) == 1 and eager_tokens[0] >= len(prompt)


@needs_cuda
def test_short_prompts_and_cached_prefixes_prefill_as_graph_rows(tiny_dir, monkeypatch):
    """A short prompt, and the suffix of a prompt whose prefix the cache holds, are scored as
    rows of the decode graph (no eager pass at all), with the CPU path's tokens in fp32."""
    prefix = [(7 * i) % 300 + 3 for i in range(48)]  # three full blocks of 16
    prompts = [prefix + [11] * 8, prefix + [(5 * i) % 200 + 3 for i in range(30)]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs: dict[str, list] = {}
    eager_tokens: list[int] = []
    for device in ("cpu", "cuda"):
        engine = _fp32_engine(tiny_dir, device, eager_tokens, monkeypatch)
        engine.cache.prefix_caching = True
        core = EngineCore(engine)
        results = []
        for i, prompt in enumerate(prompts):  # one after the other: the second finds the prefix
            core.add(GenerateRequest(f"r{i}", prompt, params))
            tokens, cached = [], None
            while core.has_work:
                for o in core.step():
                    tokens += o.token_ids
                    cached = o.num_cached_tokens if o.finished else cached
            results.append((tokens, cached))
        outs[device] = results
    assert outs["cuda"] == outs["cpu"]
    assert outs["cuda"][1][1] == len(prefix)
    assert eager_tokens == []


def _spans(engine: Engine, lengths: list[int]) -> list[Span]:
    """Random prompts with KV reserved; fresh engines reserve the same blocks in the same order.
    A negative length -n is a decode step: n tokens of which the first n - 1 count as cached."""
    g = torch.Generator().manual_seed(0)
    spans = []
    for n in lengths:
        ids = torch.randint(3, 384, (abs(n),), generator=g).tolist()
        seq = Sequence("r", ids, SamplingParams())
        engine.cache.reserve(seq, abs(n))
        seq.num_cached = -n - 1 if n < 0 else 0
        spans.append(Span(seq, seq.tail, 1))
    return spans


def _hidden(engine: Engine, forward, spans: list[Span]) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states of one pass over the spans, and the keys it wrote."""
    meta, tokens, positions, _ = prepare(spans, engine.cache.block_size, engine.device)
    k, v = engine.cache.k.clone(), engine.cache.v.clone()
    with torch.inference_mode():
        hidden = forward(tokens, positions, (k, v), meta)
    return hidden.float(), k.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@needs_triton
@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "lengths",
    [[1], [-9], [-9, -4, -6], [2, -3], [5, 3], [30, 9]],
    ids=["one-row", "decode-row", "decode-rows", "few-rows", "rows", "prefill"],
)
def test_fused_forward_matches_module_forward(tiny_dirs, arch, lengths):
    """Both fused layer shapes (for up to `fused.FEW_ROWS` rows, Triton GEMVs with norm, rotary +
    KV write, SiLU and residual folded in; for more, cuBLAS GEMMs beside fused elementwise
    kernels) against the
    module forward: equal in fp32, and in bf16 as close to the fp32 result as the module forward
    itself is. The decode row sits at position 8, so rotary is not the identity."""
    engines = {}  # caches of as many blocks, so that both dtypes write the same slots
    for dtype, megabytes in (("float32", 16), ("bfloat16", 8)):
        config = EngineConfig(model=str(tiny_dirs[arch]), device="cuda", dtype=dtype,
                              kv_cache_memory=megabytes << 20)  # fmt: skip
        engines[dtype] = Engine(config)
    for engine in engines.values():
        assert isinstance(engine.runner.forward_fn, fused.FusedForward)
        assert engine.runner.forward_fn.few_rows == fused.FEW_ROWS  # (a tiny model fits L2)
    exact = engines["float32"]
    spans = _spans(exact, lengths)
    ref, ref_k = _hidden(exact, exact.model, spans)
    out, out_k = _hidden(exact, exact.runner.forward_fn, spans)
    assert _rel(out, ref) < 1e-5 and _rel(out_k, ref_k) < 1e-5
    bf16 = engines["bfloat16"]
    spans = _spans(bf16, lengths)
    module, module_k = _hidden(bf16, bf16.model, spans)
    fused_, fused_k = _hidden(bf16, bf16.runner.forward_fn, spans)
    assert _rel(fused_, ref) < 1.5 * _rel(module, ref) + 1e-3
    assert _rel(fused_k, ref_k) < 1.5 * _rel(module_k, ref_k) + 1e-3


@needs_triton
@needs_cuda
def test_masked_spans_replay_as_graph_rows_scoring_what_the_padded_path_does(tiny_dir):
    """Lookahead-like spans (a tail, a window, a branch that sees only the tail), a mask that
    reaches into cached slots, and a causal span beside them, in one masked graph replay: the
    logits of the padded masked-SDPA path, in fp32; and the decode graphs replay unmasked as
    before once no span is masked."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cuda", dtype="float32",
                                 kv_cache_memory=64 << 20))  # fmt: skip
    runner, cache = engine.runner, engine.cache
    assert runner.graphs is not None
    g = torch.Generator().manual_seed(3)
    seqs = []
    for i, n in enumerate((30, 45, 9)):
        ids = torch.randint(3, 384, (n,), generator=g).tolist()
        seq = Sequence(f"s{i}", ids, SamplingParams(max_tokens=4, temperature=0.0))
        cache.reserve(seq, n + 8)
        runner.forward([Span(seq, ids[:-1], num_logits=0)])
        seq.num_cached = n - 1
        seqs.append(seq)
    branchy = torch.ones(7, 7, dtype=torch.bool).tril()
    branchy[4:, 1:4] = False  # rows 4-6, a branch, see the tail and themselves, not the window
    reach = torch.ones(3, 5, dtype=torch.bool).tril(2)  # 3 tokens seeing 2 cached slots too
    reach[2, 3] = False
    at = seqs[0].num_cached
    window = [at + p for p in (0, 1, 2, 3, 1, 2, 3)]
    spans = [
        Span(seqs[0], seqs[0].token_ids[-1:] + [5, 6, 7, 8, 9, 10], 7, window, branchy),
        Span(seqs[1], seqs[1].token_ids[-1:] + [11, 12], 3, mask=reach),
        Span(seqs[2], seqs[2].token_ids[-1:] + [13, 14], 3),  # causal, no mask
    ]
    padded = runner._forward_eager(spans, None)
    replayed = runner.forward(spans)
    assert any(layout == "masked" for (_, _, layout) in runner.graphs._graphs)
    for a, b in zip(padded, replayed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    causal = [Span(seqs[2], seqs[2].token_ids[-1:] + [13, 14], 3)]
    torch.testing.assert_close(runner.forward(causal)[0], padded[2], atol=1e-4, rtol=1e-4)


@needs_triton
@needs_cuda
def test_one_span_over_a_long_context_replays_as_one_tree(tiny_dir):
    """A step that is one sequence's span over a long cached context (a prompt's tail after a
    prefix cache hit, a proposal at batch 1), causal or masked, replays as one tree: the
    logits of the padded path, in fp32."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cuda", dtype="float32",
                                 kv_cache_memory=64 << 20))  # fmt: skip
    runner, cache = engine.runner, engine.cache
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 384, (700,), generator=g).tolist()
    seq = Sequence("long", ids, SamplingParams(max_tokens=4, temperature=0.0))
    cache.reserve(seq, len(ids) + 8)
    runner.forward([Span(seq, ids[:600], num_logits=0)])  # the cached prefix
    seq.num_cached = 600
    branchy = torch.ones(32, 32, dtype=torch.bool).tril()
    branchy[18:, 4:18] = False  # a branch that sees the first four and itself
    for span in (Span(seq, ids[600:640], 40), Span(seq, ids[600:632], 32, mask=branchy)):
        assert runner._one_span(span)
        padded = runner._forward_eager([span], None)[0]
        replayed = runner.forward([span])[0]
        torch.testing.assert_close(replayed, padded, atol=1e-4, rtol=1e-4)
    assert any(layout == "one_span" for (_, _, layout) in runner.graphs._graphs)
