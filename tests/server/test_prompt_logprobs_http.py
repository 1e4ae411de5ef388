"""Prompt logprobs over HTTP, on the default model: `echo` with `logprobs` (OpenAI's legacy
completions; what lm-eval's `local-completions` sends for loglikelihood and multiple-choice
tasks), scored as lm-eval scores it and equal to transformers' fp32, and vLLM's
`prompt_logprobs`."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

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
            assert entry[str(t)]["decoded_token"] == serving.pieces(t)
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


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_scores_the_prompt_and_generates_nothing(default_server, stream):
    """OpenAI's legacy way to score a text (lm-eval's older clients, HELM): `max_tokens` 0 with
    `echo` and `logprobs` answers the prompt with its logprobs, and nothing after it."""
    server = default_server
    serving = server.app.state.serving
    body = {"model": serving.model_name, "prompt": "Once upon a time", "temperature": 0,
            "echo": True, "logprobs": 1}  # fmt: skip
    one = server.post("/v1/completions", {**body, "max_tokens": 1}).json()
    n_prompt = one["usage"]["prompt_tokens"]
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={**body, "max_tokens": 0, "stream": True,
                                "stream_options": {"include_usage": True}},
                          timeout=60) as r:  # fmt: skip
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        choices = [e["choices"][0] for e in events if e["choices"]]
        text = "".join(c["text"] for c in choices)
        values = [v for c in choices for v in c["logprobs"]["token_logprobs"]]
        usage, reason = events[-1]["usage"], choices[-1]["finish_reason"]
    else:
        zero = server.post("/v1/completions", {**body, "max_tokens": 0}).json()
        text = zero["choices"][0]["text"]
        values = zero["choices"][0]["logprobs"]["token_logprobs"]
        usage, reason = zero["usage"], zero["choices"][0]["finish_reason"]
    assert text == "Once upon a time" and reason == "length"
    assert values == pytest.approx(one["choices"][0]["logprobs"]["token_logprobs"][:n_prompt])
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == n_prompt
    plain = server.post("/v1/completions", {**body, "max_tokens": 0, "echo": False}).json()
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 0
