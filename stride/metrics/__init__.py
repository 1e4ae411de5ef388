"""Every Prometheus metric Stride emits, each defined once and recorded where the event happens.

Two feeders: the step loop calls `Metrics.on_step` after every engine step and every abort (the
engine's state and steps, `engine`; what the device did, `roofline`), and the HTTP edge wraps
each request in `Metrics.track(...)`, a `tracker.RequestTracker` that sees the request's outputs
as they stream (tokens, TTFT, inter-token latency) and its last one (finish reason, engine-side
timings, the decoder's summary: `requests`, `decoders`). `middleware` counts the requests that
reach the server and those refused, and writes the access line (`access`).

The modules, by what their metrics measure, and how they are fed:
- `labels`: the label values (bounded: strategies, users' allowlist, reasons, kinds);
- `buckets`: the histograms' bucket boundaries;
- `engine`, `roofline`, `requests`, `decoders`: the metric definitions, one group each;
- `registry`: `Metrics`, one server's registry of every group and the hooks that feed them;
- `tracker`: one request's series and its recording; `middleware`, `access`: the HTTP edge.

Labels stay bounded: `user` comes only from a configured allowlist (anything else is `other`,
no user is `none`), and `decoder` is the request's strategy (`ar`, `speculative/ngram`,
`refine/jacobi`, ...). Every series whose labels are known at start-up exists from the start, at
0, as Prometheus' naming guide recommends, so dashboards and `rate()` alerts have data from the
first scrape. One `CollectorRegistry` per server, so tests can build many apps in a process.
"""
