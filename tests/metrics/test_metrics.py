"""Metrics add up: what the counters say equals what the engine returned, per decoder and user."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from stride.engine.sequence import SamplingParams
from stride.metrics.buckets import STEP_BUCKETS
from stride.metrics.edge import MetricsMiddleware
from stride.metrics.labels import parse_users, strategy
from stride.metrics.registry import Metrics
from stride.scheduler.client import EngineClient
from stride.scheduler.outputs import EngineError, GenerateRequest, RequestOutput
from stride.server.cli import build_parser, server_config
from tests.helpers.cores import make_core
from tests.helpers.metrics import value

USERS = [None, "alice", "bob", "mallory"]  # mallory is not on the allowlist


def label_values(m: Metrics, name: str, label: str) -> set[str]:
    """The values of `label` in use: series above 0 (the known ones exist, at 0, from the start)."""
    return {
        s.labels[label]
        for family in m.registry.collect()
        for s in family.samples
        if s.name == name and label in s.labels and s.value > 0
    }


def options_for(decoder: str) -> dict:
    # Speculative decoding adapts K and may stop drafting on a random model; make it draft.
    return {"adaptive": False, "draft": "early_exit"} if decoder == "speculative" else {}


async def run_all(client: EngineClient, metrics: Metrics, requests: list[GenerateRequest]):
    async def one(req: GenerateRequest) -> list[RequestOutput]:
        outs = []
        with metrics.track(req.decoder, req.user, req.decoder_options) as tracker:
            async for _, out in client.generate(req):
                tracker.observe(out)
                outs.append(out)
        return outs

    return await asyncio.gather(*(one(r) for r in requests))


def test_user_label_allowlist(monkeypatch):
    m = Metrics("m", "alice, bob,")
    assert [m.user_label(u) for u in (None, "", "alice", "bob", "mallory")] == [
        "none", "none", "alice", "bob", "other",
    ]  # fmt: skip
    monkeypatch.setenv("STRIDE_METRICS_USERS", "carol")
    assert parse_users(None) == {"carol"}
    assert Metrics("m").user_label("carol") == "carol"


def test_counters_equal_what_clients_received(tiny_dir):
    core = make_core(tiny_dir)
    metrics = Metrics("tiny", ["alice", "bob"])
    client = EngineClient(core)
    client.on_step = metrics.on_step
    decoders = list(core.decoders)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [
        GenerateRequest(
            f"r{i}",
            [5 + i, 17, 42, 99, 5 + i, 17, 42],
            params,
            decoder=decoders[i % len(decoders)],
            decoder_options=options_for(decoders[i % len(decoders)]),
            user=USERS[i % len(USERS)],
        )
        for i in range(3 * len(decoders) * len(USERS) // 2 + 2)
    ]
    try:
        results = asyncio.run(run_all(client, metrics, requests))
    finally:
        client.shutdown()

    for outs in results:
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in outs) == outs[-1].num_output_tokens
    sent = sum(len(o.token_ids) for outs in results for o in outs)
    assert value(metrics, "stride_generation_tokens_total") == sent
    assert value(metrics, "stride_prompt_tokens_total") == sum(len(r.prompt_ids) for r in requests)
    labels = {strategy(r.decoder, r.decoder_options) for r in requests}
    assert label_values(metrics, "stride_generation_tokens_total", "decoder") == labels
    for name in labels:
        for user in ("none", "alice", "bob", "other"):
            got = value(metrics, "stride_generation_tokens_total", decoder=name, user=user)
            want = sum(
                len(o.token_ids)
                for req, outs in zip(requests, results, strict=True)
                if strategy(req.decoder, req.decoder_options) == name
                and metrics.user_label(req.user) == user
                for o in outs
            )
            assert got == want, (name, user)
    assert label_values(metrics, "stride_generation_tokens_total", "user") == {
        "none", "alice", "bob", "other",
    }  # fmt: skip
    n = len(requests)
    assert value(metrics, "stride_requests_finished_total", finish_reason="length") == n
    per_request = (
        "time_to_first_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
        "time_per_output_token",
    )
    for hist in per_request:
        assert value(metrics, f"stride_{hist}_seconds_count") == n, hist
    after_first = sum(sum(len(o.token_ids) for o in outs) - len(outs[0].token_ids)
                      for outs in results)  # fmt: skip
    assert value(metrics, "stride_inter_token_latency_seconds_count") == after_first

    # The decoders' per-request summaries, summed, are what the counters hold.
    stats = [outs[-1].decoder_stats for outs in results]
    assert value(metrics, "stride_decoder_forward_passes_total") == sum(
        s["forward_passes"] for s in stats
    )
    spec = [s for s in stats if s.get("draft_tokens")]
    assert value(metrics, "stride_spec_draft_tokens_total") == sum(s["draft_tokens"] for s in spec)
    assert value(metrics, "stride_spec_accepted_tokens_total") == sum(
        s["accepted_tokens"] for s in spec
    )
    assert value(metrics, "stride_spec_drafts_total") == sum(s["drafts"] for s in spec)
    positions = max((len(s["accepted_per_position"]) for s in spec), default=0)
    for pos in range(positions):
        want = sum(s["accepted_per_position"][pos] for s in spec
                   if pos < len(s["accepted_per_position"]))  # fmt: skip
        got = value(metrics, "stride_spec_accepted_tokens_by_position_total", position=str(pos))
        assert got == want
    if "speculative" in decoders:
        assert spec, "speculative requests should report drafts"

    # The engine is idle again: gauges say so, and every step was timed.
    assert value(metrics, "stride_requests_running") == 0
    assert value(metrics, "stride_requests_waiting") == 0
    assert value(metrics, "stride_kv_cache_usage_ratio") == 0
    assert value(metrics, "stride_engine_step_duration_seconds_count") > 0
    assert value(metrics, "stride_engine_step_tokens_sum") >= sent


def test_preemptions_and_deadlines(tiny_dir):
    # 7 usable blocks of 16 tokens: four requests of 50 tokens cannot all stay resident.
    core = make_core(tiny_dir, kv_bytes=8 * 8192)
    metrics = Metrics("tiny")
    client = EngineClient(core)
    client.on_step = metrics.on_step
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest(f"p{i}", [3 + i] * 10, params) for i in range(4)]
    late = GenerateRequest("late", [7] * 10, params, timeout=1e-6)
    try:
        results = asyncio.run(run_all(client, metrics, [*requests, late]))
    finally:
        client.shutdown()
    assert core.scheduler.num_preemptions > 0
    assert value(metrics, "stride_preemptions_total") == core.scheduler.num_preemptions
    assert results[-1][-1].error.code == "deadline_exceeded"
    assert value(metrics, "stride_requests_finished_total", finish_reason="deadline") == 1
    assert value(metrics, "stride_requests_rejected_total", reason="deadline") == 1
    assert value(metrics, "stride_generation_tokens_total") == 4 * 40


def test_tracker_counts_an_unfinished_stream_as_aborted():
    metrics = Metrics("m", ["alice"])
    with metrics.track("ar", "alice") as tracker:
        tracker.observe(RequestOutput("a", token_ids=[1, 2], num_prompt_tokens=3))
        tracker.observe(RequestOutput("a", token_ids=[3]))
    assert value(metrics, "stride_requests_finished_total", finish_reason="abort") == 1
    assert value(metrics, "stride_generation_tokens_total", user="alice") == 3
    assert value(metrics, "stride_prompt_tokens_total") == 3
    # a burst of 2 tokens after the first output counts 2 gaps
    with metrics.track("ar", None) as tracker:
        tracker.observe(RequestOutput("b", token_ids=[1]))
        tracker.observe(RequestOutput("b", token_ids=[2, 3], finish_reason="length"))
        tracker.observe(RequestOutput("b", error=EngineError("x", "late duplicate")))
    assert value(metrics, "stride_inter_token_latency_seconds_count", user="none") == 2
    assert value(metrics, "stride_requests_finished_total", user="none") == 1


def test_rejections_by_reason():
    metrics = Metrics("m")
    for reason in ("queue_full", "auth", "validation", "validation"):
        metrics.rejected(reason)
    assert value(metrics, "stride_requests_rejected_total", reason="validation") == 2
    assert value(metrics, "stride_requests_rejected_total") == 4
    with pytest.raises(ValueError):
        metrics.rejected("bored")


def test_names_follow_prometheus_conventions():
    metrics = Metrics("m")
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    families = re.findall(r"^# TYPE (\S+) (\S+)$", body.decode(), re.M)
    ours = [(name, kind) for name, kind in families if not name.startswith("process_")]
    assert ours, "no stride metrics exposed"
    for name, kind in ours:
        assert name.startswith("stride_"), name
        assert kind != "counter" or name.endswith("_total"), name
        if kind == "histogram" and ("time" in name or "latency" in name or "duration" in name):
            assert name.endswith("_seconds"), name
    # Series that must exist before anything happens, so rates read 0 rather than no data.
    always = (
        "stride_requests_received_total",
        "stride_preemptions_total",
        "stride_kv_cache_usage_ratio",
        "stride_engine_step_duration_seconds_count",
    )
    for name in always:
        assert f'{name}{{model="m"' in body.decode(), name
    for reason in ("queue_full", "deadline", "auth", "validation"):
        assert value(metrics, "stride_requests_rejected_total", reason=reason) == 0


def test_step_buckets_resolve_sub_10ms():
    assert sum(b < 0.01 for b in STEP_BUCKETS) >= 6


def test_middleware_counts_refusals_but_not_failures_of_admitted_requests():
    metrics = Metrics("m")

    def app_answering(status: int, admitted: bool):
        async def app(scope, receive, send):
            if admitted:
                tracker = metrics.track("ar", None)
                tracker.observe(RequestOutput("r", token_ids=[1], num_prompt_tokens=2))
                tracker.observe(RequestOutput("r", error=EngineError("engine_dead", "gone")))
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        return app

    async def call(app, path="/v1/completions"):
        sent = []

        async def send(message):
            sent.append(message)

        await MetricsMiddleware(app, lambda: metrics)({"type": "http", "path": path}, None, send)
        return sent[0]["status"]

    for status, admitted in [(429, False), (401, False), (503, False), (503, True), (200, True)]:
        assert asyncio.run(call(app_answering(status, admitted))) == status
    asyncio.run(call(app_answering(401, False), "/v1/models"))  # not a generation route
    assert value(metrics, "stride_requests_received_total") == 5
    assert value(metrics, "stride_requests_rejected_total", reason="queue_full") == 1
    assert value(metrics, "stride_requests_rejected_total", reason="auth") == 1
    assert value(metrics, "stride_requests_rejected_total", reason="unavailable") == 1
    assert value(metrics, "stride_requests_finished_total", finish_reason="error") == 2


def test_metrics_users_flag_and_environment(monkeypatch):
    args = build_parser().parse_args(["serve", "--metrics-users", "alice,bob"])
    assert Metrics("m", server_config(args).metrics_users).users == {"alice", "bob"}
    monkeypatch.setenv("STRIDE_METRICS_USERS", "carol")
    args = build_parser().parse_args(["serve"])
    assert Metrics("m", server_config(args).metrics_users).users == {"carol"}


def test_strategy_labels_tell_variants_apart_and_stay_bounded():
    cases = [
        ("ar", {}, False, "ar"),
        ("speculative", {}, False, "speculative/ngram"),
        ("speculative", {}, True, "speculative/draft_model"),
        ("speculative", {"draft": "ngram", "ngram_max": 2}, True, "speculative/ngram"),
        ("speculative", {"draft": "early_exit", "exit_layer": 1}, False, "speculative/early_exit"),
        ("speculative", {"draft": "/models/some-draft-135m"}, True, "speculative/draft_model"),
        ("refine", {}, False, "refine/jacobi"),
        ("refine", {"method": "lookahead", "window": 4}, False, "refine/lookahead"),
        ("refine", {"method": "diffusion"}, False, "refine/diffusion"),
        ("refine", {"method": "x" * 100}, False, "refine/other"),
    ]
    for decoder, options, draft_model, want in cases:
        assert strategy(decoder, options, draft_model) == want, (decoder, options)
    # the server's draft model decides the default draft of the label, as it does the drafter's
    metrics = Metrics("m", draft_model=True)
    metrics.track("speculative", None, {}).observe(RequestOutput("a", token_ids=[1]))
    assert label_values(metrics, "stride_generation_tokens_total", "decoder") == {
        "speculative/draft_model"
    }


def test_engine_gauges_are_one_series_per_model_present_at_zero_from_the_start(tiny_dir):
    metrics = Metrics("tiny")
    body = metrics.render()[0].decode()
    for name in ("requests_running", "requests_waiting", "kv_cache_usage_ratio", "batch_size"):
        assert f'stride_{name}{{model="tiny"}} 0.0' in body, name
    core = make_core(tiny_dir)
    client = EngineClient(core)
    seen: list[tuple[float, float]] = []

    def on_step(stats, seconds, outputs):
        metrics.on_step(stats, seconds, outputs)
        seen.append((value(metrics, "stride_requests_running"), stats.num_running))

    client.on_step = on_step
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    requests = [
        GenerateRequest(f"r{i}", [5, 6, 7], params, decoder=d, decoder_options=options_for(d))
        for i, d in enumerate(core.decoders)
    ]
    try:
        asyncio.run(run_all(client, metrics, requests))
    finally:
        client.shutdown()
    assert seen and all(got == want for got, want in seen)
    assert max(got for got, _ in seen) > 0
    for name in ("stride_requests_running", "stride_requests_waiting"):
        families = [f for f in metrics.registry.collect() if f.name == name]
        assert [s.labels for s in families[0].samples] == [{"model": "tiny"}], name


def test_http_metrics_exist_while_loading_and_label_requests_by_strategy(tiny_dir, monkeypatch):
    import httpx

    import stride.server.app as app_module
    from stride.engine.config import EngineConfig
    from stride.server.app import ServerConfig
    from tests.helpers.servers import LiveServer

    gate = threading.Event()
    build = app_module.build_client
    monkeypatch.setattr(app_module, "build_client", lambda cfg: (gate.wait(30), build(cfg))[1])
    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_dir), served_name="tiny", device="cpu",
                            kv_cache_memory=4 << 20)
    )  # fmt: skip
    live = LiveServer(config, wait=False)
    try:
        live.wait_listening()
        body = httpx.get(f"{live.url}/metrics", timeout=5).text
        for name in ("requests_running", "requests_waiting", "kv_cache_usage_ratio", "batch_size"):
            assert f'stride_{name}{{model="tiny"}} 0.0' in body, name
        gate.set()
        live.wait_ready()
        decoders = [{"type": "refine", "method": "lookahead"}, {"type": "speculative"}, "ar"]
        for decoder in decoders:
            reply = live.post(
                "/v1/completions",
                {"prompt": "ab", "max_tokens": 3, "temperature": 0, "decoder": decoder},
            )
            assert reply.status_code == 200, reply.text
        body = httpx.get(f"{live.url}/metrics", timeout=5).text
        used = r'stride_generation_tokens_total\{[^}]*decoder="([^"]+)"[^}]*\} [1-9]'
        assert set(re.findall(used, body)) == {"refine/lookahead", "speculative/ngram", "ar"}
    finally:
        gate.set()
        live.stop()


def test_stats_line_while_busy_silence_while_idle(caplog):
    """`log_stats`: a vLLM-style line per interval with tokens moving or sequences in the engine,
    none while idle (the interval shortened for the test)."""
    from stride.scheduler.outputs import StepStats

    metrics = Metrics("m")

    async def run() -> tuple[list[str], list[str]]:
        task = asyncio.create_task(metrics.log_stats(interval=0.05))
        await asyncio.sleep(0.2)
        idle = [r.getMessage() for r in caplog.records if r.name == "stride.stats"]
        metrics.on_step(StepStats(1, 2, 0.25, 1, 3, 0), 0.01, [])
        tracker = metrics.track("ar", None)
        tracker.observe(RequestOutput("a", token_ids=[1, 2, 3], num_prompt_tokens=5))
        await asyncio.sleep(0.2)
        task.cancel()
        return idle, [r.getMessage() for r in caplog.records if r.name == "stride.stats"]

    with caplog.at_level("INFO", logger="stride.stats"):
        idle, busy = asyncio.run(run())
    assert idle == []
    assert busy and all("running 1, waiting 2, KV cache 25.0%" in line for line in busy)
    assert re.search(r"prompt [1-9][\d.]* tokens/s, generation [1-9][\d.]* tokens/s", busy[0])


def test_access_line_per_request(tiny_dir, caplog):
    """One `stride.access` line per request at info: method, path, status, decoder, tokens and
    latency; probes only at debug."""
    from stride.engine.config import EngineConfig
    from stride.server.app import ServerConfig
    from tests.helpers.servers import LiveServer

    engine = EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=4 << 20)
    with caplog.at_level("INFO", logger="stride.access"):
        live = LiveServer(ServerConfig(engine=engine))
        try:
            body = {"prompt": "ab", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                    "decoder": {"type": "refine", "method": "lookahead"}}  # fmt: skip
            ok = live.post("/v1/completions", body)
            bad = live.post("/v1/completions", {"prompt": "ab", "max_tokens": -1})
        finally:
            live.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "stride.access"]
    assert ok.status_code == 200 and bad.status_code == 400
    prompt = ok.json()["usage"]["prompt_tokens"]
    assert re.fullmatch(
        rf'127\.0\.0\.1 "POST /v1/completions" 200 decoder=refine/lookahead '
        rf"prompt_tokens={prompt} completion_tokens=3 \d+\.\d{{3}}s",
        lines[-2],
    ), lines
    assert re.fullmatch(r'127\.0\.0\.1 "POST /v1/completions" 400 \d+\.\d{3}s', lines[-1])
    assert not any("/health" in line for line in lines)
