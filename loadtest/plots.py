"""Latency-vs-throughput plots of a sweep summary (matplotlib, no display needed)."""

from __future__ import annotations

import io
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
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    # A palette of 128 colours keeps the file small enough to commit next to the docs.
    Image.open(buffer).convert("RGB").quantize(colors=128).save(path, optimize=True)
    return path
