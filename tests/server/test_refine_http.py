"""The refine decoder over real HTTP: diffusion on a tiny random BERT, Jacobi/lookahead and
introspective (a random MASK-slot adapter, `--mask-adapter`) on the tiny causal target, through
the `openai` SDK against a live uvicorn server."""

from __future__ import annotations

import openai
import pytest

from stride.decoders.registry import DecodersConfig
from stride.engine.config import EngineConfig
from stride.server.app import ServerConfig
from tests.helpers.adapters import random_adapter
from tests.helpers.models import load_hf, make_diffusion_dir
from tests.helpers.servers import LiveServer

DIFFUSION = {"type": "refine", "method": "diffusion", "block_size": 4}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    bert = make_diffusion_dir(tmp_path_factory.mktemp("bert"))
    adapter = tmp_path_factory.mktemp("adapter")
    random_adapter(load_hf(tiny_dir)).save(adapter)
    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20),
        decoders=DecodersConfig(diffusion_model=str(bert), mask_adapter=str(adapter)),
    )
    live = LiveServer(config)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.app.state.serving.model_name


def complete(client, model, decoder, max_tokens=8, temperature=0.0, **extra):
    return client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=max_tokens,
        temperature=temperature,
        extra_body={"decoder": decoder, "ignore_eos": True, **extra},
    )


def test_diffusion_one_token_per_pass_at_threshold_one(client, model, server):
    out = complete(client, model, {**DIFFUSION, "threshold": 1.0}, logprobs=1)
    usage = out.usage.model_extra["decoder"]
    assert usage["decoder"] == "refine"
    assert usage["forward_passes"] == 8 and usage["tokens_per_pass"] == 1.0
    assert out.usage.completion_tokens == 8
    assert "<|mask|>" not in out.choices[0].text
    assert len(out.choices[0].logprobs.tokens) == 8
    server.wait_idle()


def test_diffusion_streams_and_seeded_runs_reproduce(client, model):
    spec = {**DIFFUSION, "threshold": 0.5}
    texts = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=10,
            temperature=0.9,
            seed=11,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"decoder": spec, "ignore_eos": True},
        )
        chunks = list(stream)
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        assert chunks[-1].usage.completion_tokens == 10
        assert chunks[-1].usage.model_extra["decoder"]["forward_passes"] <= 10
    assert texts[0] == texts[1] and "<|mask|>" not in texts[0]


def test_jacobi_and_lookahead_match_greedy(client, model):
    """Named by an object, by the method alone, or as metrics label it."""
    plain = complete(client, model, "ar", max_tokens=16).choices[0].text
    for method in ("jacobi", "lookahead"):
        for spec in ({"type": "refine", "method": method}, method, f"refine/{method}"):
            out = complete(client, model, spec, max_tokens=16)
            assert out.choices[0].text == plain
            usage = out.usage.model_extra["decoder"]
            assert usage["decoder"] == "refine" and usage["forward_passes"] <= 16


def test_introspective_matches_greedy_and_samples_reproducibly(client, model, server):
    assert "refine/introspective" in server.app.state.metrics.strategies  # a label from the start
    plain = complete(client, model, "ar", max_tokens=16).choices[0].text
    spec = {"type": "refine", "method": "introspective", "slots": 2}
    out = complete(client, model, spec, max_tokens=16)
    assert out.choices[0].text == plain
    usage = out.usage.model_extra["decoder"]
    assert usage["forward_passes"] <= 16 and usage["draft_tokens"] > 0
    sampled = [complete(client, model, spec, max_tokens=12, temperature=0.9, seed=5)
               for _ in range(2)]  # fmt: skip
    assert sampled[0].choices[0].text == sampled[1].choices[0].text


@pytest.mark.parametrize(
    "decoder, temperature, message",
    [
        ({"type": "refine", "method": "jacobi"}, 0.8, "greedy"),
        ({"type": "refine", "method": "lookahead", "window": 99}, 0.0, "window"),
        ({**DIFFUSION, "threshold": 2}, 0.0, "threshold"),
        ({"type": "refine", "method": "introspective", "slots": 0}, 0.0, "slots"),
        ("eagle", 0.0, "eagle"),  # a variant this server has no head for
        ("refine/eagle", 0.0, "unknown decoder 'refine/eagle'"),
    ],
)
def test_bad_refine_requests_are_400(client, model, decoder, temperature, message):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, model, decoder, temperature=temperature)
    assert message in e.value.message
