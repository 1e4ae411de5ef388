"""The engine against Hugging Face transformers, fp32 on CPU: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import make_core
from tests.helpers.models import load_hf

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
PROMPTS = ["Hello, world!", "def add(a, b):", "Once upon a time there was a small model"]


def run_to_end(core, requests) -> dict[str, list[int]]:
    for r in requests:
        core.add(r)
    got: dict[str, list[int]] = {}
    while core.has_work:
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    return got


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, cut after its end-of-sequence token like Stride's."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    tokens = out[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[: ends[0] + 1] if ends else tokens


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tiny_dirs):
    """Prefill of a prompt, then a two-token continuation against the cache: within 1e-4."""
    hf = load_hf(tiny_dirs[arch])
    core = make_core(tiny_dirs[arch])
    runner, cache = core.engine.runner, core.engine.cache
    ids = core.engine.tokenizer.encode(PROMPTS[2])
    seq = Sequence("s", ids, greedy(4))
    cache.reserve(seq, len(ids))
    (prefill,) = runner.forward([Span(seq, ids[:-2], num_logits=len(ids) - 2)])
    seq.num_cached = len(ids) - 2
    (rest,) = runner.forward([Span(seq, ids[-2:], num_logits=2)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat([prefill, rest]), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate(arch, tiny_dirs):
    hf = load_hf(tiny_dirs[arch])
    core = make_core(tiny_dirs[arch])
    prompts = [core.engine.tokenizer.encode(p) for p in PROMPTS]
    got = run_to_end(core, [GenerateRequest(str(i), p, greedy(24)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(hf, p, 24)


def test_default_model_chat_matches_generate(default_engine, default_hf):
    from stride.scheduler.core import EngineCore

    hf = default_hf.eval()
    tok = default_engine.tokenizer
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "2+2="]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in chats
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    core = EngineCore(default_engine)
    got = run_to_end(core, [GenerateRequest(str(i), p, greedy(16)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(hf, p, 16)
    assert default_engine.cache.num_free_blocks == default_engine.cache.num_usable_blocks


def _mixed_prompts(tok, n: int) -> list[list[int]]:
    base = tok.encode(" ".join(PROMPTS) * 3)
    return [base[(7 * i) % 11 : (7 * i) % 11 + 3 + (13 * i) % 60] for i in range(n)]


def _staggered(core, prompts, n_tokens: int, every: int = 2) -> dict[str, list[int]]:
    """Add one request every `every` steps, so arrivals land mid-decode of earlier ones."""
    pending = [GenerateRequest(str(i), p, greedy(n_tokens)) for i, p in enumerate(prompts)]
    got: dict[str, list[int]] = {}
    step = 0
    while pending or core.has_work:
        if pending and step % every == 0:
            core.add(pending.pop(0))
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    return got


def test_sixteen_staggered_requests_match_generate(tiny_dir, tiny_hf):
    core = make_core(tiny_dir)
    prompts = _mixed_prompts(core.engine.tokenizer, 16)
    got = _staggered(core, prompts, 12)
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(tiny_hf, p, 12), f"request {i}"


def test_chunked_prefill_under_tiny_token_budget(tiny_dir, tiny_hf):
    core = make_core(tiny_dir, max_num_batched_tokens=8)
    prompts = _mixed_prompts(core.engine.tokenizer, 6)
    assert max(len(p) for p in prompts) > 8
    got = _staggered(core, prompts, 10, every=1)
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(tiny_hf, p, 10)


def test_preemption_recomputes_exactly(tiny_dir, tiny_hf):
    # 12 blocks of 16 tokens shared by 8 requests of ~40-70 tokens each: preemption is forced.
    from stride.engine.kv_cache import KVCache

    per_block = KVCache.bytes_per_block(2, 2, 16, 16, torch.float32)
    core = make_core(tiny_dir, kv_bytes=13 * per_block)
    prompts = _mixed_prompts(core.engine.tokenizer, 8)
    got = run_to_end(core, [GenerateRequest(str(i), p, greedy(20)) for i, p in enumerate(prompts)])
    assert core.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(tiny_hf, p, 20)
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks


def test_masked_spans_as_decode_rows_score_what_the_padded_path_does(tiny_dir):
    """Lookahead-like spans (a tail, a window, branches that see only the tail), and a mask
    that reaches into cached slots, scored as decode rows (`_forward_rows`, the GPU's path for
    masked spans) and on the padded masked-SDPA path: the same logits in fp32."""
    core = make_core(tiny_dir)
    runner, cache = core.engine.runner, core.engine.cache
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        ids = core.engine.tokenizer.encode(prompt)
        seq = Sequence(f"s{i}", ids, greedy(4))
        cache.reserve(seq, len(ids) + 8)
        runner.forward([Span(seq, ids[:-1], num_logits=0)])
        seq.num_cached = len(ids) - 1
        seqs.append(seq)
    branchy = torch.ones(7, 7, dtype=torch.bool).tril()
    branchy[4:, 1:4] = False  # rows 4-6, a branch, see the tail and themselves, not the window
    reach = torch.ones(3, 5, dtype=torch.bool).tril(2)  # 3 tokens seeing 2 cached slots too
    reach[2, 3] = False
    at = seqs[0].num_cached  # (the tail's position; the branch sits where the window does)
    window = [at + p for p in (0, 1, 2, 3, 1, 2, 3)]
    causal = torch.ones(2, 2, dtype=torch.bool).tril()
    spans = [
        Span(seqs[0], seqs[0].token_ids[-1:] + [5, 6, 7, 8, 9, 10], 7, window, branchy),
        Span(seqs[1], seqs[1].token_ids[-1:] + [11, 12], 3, mask=reach),
        Span(seqs[2], seqs[2].token_ids[-1:] + [13], 1, mask=causal),
    ]
    padded = runner._forward_eager(spans, None)
    rows = runner._forward_rows(spans)
    for a, b in zip(padded, rows, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
