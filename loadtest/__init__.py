"""Load tests for Stride: Locust users that stream completions, a stepped concurrency shape,
and a sweep command that turns runs into latency-vs-throughput reports.

Nothing here imports `stride`: the load generator talks to any OpenAI-compatible server over HTTP.
"""
