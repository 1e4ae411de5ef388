"""Load-test tooling: SSE timing and step summaries in isolation, then a real sweep on loopback."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.prompts import IntDistribution, PromptSource, parse_decoder_mix
from loadtest.stats import RequestRecord, StepWindow, parse_steps, percentile, summarize
from loadtest.stream import StreamError, sse_data, time_stream
from stride.decoders.registry import DECODERS
from tests.helpers.png import PNG_SIGNATURE

ROOT = Path(__file__).resolve().parents[2]


def _chunk(text: str | None = None, chat: bool = False, **extra) -> str:
    choices = []
    if text is not None:
        choices = [{"delta": {"content": text}} if chat else {"text": text}]
    return "data: " + json.dumps({"choices": choices, **extra}) + "\n\n"


def _lines(*events: str) -> list[bytes]:
    return [line.encode() for event in events for line in event.split("\n")][:-1]


class FakeClock:
    def __init__(self, times: list[float]):
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


@pytest.mark.parametrize("chat", [False, True])
def test_time_stream_measures_first_text_gaps_and_usage(chat):
    role_only = 'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    events = [role_only] if chat else []
    events += [_chunk("Hel", chat), _chunk("", chat), _chunk("lo", chat), _chunk("!", chat)]
    events += [_chunk(usage={"completion_tokens": 5}), "data: [DONE]\n\n"]
    clock = FakeClock(([1.1] if chat else []) + [1.2, 1.3, 1.5, 1.9, 2.0, 2.1])  # one per event
    timing = time_stream(_lines(*events), sent_at=1.0, clock=clock)
    assert timing.ttft == pytest.approx(0.2)
    assert timing.chunk_gaps == pytest.approx([0.3, 0.4])  # the empty chunk is not a token
    assert timing.e2e == pytest.approx(1.1)
    assert timing.output_tokens == 5  # usage wins over the three text chunks
    assert timing.tpot == pytest.approx((1.1 - 0.2) / 4)


def test_time_stream_raises_on_error_event_and_on_truncation():
    error = 'data: {"error": {"message": "engine died", "code": "engine_dead"}}\n\n'
    with pytest.raises(StreamError, match="engine died"):
        time_stream(_lines(_chunk("a"), error), sent_at=0.0)
    with pytest.raises(StreamError, match="without \\[DONE\\]"):
        time_stream(_lines(_chunk("a"), _chunk("b")), sent_at=0.0)


def test_sse_data_joins_multiline_events_and_ignores_comments():
    lines = [": keep-alive", "data: a", "data:b", "", "event: x", "data:  c", ""]
    assert list(sse_data(lines)) == ["a\nb", " c"]


def test_summary_splits_tokens_by_arrival_and_latencies_by_start_step():
    windows = [StepWindow(0, users=1, start=100.0, end=110.0), StepWindow(1, 2, 110.0, 120.0)]
    # 4 chunks at 108, 109, 110, 111 carrying 8 tokens: half arrive in each step.
    straddler = RequestRecord("ar", step=0, ok=True, sent_at=107.0, e2e=4.0, ttft=1.0,
                              chunk_gaps=[1.0, 1.0, 1.0], output_tokens=8, tpot=3 / 7)  # fmt: skip
    inside = RequestRecord("ar", step=1, ok=True, sent_at=112.0, e2e=2.0, ttft=0.5,
                           chunk_gaps=[0.5], output_tokens=4, tpot=0.5)  # fmt: skip
    failed = RequestRecord("ar", step=1, ok=False, sent_at=113.0, e2e=0.1, error="HTTP 500")
    first, second = summarize([straddler, inside, failed], windows)["ar"]
    assert first["output_tokens_per_s"] == pytest.approx(4 / 10)
    assert second["output_tokens_per_s"] == pytest.approx((4 + 4) / 10)
    assert (first["requests"], second["requests"], second["failures"]) == (1, 1, 1)
    assert second["errors"] == ["HTTP 500"]
    assert first["ttft_ms"]["p50"] == pytest.approx(1000)
    assert second["itl_ms"]["count"] == 1 and second["itl_ms"]["p99"] == pytest.approx(500)
    assert second["tokens_per_s_per_user"] == pytest.approx(4 / 2.0)


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_workload_options_parse():
    rng = random.Random(0)
    assert IntDistribution.parse("32").sample(rng) == 32
    assert {IntDistribution.parse("4,8").sample(rng) for _ in range(50)} == {4, 8}
    assert all(2 <= IntDistribution.parse("2:5").sample(rng) <= 5 for _ in range(50))
    with pytest.raises(ValueError):
        IntDistribution.parse("0:5")
    assert parse_decoder_mix("ar:2,speculative") == ["ar", "ar", "speculative"]
    assert parse_steps("1,2,4") == [1, 2, 4] and parse_steps("1:16") == [1, 2, 4, 8, 16]
    lengths = {len(PromptSource("synthetic", "3:6").sample(rng).split()) for _ in range(50)}
    assert lengths <= {3, 4, 5, 6} and len(lengths) > 1


def test_sweep_against_real_server(tiny_server, tmp_path):
    decoders = ["ar"] + [name for name in DECODERS if name != "ar"][:1]
    out = tmp_path / "results"
    command = [sys.executable, "-m", "loadtest.sweep", "--host", tiny_server,
               "--decoders", ",".join(decoders), "--concurrency", "1,2", "--hold", "3",
               "--max-tokens", "6", "--ignore-eos", "--stop-timeout", "20",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 2/2: 2 concurrent users" in done.stdout  # progress is shown while it runs

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["decoders"]) == decoders
    for decoder in decoders:
        steps = summary["decoders"][decoder]
        assert [s["concurrency"] for s in steps] == [1, 2]
        for step in steps:
            assert step["failures"] == 0 and step["requests"] > 0, (decoder, step)
            assert step["output_tokens_per_s"] > 0 and step["tokens_per_s_per_user"] > 0
            for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
                assert step[metric]["count"] > 0 and step[metric]["p50"] > 0, (metric, step)
                assert step[metric]["p99"] >= step[metric]["p50"]

    plot = out / "sweep.png"
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image

    pixels = matplotlib.image.imread(plot)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 600
