"""The Stride Grafana dashboard as code: `python deploy/grafana/dashboard.py` rewrites the JSON.

Grafana provisions `dashboards/stride.json`; this script is its source, and a test checks that
the two agree and that every query here returns data from a real Prometheus scraping Stride.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "dashboards" / "stride.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model=~"$model",decoder=~"$decoder",user=~"$user"'
MODEL = 'model=~"$model"'
RI = "$__rate_interval"


def rate(metric: str, sel: str = SEL) -> str:
    return f"rate({metric}{{{sel}}}[{RI}])"


def quantile(q: float, hist: str, by: str = "", sel: str = SEL) -> str:
    keys = ", ".join(["le", *filter(None, [by])])
    return f"histogram_quantile({q}, sum by ({keys}) ({rate(hist + '_bucket', sel)}))"


def quantiles(hist: str, sel: str = SEL, label: str = "") -> list[tuple[str, str]]:
    return [(quantile(q, hist, sel=sel), f"{label}p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


class Layout:
    """Places panels left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self.y += 8 if self.x else 0
        self.x = 0
        self.panels.append(self._panel("row", title, {"h": 1, "w": 24}, collapsed=False))
        self.y += 1

    def add(
        self,
        title: str,
        targets: list[tuple[str, str]],
        unit: str = "short",
        w: int = 8,
        description: str = "",
        right_axis: str | None = None,
        right_unit: str = "short",
        exemplars: bool = False,
    ) -> None:
        """A time series panel; `exemplars`: show the latency histograms' exemplars, each a
        link to its request's trace."""
        self._place(w)
        overrides = []
        if right_axis:
            overrides.append(
                {
                    "matcher": {"id": "byName", "options": right_axis},
                    "properties": [
                        {"id": "custom.axisPlacement", "value": "right"},
                        {"id": "unit", "value": right_unit},
                    ],
                }
            )
        panel = self._panel(
            "timeseries",
            title,
            {"h": 8, "w": w},
            description=description,
            datasource=DS,
            fieldConfig={"defaults": {"unit": unit, "min": 0}, "overrides": overrides},
            options={"legend": {"displayMode": "list", "placement": "bottom"},
                     "tooltip": {"mode": "multi"}},
            targets=_targets(targets, exemplars),
        )  # fmt: skip
        self.panels.append(panel)
        self.x += w

    def stat(
        self,
        title: str,
        targets: list[tuple[str, str]],
        unit: str,
        w: int = 8,
        description: str = "",
    ) -> None:
        """One figure per series (e.g. per decoder), its latest value."""
        self._place(w)
        self.panels.append(self._panel(
            "stat", title, {"h": 8, "w": w}, description=description, datasource=DS,
            fieldConfig={"defaults": {"unit": unit, "min": 0, "decimals": 1}, "overrides": []},
            options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "value", "graphMode": "area", "textMode": "value_and_name"},
            targets=_targets(targets),
        ))  # fmt: skip
        self.x += w

    def xy(
        self,
        title: str,
        targets: list[tuple[str, str]],
        x: str,
        ys: dict[str, str],
        x_unit: str,
        y_unit: str,
        w: int = 8,
        description: str = "",
    ) -> None:
        """An XY chart of one frame, the targets joined on time: field `x` across, each of
        `ys` (field: how it is drawn, points or lines) up; both axes logarithmic."""
        self._place(w)
        log_scale = {"type": "log", "log": 10}
        series = [
            {
                "frame": 0,
                "x": x,
                "y": y,
                "name": y,
                "show": show,
                "pointSize": {"fixed": 6 if show == "points" else 2},
            }
            for y, show in ys.items()
        ]
        self.panels.append(self._panel(
            "xychart", title, {"h": 8, "w": w}, description=description, datasource=DS,
            fieldConfig={"defaults": {"unit": y_unit,
                                      "custom": {"scaleDistribution": log_scale}},
                         "overrides": [{"matcher": {"id": "byName", "options": x},
                                        "properties": [{"id": "unit", "value": x_unit}]}]},
            options={"seriesMapping": "manual", "dims": {"frame": 0, "x": x}, "series": series,
                     "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                     "tooltip": {"mode": "single"}},
            transformations=[{"id": "joinByField", "options": {"byField": "Time",
                                                                 "mode": "outer"}}],
            targets=_targets(targets),
        ))  # fmt: skip
        self.x += w

    def _place(self, w: int) -> None:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + 8

    def _panel(self, kind: str, title: str, size: dict, **extra) -> dict:
        panel = {"id": self.next_id, "type": kind, "title": title,
                 "gridPos": {**size, "x": self.x, "y": self.y}, **extra}  # fmt: skip
        self.next_id += 1
        return panel


def _targets(targets: list[tuple[str, str]], exemplars: bool = False) -> list[dict]:
    return [
        {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i),
         **({"exemplar": True} if exemplars else {})}
        for i, (expr, legend) in enumerate(targets)
    ]  # fmt: skip


def variable(name: str, metric: str, label: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": f"label_values({metric}, {name})", "refId": name},
        "definition": f"label_values({metric}, {name})",
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "sort": 1,
    }


def build() -> dict:
    d = Layout()
    tokens = rate("stride_generation_tokens_total")

    d.row("Latency against throughput")
    d.add("Time to first token", quantiles("stride_time_to_first_token_seconds"), "s",
          exemplars=True, description="Exemplars (dots) open their request's trace.")  # fmt: skip
    d.add("Inter-token latency", quantiles("stride_inter_token_latency_seconds"), "s")
    d.add(
        "p99 latency against throughput",
        [
            (quantile(0.99, "stride_time_to_first_token_seconds"), "p99 TTFT"),
            (quantile(0.99, "stride_inter_token_latency_seconds"), "p99 ITL"),
            (f"sum({tokens})", "tokens/s"),
        ],
        "s",
        right_axis="tokens/s",
        right_unit="tokens/s",
    )
    d.add(
        "Throughput",
        [(f"sum({tokens})", "generated tokens/s"),
         (f"sum({rate('stride_prompt_tokens_total')})", "prompt tokens/s"),
         (f"sum({rate('stride_requests_finished_total')})", "requests/s")],
        "short",
    )  # fmt: skip
    d.add(
        "Time per output token and end-to-end",
        quantiles("stride_time_per_output_token_seconds", label="TPOT ")
        + [(quantile(0.5, "stride_e2e_request_latency_seconds"), "e2e p50"),
           (quantile(0.99, "stride_e2e_request_latency_seconds"), "e2e p99")],
        "s",
        exemplars=True,
    )  # fmt: skip
    d.add(
        "Where requests spend time (p90)",
        [(quantile(0.9, f"stride_request_{phase}_time_seconds"), phase)
         for phase in ("queue", "prefill", "decode")],
        "s",
    )  # fmt: skip

    d.row("Per user")
    per_user = {
        "p99 time to first token": "stride_time_to_first_token_seconds",
        "p99 inter-token latency": "stride_inter_token_latency_seconds",
    }
    for title, hist in per_user.items():
        d.add(f"{title} by user", [(quantile(0.99, hist, "user"), "{{user}}")], "s")
    d.add("Generated tokens/s by user", [(f"sum by (user) ({tokens})", "{{user}}")])

    d.row("Decoders")
    d.add("Generated tokens/s by decoder", [(f"sum by (decoder) ({tokens})", "{{decoder}}")])
    d.add(
        "p90 inter-token latency by decoder",
        [(quantile(0.9, "stride_inter_token_latency_seconds", "decoder"), "{{decoder}}")],
        "s",
    )
    d.add(
        "Tokens committed per forward pass (refinement, speculation)",
        [(f"sum by (decoder) ({tokens}) / sum by (decoder) "
          f"({rate('stride_decoder_forward_passes_total')})", "{{decoder}} mean"),
         (quantile(0.5, "stride_decoder_tokens_per_pass", "decoder",
                   'model=~"$model",decoder=~"$decoder"'), "{{decoder}} p50 of requests")],
        description="1 for plain decoding; above 1 when a pass commits several tokens.",
    )  # fmt: skip
    d.add(
        "Speculative acceptance rate",
        [(f"sum by (decoder) ({rate('stride_spec_accepted_tokens_total')}) / sum by (decoder) "
          f"({rate('stride_spec_draft_tokens_total')})", "{{decoder}}")],
        "percentunit",
    )  # fmt: skip
    d.add(
        "Speculative mean accepted length",
        [(f"1 + sum by (decoder) ({rate('stride_spec_accepted_tokens_total')}) / sum by (decoder) "
          f"({rate('stride_spec_drafts_total')})", "{{decoder}}")],
        description="Tokens committed per verification of a draft: accepted drafts + 1.",
    )  # fmt: skip
    pos_sel = 'model=~"$model",decoder=~"$decoder"'
    d.add(
        "Speculative acceptance by draft position",
        [(f"sum by (decoder, position) "
          f"({rate('stride_spec_accepted_tokens_by_position_total', pos_sel)}) "
          f"/ ignoring(position) group_left sum by (decoder) "
          f"({rate('stride_spec_drafts_total')})", "{{decoder}} position {{position}}")],
        "percentunit",
    )  # fmt: skip

    d.row("Engine")
    d.add(
        "Requests running and waiting",
        [(f"sum(stride_requests_running{{{MODEL}}})", "running"),
         (f"sum(stride_requests_waiting{{{MODEL}}})", "waiting")],
        description="All replicas of the model; one series per pod (label model only), "
                    "the series autoscaling and the inference gateway read.",
    )  # fmt: skip
    d.add("KV cache usage", [(f"max(stride_kv_cache_usage_ratio{{{MODEL}}})", "used")],
          "percentunit")  # fmt: skip
    d.add(
        "Batch size and tokens per step",
        [(f"max(stride_batch_size{{{MODEL}}})", "sequences (last step)"),
         (f"sum({rate('stride_engine_step_tokens_sum', MODEL)}) / "
          f"sum({rate('stride_engine_step_tokens_count', MODEL)})", "tokens per step (mean)")],
    )  # fmt: skip
    d.add("Engine step duration", quantiles("stride_engine_step_duration_seconds", MODEL), "s")
    d.add("Preemptions/s", [(f"sum({rate('stride_preemptions_total', MODEL)})", "preemptions")])
    d.add(
        "Prefix cache hit rate",
        [(f"sum({rate('stride_prefix_cache_hits_total', MODEL)}) / "
          f"sum({rate('stride_prefix_cache_queries_total', MODEL)})", "cached / prompt tokens")],
        "percentunit",
        description="Share of admitted prompt tokens whose KV came from the prefix cache.",
    )  # fmt: skip

    d.row("Roofline")
    flops = f"sum({rate('stride_engine_flops_total', MODEL)})"
    read = f"sum({rate('stride_engine_read_bytes_total', MODEL)})"
    busy = f"sum({rate('stride_engine_step_seconds_total', MODEL)})"
    peak_bw = f"scalar(max(stride_device_peak_bandwidth_bytes_per_second{{{MODEL}}}))"
    peak_flops = f"scalar(max(stride_device_peak_flops_per_second{{{MODEL}}}))"
    intensity = f"{flops} / {read}"
    d.xy(
        "Roofline: arithmetic intensity against achieved FLOP/s",
        [(intensity, "intensity"),
         (f"{flops} / {busy}", "achieved"),
         (f"clamp_max({intensity} * {peak_bw}, {peak_flops})", "roofline")],
        x="intensity",
        ys={"achieved": "points", "roofline": "points"},
        x_unit="FLOP/byte",
        y_unit="flops",
        w=12,
        description="Each point is one moment: the engine's FLOPs per byte read (counted from "
                    "the model's shapes) against its FLOPs per second of step time, under the "
                    "roof min(intensity x peak bandwidth, peak FLOP/s) at that intensity. Left "
                    "of the ridge decoding is bandwidth-bound: batching moves it right and up.",
    )  # fmt: skip
    by_decoder = "sum by (decoder) "
    d.stat(
        "Share of the bandwidth roofline, by decoder",
        [(f"{by_decoder}({rate('stride_engine_read_bytes_total', MODEL)}) / {by_decoder}"
          f"({rate('stride_engine_step_seconds_total', MODEL)}) / {peak_bw}", "{{decoder}}")],
        "percentunit",
        w=6,
        description="Bytes read per second of the steps that ran only this decoder's "
                    "sequences (mixed: several decoders), over the device's peak bandwidth.",
    )  # fmt: skip
    d.add(
        "Step composition: tokens per forward pass",
        [(f"sum by (kind) ({rate('stride_engine_scored_tokens_total', MODEL)}) / ignoring(kind) "
          f"group_left sum({rate('stride_engine_forward_passes_total', MODEL)})", "{{kind}}")],
        w=6,
        description="What a pass of the target scores: decode rows, prefill tokens, and draft "
                    "rows (speculative drafts, Jacobi guesses).",
    )  # fmt: skip
    d.add(
        "Arithmetic intensity by decoder",
        [(f"{by_decoder}({rate('stride_engine_flops_total', MODEL)}) / {by_decoder}"
          f"({rate('stride_engine_read_bytes_total', MODEL)})", "{{decoder}}"),
         (f"max(stride_device_peak_flops_per_second{{{MODEL}}}) / "
          f"max(stride_device_peak_bandwidth_bytes_per_second{{{MODEL}}})", "ridge point")],
        description="FLOPs per byte read; above the ridge point a step is compute-bound.",
    )  # fmt: skip
    d.add(
        "Achieved bandwidth against the peak",
        [(f"{read} / {busy}", "achieved"),
         (f"max(stride_device_peak_bandwidth_bytes_per_second{{{MODEL}}})", "peak")],
        "Bps",
        w=8,
        description="Bytes the target's passes read per second of step time (weights once per "
                    "pass, the K/V attended), and the device's copy bandwidth.",
    )  # fmt: skip

    d.row("Errors")
    failed = MODEL + ',finish_reason="error"'
    errors = (f"sum({rate('stride_requests_rejected_total', MODEL)} or "
              f"{rate('stride_requests_finished_total', failed)})")  # fmt: skip
    d.add(
        "Error rate",
        [(f"{errors} / sum({rate('stride_requests_received_total', MODEL)})", "errors / requests")],
        "percentunit",
    )
    d.add(
        "Rejected requests/s by reason",
        [(f"sum by (reason) ({rate('stride_requests_rejected_total', MODEL)})", "{{reason}}")],
    )
    d.add(
        "Finished requests/s by reason",
        [(f"sum by (finish_reason) ({rate('stride_requests_finished_total')})",
          "{{finish_reason}}")],
    )  # fmt: skip

    return {
        "uid": "stride-overview",
        "title": "Stride",
        "description": "Latency against throughput, per user and per decoder.",
        "tags": ["stride", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": "Prometheus", "value": "prometheus"},
                },
                variable("model", "stride_requests_received_total", "Model"),
                variable("decoder", "stride_generation_tokens_total", "Decoder"),
                variable("user", "stride_generation_tokens_total", "User"),
            ]
        },  # fmt: skip
        "annotations": {"list": []},
        "panels": d.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
