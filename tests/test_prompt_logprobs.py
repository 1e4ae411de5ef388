"""Prompt logprobs: every prompt token's log-probability, equal to transformers' in fp32.

They come from the prefill that runs anyway, in chunks, beside other requests, after a
preemption, and for prompts the prefix cache holds (such a prompt is computed, not looked up).
Over HTTP: `echo` with `logprobs` (OpenAI's legacy completions, what lm-eval's loglikelihood
tasks send) and vLLM's `prompt_logprobs`.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from stride.engine.sequence import SamplingParams
from stride.scheduler.outputs import GenerateRequest
from tests.conftest import make_core

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


# ---- over HTTP, on the default model -----------------------------------------------------------

# A small multiple-choice task: context, choices (each with a leading space), the answer.
TASK = [
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " London", " Rome"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", [" six", " eight", " ten"], 1),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit"], 0),
]


def lm_eval_requests(tokenizer) -> list[tuple[list[int], int]]:
    """(context + continuation token ids, context length) per choice, as lm-eval's
    local-completions tokenizes loglikelihood requests (tokenized_requests: token-id prompts)."""
    out = []
    for context, choices, _ in TASK:
        ctx = tokenizer.encode(context, add_special_tokens=False)
        for choice in choices:
            out.append((ctx + tokenizer.encode(choice, add_special_tokens=False), len(ctx)))
    return out


def parse_logprobs(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's `LocalCompletionsAPI.parse_logprobs`, for one choice (verbatim logic)."""
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = True
    for tok, top in zip(tokens_logprobs, top_logprobs, strict=False):
        if tok != max(top.values()):
            is_greedy = False
            break
    return logprobs, is_greedy


def test_lm_eval_loglikelihood_equals_transformers(default_server, default_hf):
    """The request lm-eval's `local-completions` sends for loglikelihood (echo, logprobs 1,
    max_tokens 1, a batch of token-id prompts), scored as lm-eval scores it: each choice's
    loglikelihood equals transformers' fp32 log-probability within 1e-4."""
    server = default_server
    tokenizer = server.app.state.serving.tokenizer
    requests = lm_eval_requests(tokenizer)
    body = {
        "model": server.app.state.serving.model_name,
        "prompt": [ids for ids, _ in requests],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = server.post("/v1/completions", body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(requests)
    scores = []
    for (ids, ctxlen), choice in zip(requests, choices, strict=True):
        got, greedy = parse_logprobs(choice, ctxlen)
        with torch.no_grad():
            logits = default_hf(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        targets = torch.tensor(ids[ctxlen:])
        rows = lp[ctxlen - 1 : len(ids) - 1]
        want = rows.gather(1, targets[:, None]).sum().item()
        assert got == pytest.approx(want, abs=1e-4)
        assert greedy == bool((rows.argmax(-1) == targets).all())
        scores.append(got)
    start = 0  # and the task's answers are what the model prefers (a sanity check of the task)
    right = 0
    for _, options, answer in TASK:
        picked = max(range(len(options)), key=lambda i: scores[start + i])
        right += picked == answer
        start += len(options)
    assert right >= len(TASK) - 1


def test_vllm_prompt_logprobs_field(default_server, default_hf):
    server = default_server
    serving = server.app.state.serving
    text = "The quick brown fox jumps over the lazy dog"
    ids = serving.tokenizer.encode(text, add_special_tokens=False)
    body = {"model": serving.model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    with torch.no_grad():
        lp = torch.log_softmax(default_hf(torch.tensor([ids])).logits[0].float(), -1)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        token = str(ids[i + 1])
        assert entry[token]["logprob"] == pytest.approx(lp[i, ids[i + 1]].item(), abs=1e-4)
        assert entry[token]["rank"] == int((lp[i] > lp[i, ids[i + 1]]).sum()) + 1
        for rank, t in enumerate(lp[i].topk(2).indices.tolist(), 1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["decoded_token"] == serving.piece(t)
    chat = {"model": serving.model_name, "messages": [{"role": "user", "content": text}],
            "max_tokens": 1, "prompt_logprobs": 0}  # fmt: skip
    out = server.post("/v1/chat/completions", chat).json()
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) > len(ids)
    plain = server.post("/v1/chat/completions", {**chat, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain  # only when asked


def test_streamed_echo_carries_the_prompt_logprobs(default_server):
    server = default_server
    serving = server.app.state.serving
    body = {"model": serving.model_name, "prompt": "Once upon a time", "max_tokens": 3,
            "temperature": 0, "echo": True, "logprobs": 1}  # fmt: skip
    whole = server.post("/v1/completions", body).json()["choices"][0]
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:  # fmt: skip
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events)
    values = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert text == whole["text"]
    assert values == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-6)
    assert values[0] is None and None not in values[1:]
