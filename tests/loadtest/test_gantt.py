"""The sweep's Gantt picture: requests of one step over time, by phase, from the server's timings.

First the picture's pieces on records whose times are known, then a real sweep against a server
on loopback: its raw records carry Stride's per-request timings and `gantt.png` is drawn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.plots import chunk_arrivals, gantt_rows, phases, plot_gantt
from tests.helpers.png import PNG_SIGNATURE

ROOT = Path(__file__).resolve().parents[2]


def record(sent: float, queue: float, ttft: float, e2e: float, ok: bool = True) -> dict:
    return {"ok": ok, "sent_at": sent, "ttft": ttft + 0.001, "chunk_gaps": [0.01, 0.02],
            "server_timings": {"queue": queue, "ttft": ttft, "e2e": e2e}}  # fmt: skip


def test_phases_are_the_servers_timings_from_when_the_request_was_sent():
    assert phases(record(100.0, 0.5, 0.75, 2.0)) == [
        ("queue", 100.0, 100.5), ("prefill", 100.5, 100.75), ("decode", 100.75, 102.0)
    ]  # fmt: skip
    assert phases(record(100.0, 0.5, 0.75, 2.0, ok=False)) is None
    assert phases({"ok": True, "sent_at": 1.0, "server_timings": None}) is None  # not Stride
    assert chunk_arrivals(record(100.0, 0.5, 0.75, 2.0)) == pytest.approx([100.751, 100.761,
                                                                           100.781])  # fmt: skip


def test_gantt_rows_are_consecutive_requests_of_the_step_past_its_ramp():
    records = [record(10.0 + i, 0.0, 0.1, 0.5) for i in range(60)]
    window = {"start": 20.0, "end": 50.0}
    rows = gantt_rows(records, window, rows=8)
    assert [r["sent_at"] for r in rows] == [30.0 + i for i in range(8)]
    assert gantt_rows(records, window, rows=100)[0]["sent_at"] == 20.0  # all of the step


def test_plot_gantt_writes_a_png_and_refuses_nothing_to_draw(tmp_path):
    records = [record(10.0 + 0.2 * i, 0.05 * (i % 3), 0.3, 1.5) for i in range(30)]
    runs = {"ar": (records, {"start": 10.0, "end": 16.0}),
            "speculative": (records, {"start": 10.0, "end": 16.0})}  # fmt: skip
    path = plot_gantt(runs, tmp_path / "gantt.png", "two decoders")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="no request with server timings"):
        plot_gantt({"ar": ([{"ok": True, "sent_at": 11.0}], {"start": 10.0, "end": 16.0})},
                   tmp_path / "none.png")  # fmt: skip


def test_sweep_draws_the_gantt_of_a_step_from_stride_timings(tiny_server, tmp_path):  # noqa: F811
    out = tmp_path / "results"
    command = [sys.executable, "-m", "loadtest.sweep", "--host", tiny_server,
               "--decoders", "ar", "--concurrency", "1,3", "--hold", "3", "--max-tokens", "6",
               "--ignore-eos", "--stop-timeout", "20", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote {out / 'gantt.png'}" in done.stdout
    assert (out / "gantt.png").read_bytes()[:8] == PNG_SIGNATURE
    raw = json.loads((out / "steps-ar.json").read_text())
    served = [r for r in raw["requests"] if r["ok"]]
    assert served and len(served) == sum(s["requests"] for s in raw["decoders"]["ar"])
    for r in served:
        t = r["server_timings"]
        assert 0 <= t["queue"] <= t["ttft"] <= t["e2e"] <= r["e2e"]
    (busy,) = [w for w in raw["steps"] if w["users"] == 3]
    assert gantt_rows(served, busy)  # the step the picture draws has requests
