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
    ) -> None:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + 8
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
            targets=[
                {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
                for i, (expr, legend) in enumerate(targets)
            ],
        )  # fmt: skip
        self.panels.append(panel)
        self.x += w

    def _panel(self, kind: str, title: str, size: dict, **extra) -> dict:
        panel = {"id": self.next_id, "type": kind, "title": title,
                 "gridPos": {**size, "x": self.x, "y": self.y}, **extra}  # fmt: skip
        self.next_id += 1
        return panel


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
    d.add("Time to first token", quantiles("stride_time_to_first_token_seconds"), "s")
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
