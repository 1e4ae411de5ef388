"""Pictures of a sweep (matplotlib, no display needed): latency against throughput, and a
Gantt timeline of the requests of one step."""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib
from PIL import Image

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def _series(steps: list[dict], metric: str, stat: str) -> tuple[list[float], list[float], list]:
    points = [
        (s["output_tokens_per_s"], s[metric][stat], s["concurrency"])
        for s in steps
        if s[metric][stat] is not None and s["requests"] > 0
    ]
    return [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]


def _label_points(ax, xs: list[float], ys: list[float], users: list) -> None:
    for x, y, c in zip(xs, ys, users, strict=True):
        ax.annotate(f"{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)


def plot_sweep(summary: dict, path: Path, title: str = "") -> Path:
    """One PNG: TTFT and ITL (p50 solid, p99 dashed) against output tokens/s, and the Pareto view
    (tokens/s per user against tokens/s in total); one colour per decoder, points labelled with
    their concurrency.
    """
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (decoder, steps) in enumerate(summary["decoders"].items()):
        color = colors[i % len(colors)]
        for ax, metric in zip(axes[:2], ("ttft_ms", "itl_ms"), strict=True):
            for stat, style in (("p50", "-"), ("p99", "--")):
                xs, ys, users = _series(steps, metric, stat)
                label = decoder if stat == "p50" else None  # line styles get their own key
                ax.plot(xs, ys, style, marker="o", ms=4, color=color, label=label)
                if stat == "p50":
                    _label_points(ax, xs, ys, users)
        points = [
            (s["output_tokens_per_s"], s["tokens_per_s_per_user"], s["concurrency"])
            for s in steps
            if s["tokens_per_s_per_user"] is not None
        ]
        xs, ys, users = ([p[k] for p in points] for k in range(3))
        axes[2].plot(xs, ys, "-", marker="o", ms=4, color=color, label=decoder)
        _label_points(axes[2], xs, ys, users)
    titles = (
        ("Time to first token", "TTFT (ms)"),
        ("Inter-token latency", "ITL (ms)"),
        ("Pareto: speed per user vs total", "output tokens/s per user"),
    )
    for ax in axes[:2]:
        ax.plot([], [], "-", color="gray", label="p50")
        ax.plot([], [], "--", color="gray", label="p99")
    for ax, (name, ylabel) in zip(axes, titles, strict=True):
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("output tokens/s (all users)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "Stride concurrency sweep", fontsize=12)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    # A palette of 128 colours keeps the file small enough to commit next to the docs.
    Image.open(buffer).convert("RGB").quantize(colors=128).save(path, optimize=True)
    return path


PHASES = (("queue", "#e8a33d"), ("prefill", "#4c72b0"), ("decode", "#55a868"))
GANTT_ROWS = 20  # requests drawn per decoder: enough to see batching, few enough to read


def phases(record: dict) -> list[tuple[str, float, float]] | None:
    """A request's phases on the wall clock: (name, start, end), from the moment the client sent
    it plus the server's own timings (queue, ttft, e2e; Stride's `usage.timings`)."""
    t = record.get("server_timings") or {}
    if not record.get("ok") or not {"queue", "ttft", "e2e"} <= set(t):
        return None
    sent = record["sent_at"]
    return [("queue", sent, sent + t["queue"]), ("prefill", sent + t["queue"], sent + t["ttft"]),
            ("decode", sent + t["ttft"], sent + t["e2e"])]  # fmt: skip


def chunk_arrivals(record: dict) -> list[float]:
    """When each streamed chunk reached the client (wall clock)."""
    if record.get("ttft") is None:
        return []
    times = [record["sent_at"] + record["ttft"]]
    for gap in record.get("chunk_gaps", []):
        times.append(times[-1] + gap)
    return times


def gantt_rows(records: list[dict], window: dict, rows: int = GANTT_ROWS) -> list[dict]:
    """The requests to draw for one step: `rows` consecutive ones begun in it, from a third of
    the way in (past the ramp, when every user is already busy)."""
    inside = sorted(
        (r for r in records if window["start"] <= r["sent_at"] < (window["end"] or math.inf)
         and phases(r) is not None),
        key=lambda r: r["sent_at"],
    )  # fmt: skip
    first = max(0, min(len(inside) // 3, len(inside) - rows))
    return inside[first : first + rows]


def plot_gantt(runs: dict[str, tuple[list[dict], dict]], path: Path, title: str = "") -> Path:
    """One PNG: per decoder, its requests of one sweep step over time, one row each, coloured by
    phase (queue, prefill, decode), with a tick where each streamed chunk arrived. Ticks in line
    across rows are requests served by the same engine steps; below, how many requests were
    decoding at once (the batch). `runs`: decoder -> (its raw request records, the step's
    window, as the Locust summary writes them)."""
    drawn = {d: gantt_rows(recs, window) for d, (recs, window) in runs.items()}
    drawn = {d: rows for d, rows in drawn.items() if rows}
    if not drawn:
        raise ValueError("no request with server timings to draw (is the server Stride?)")
    heights = [h for rows in drawn.values() for h in (max(len(rows), 4) * 0.28, 0.9)]
    fig, axes = plt.subplots(len(heights), 1, figsize=(13, sum(heights) + 1.2), dpi=100,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for i, (decoder, rows) in enumerate(drawn.items()):
        ax, batch_ax = axes[2 * i], axes[2 * i + 1]
        origin = rows[0]["sent_at"]
        last = max(max(phases(r)[-1][2], *chunk_arrivals(r)) for r in rows)
        end = last + 0.02 * (last - origin)
        for y, record in enumerate(rows):
            for (name, start, stop), (_, color) in zip(phases(record), PHASES, strict=True):
                ax.barh(y, stop - start, left=start - origin, height=0.7, color=color,
                        label=name if y == 0 else None)  # fmt: skip
            ticks = [t - origin for t in chunk_arrivals(record)]
            ax.plot(ticks, [y] * len(ticks), "|", color="black", ms=5, mew=0.7,
                    label="chunk streamed" if y == 0 else None)  # fmt: skip
        ax.set_ylim(len(rows) - 0.4, -0.6)
        ax.set_yticks(range(len(rows)), [f"#{k + 1}" for k in range(len(rows))], fontsize=6)
        ax.set_title(f"{decoder}: {len(rows)} consecutive requests", fontsize=10, loc="left")
        ax.legend(fontsize=7, loc="upper right", ncol=4)
        ax.set_xlim(0, end - origin)
        ax.grid(axis="x", alpha=0.3)
        # The batch: every request of the run decoding at each instant.
        everything = [p for p in (phases(r) for r in runs[decoder][0]) if p is not None]
        grid = [k * (end - origin) / 400 for k in range(401)]
        decoding = [sum(p[2][1] <= origin + t < p[2][2] for p in everything) for t in grid]
        batch_ax.step(grid, decoding, where="post", color=PHASES[2][1])
        batch_ax.set_xlim(0, end - origin)
        batch_ax.set_ylim(bottom=0)
        batch_ax.set_ylabel("decoding", fontsize=8)
        batch_ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since the first request drawn was sent")
    fig.suptitle(title or "Requests over time, by phase", fontsize=12)
    fig.tight_layout()
    return _save(fig, path)
