"""Concurrency sweep: one headless Locust run per decoder, then summary.json and a plot.

    python -m loadtest.sweep --host http://127.0.0.1:8000 --decoders ar,speculative,refine \\
        --concurrency 1,2,4,8,16 --hold 20 --max-tokens 128 --out results/

Each decoder gets its own run (same steps, prompts and seed), so curves compare like with like.
`gantt.png` draws the requests of one step (`--gantt-step`, by default the busiest) over time,
coloured by phase, from the per-request timings the server returns (Stride's `usage.timings`).
Progress is printed as steps start; Locust's full output goes to `OUT/locust-DECODER.log`.
Environment variables reach the Locust runs, e.g. STRIDE_LT_API_KEY for a server with --api-key.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from loadtest.stats import parse_steps

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
PROGRESS_TAG = "/stride.loadtest: "  # lines the locustfile logs, echoed while the run goes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--decoders", default="ar", help="comma-separated, one Locust run each")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="'1,2,4,8' or '1:64'")
    p.add_argument("--hold", type=float, default=20.0, help="seconds per concurrency step")
    p.add_argument("--max-tokens", default="128", help="'128', '16:256' or '32,128,512'")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    p.add_argument("--prompts", default="mixed", choices=("builtin", "synthetic", "mixed"))
    p.add_argument("--prompt-words", default="8:256", help="synthetic prompt length in words")
    p.add_argument("--endpoint", default="chat", choices=("chat", "completions"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="Locust processes (master + workers) when one core cannot keep up",
    )
    p.add_argument(
        "--stop-timeout",
        type=int,
        default=60,
        help="seconds in-flight requests get to finish after the last step",
    )
    p.add_argument("--title", default="", help="plot title")
    p.add_argument(
        "--gantt-step",
        type=int,
        default=None,
        help="the concurrency whose requests gantt.png draws (default: the highest)",
    )
    p.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    return p


def locust_command(args: argparse.Namespace, decoder: str, summary_path: Path) -> list[str]:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "--host", args.host, "--steps", args.concurrency, "--hold", str(args.hold),
        "--decoders", decoder, "--max-tokens", args.max_tokens, "--prompts", args.prompts,
        "--prompt-words", args.prompt_words, "--endpoint", args.endpoint,
        "--temperature", str(args.temperature), "--seed", str(args.seed),
        "--stop-timeout", str(args.stop_timeout), "--summary-out", str(summary_path),
    ]  # fmt: skip
    if args.ignore_eos:
        command.append("--ignore-eos")
    if args.processes > 1:
        command += ["--processes", str(args.processes)]
    return command


def run_decoder(args: argparse.Namespace, decoder: str, label: str) -> dict:
    """One headless Locust run; echoes its progress lines and returns what it wrote: its steps'
    windows (`steps`), per-step results (`decoders`) and raw request records (`requests`)."""
    summary_path = args.out / f"steps-{decoder}.json"
    summary_path.unlink(missing_ok=True)
    log_path = args.out / f"locust-{decoder}.log"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            locust_command(args, decoder, summary_path),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if PROGRESS_TAG in line:
                message = line.split(PROGRESS_TAG, 1)[1].rstrip()
                print(f"{label} {time.monotonic() - started:6.1f}s  {message}", flush=True)
        code = process.wait()
    if not summary_path.exists():
        raise RuntimeError(f"locust exited with {code} and no results; see {log_path}")
    result = json.loads(summary_path.read_text())
    if not result["decoders"].get(decoder):
        raise RuntimeError(f"no request finished for decoder {decoder!r}; see {log_path}")
    return result


def print_table(summary: dict) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    print(f"{'decoder':<12}{'users':>6}{'reqs':>6}{'fail':>5}{'tok/s':>9}{'tok/s/u':>9}"
          f"{'TTFT p50':>10}{'p99':>7}{'ITL p50':>9}{'p99':>7}  (ms)")  # fmt: skip
    for decoder, steps in summary["decoders"].items():
        for s in steps:
            per_user = s["tokens_per_s_per_user"]
            print(
                f"{decoder:<12}{s['concurrency']:>6}{s['requests']:>6}{s['failures']:>5}"
                f"{s['output_tokens_per_s']:>9.1f}{per_user or 0:>9.1f}"
                f"{ms(s['ttft_ms']['p50']):>10}{ms(s['ttft_ms']['p99']):>7}"
                f"{ms(s['itl_ms']['p50']):>9}{ms(s['itl_ms']['p99']):>7}"
            )


def draw_gantt(args: argparse.Namespace, runs: dict[str, dict], steps: list[int]) -> Path | None:
    """gantt.png: the requests of the `--gantt-step` concurrency step of every decoder's run."""
    from loadtest.plots import plot_gantt

    users = args.gantt_step if args.gantt_step is not None else max(steps)
    picked = {}
    for decoder, run in runs.items():
        window = next((w for w in run["steps"] if w["users"] == users), None)
        if window is not None:
            picked[decoder] = (run.get("requests", []), window)
    title = f"{users} concurrent users, {args.endpoint} endpoint, max_tokens {args.max_tokens}"
    try:
        return plot_gantt(picked, args.out / "gantt.png", title)
    except ValueError as error:  # e.g. a server that returns no per-request timings
        print(f"no gantt.png: {error}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    if not decoders or any(":" in d for d in decoders):
        build_parser().error("--decoders takes plain names (one run each), e.g. ar,speculative")
    steps = parse_steps(args.concurrency)
    args.out.mkdir(parents=True, exist_ok=True)
    minutes = len(decoders) * len(steps) * args.hold / 60
    print(f"sweep: {len(decoders)} decoder(s) x {len(steps)} steps x {args.hold:g} s "
          f"= about {minutes:.1f} min of load against {args.host}", flush=True)  # fmt: skip
    summary = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "loadtest.sweep", *(argv or sys.argv[1:])]),
        "host": args.host,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "host")},
        "decoders": {},
    }
    failed: list[str] = []
    runs: dict[str, dict] = {}
    for i, decoder in enumerate(decoders):
        try:
            runs[decoder] = run_decoder(args, decoder, f"[{decoder} {i + 1}/{len(decoders)}]")
            summary["decoders"][decoder] = runs[decoder]["decoders"][decoder]
        except RuntimeError as error:
            print(f"[{decoder}] failed: {error}", file=sys.stderr, flush=True)
            failed.append(decoder)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if summary["decoders"]:
        from loadtest.plots import plot_sweep  # matplotlib only when there is something to draw

        title = args.title or (
            f"max_tokens {args.max_tokens}, {args.hold:g} s per step, {args.endpoint} endpoint"
            " (points labelled with concurrency)"
        )
        plot = plot_sweep(summary, args.out / "sweep.png", title)
        print_table(summary)
        print(f"wrote {args.out / 'summary.json'} and {plot}")
        gantt = draw_gantt(args, runs, steps)
        if gantt is not None:
            print(f"wrote {gantt}")
    failures = sum(s["failures"] for steps in summary["decoders"].values() for s in steps)
    return 1 if failed or failures else 0


if __name__ == "__main__":
    sys.exit(main())
