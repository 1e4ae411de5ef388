"""Prompt logprobs: every prompt token's log-probability, equal to transformers' in fp32.

They come from the prefill that runs anyway, in chunks, beside other requests, after a
preemption, and for prompts the prefix cache holds (such a prompt is computed, not looked up).
Over HTTP: tests/server/test_prompt_logprobs_http.py.
"""

from __future__ import annotations

import pytest
import torch

from stride.engine.sequence import SamplingParams
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import make_core

PROMPT = [5, 17, 42, 99, 7, 23, 11, 5, 17, 42, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89] * 2


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, by transformers in fp32: [len - 1, vocab]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]


def run(core, requests: list[GenerateRequest]) -> dict[str, list]:
    """Run to completion: each request's prompt logprobs (from its first output)."""
    found: dict[str, list] = {}
    for r in requests:
        core.add(r)
    while core.has_work:
        for out in core.step():
            assert out.error is None
            if out.prompt_logprobs is not None:
                assert out.request_id not in found  # once, with the first output
                found[out.request_id] = out.prompt_logprobs
    return found


def check(lps: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(lps) == len(prompt) and lps[0] is None
    for i, lp in enumerate(lps[1:]):
        assert lp.token_id == prompt[i + 1]
        assert lp.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-5)
        assert lp.rank == int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
        values, ids = ref[i].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)


def params(k: int = 2, n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, prompt_logprobs=k, ignore_eos=True)


def test_prompt_logprobs_equal_transformers(tiny_dir, tiny_hf):
    core = make_core(tiny_dir)
    got = run(core, [GenerateRequest("a", PROMPT, params(3))])
    check(got["a"], PROMPT, reference(tiny_hf, PROMPT), 3)


def test_in_chunks_beside_others_and_from_a_cached_prompt(tiny_dir, tiny_hf):
    """Prefill chunks of 8 tokens, two more requests in the batch, and the same prompt cached
    by a first request: the prompt is scored whole all the same."""
    core = make_core(tiny_dir, max_num_batched_tokens=8)
    run(core, [GenerateRequest("warm", PROMPT, SamplingParams(max_tokens=2))])
    assert core.engine.cache.prefix_caching
    requests = [
        GenerateRequest("a", PROMPT, params()),
        GenerateRequest("free", PROMPT[::-1], SamplingParams(max_tokens=4)),
        GenerateRequest("b", PROMPT[5:], params(1)),
    ]
    got = run(core, requests)
    assert set(got) == {"a", "b"}
    check(got["a"], PROMPT, reference(tiny_hf, PROMPT), 2)
    check(got["b"], PROMPT[5:], reference(tiny_hf, PROMPT[5:]), 1)
    assert core.stats().prefix_cache_hits == 0  # they computed their prompts


def test_after_preemption(tiny_dir, tiny_hf):
    """A KV cache too small for everyone: sequences are preempted and recomputed, and each
    prompt logprob is still sent once and right."""
    core = make_core(tiny_dir, kv_bytes=96 << 10, max_num_batched_tokens=16)
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(6)]
    requests = [GenerateRequest(str(i), p, params(1, 40)) for i, p in enumerate(prompts)]
    got = run(core, requests)
    assert core.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        check(got[str(i)], p, reference(tiny_hf, p), 1)
