"""The roofline count: bytes and FLOPs of every step, from the model's shapes and the step's batch.

Expected values are computed here from the model's config (not from `ModelShape`), for runs of
the real step loop on tiny models; then the same numbers must reach Prometheus' counters, and
the device's peaks its gauges.
"""

from __future__ import annotations

import math

import pytest
import torch

from stride.engine.config import EngineConfig
from stride.engine.roofline import MIXED, ModelShape, StepLoad, device_peaks
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.server.app import ServerConfig
from tests.helpers.cores import make_core
from tests.helpers.servers import LiveServer, scrape

FP32 = 4


def config_shape(hf) -> dict[str, int]:
    """What one pass costs, from the config alone (llama: no biases, untied head here)."""
    h, i, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    d = getattr(hf, "head_dim", None) or h // heads
    linear = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * i
    return {
        "layer_bytes": FP32 * (layers * (linear + 2 * h) + h),  # + 2 norms a layer, final norm
        "head_bytes": FP32 * h * hf.vocab_size,
        "macs": layers * linear,
        "head_macs": h * hf.vocab_size,
        "pair_macs": 2 * layers * heads * d,
        "kv_bytes": FP32 * 2 * layers * kv_heads * d,
    }


def run(core: EngineCore, requests: list[GenerateRequest]) -> tuple[list[StepLoad], dict]:
    """Step until every request finished: each step's load, and each request's last output."""
    for req in requests:
        core.add(req)
    loads, last = [], {}
    while core.has_work:
        for out in core.step():
            if out.finished:
                last[out.request_id] = out
        loads.append(core.stats().load)
    return loads, last


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_model_shape_is_the_configs(tiny_dir):
    core = make_core(tiny_dir)
    hf = core.engine.hf_config
    assert not hf.tie_word_embeddings
    want = config_shape(hf)
    shape = core.engine.shape
    assert shape == ModelShape(
        layer_bytes=want["layer_bytes"],
        head_bytes=want["head_bytes"],
        layer_macs_per_token=want["macs"],
        head_macs_per_row=want["head_macs"],
        attention_macs_per_pair=want["pair_macs"],
        kv_bytes_per_token=want["kv_bytes"],
    )


def test_one_request_reads_its_weights_per_pass_and_its_growing_context(tiny_dir):
    core = make_core(tiny_dir)
    c = config_shape(core.engine.hf_config)
    prompt, new = list(range(5, 5 + 37)), 9
    loads, _ = run(core, [GenerateRequest("r", prompt, greedy(new))])
    p = len(prompt)
    assert [ld.prefill_tokens for ld in loads if ld.passes] == [p] + [0] * (new - 1)
    assert sum(ld.decode_rows for ld in loads) == new - 1  # the prefill made the first token
    assert sum(ld.draft_rows for ld in loads) == 0
    assert {ld.decoder for ld in loads if ld.passes} == {"ar"}
    # Pass j (0 = the prefill) attends its context: all of the prompt, then one token more.
    read = [p] + [p + j for j in range(1, new)]
    pairs = [p * (p + 1) // 2] + [p + j for j in range(1, new)]
    tokens = p + new - 1
    bytes_read = new * (c["layer_bytes"] + c["head_bytes"]) + sum(read) * c["kv_bytes"]
    flops = 2 * (c["macs"] * tokens + c["head_macs"] * new + c["pair_macs"] * sum(pairs))
    assert sum(ld.read_bytes for ld in loads) == bytes_read
    assert sum(ld.flops for ld in loads) == flops


def test_chunked_prefill_reads_no_head_until_its_last_chunk(tiny_dir):
    core = make_core(tiny_dir, max_num_batched_tokens=16)
    c = config_shape(core.engine.hf_config)
    loads, _ = run(core, [GenerateRequest("r", list(range(5, 45)), greedy(1))])
    assert [ld.prefill_tokens for ld in loads] == [16, 16, 8]
    assert [ld.read_bytes for ld in loads] == [
        c["layer_bytes"] + 16 * c["kv_bytes"],
        c["layer_bytes"] + 32 * c["kv_bytes"],
        c["layer_bytes"] + c["head_bytes"] + 40 * c["kv_bytes"],
    ]


def test_speculative_steps_score_their_drafts(tiny_dir):
    core = make_core(tiny_dir)
    options = {"draft": "early_exit", "adaptive": False, "num_speculative_tokens": 3}
    req = GenerateRequest("s", list(range(5, 25)), greedy(20), "speculative", options)
    loads, last = run(core, [req])
    stats = last["s"].decoder_stats
    assert stats["draft_tokens"] > 0
    assert sum(ld.draft_rows for ld in loads) == stats["draft_tokens"]
    assert sum(ld.passes for ld in loads) == stats["forward_passes"]
    assert {ld.decoder for ld in loads if ld.passes} == {"speculative"}


def test_a_step_of_several_decoders_is_mixed(tiny_dir):
    core = make_core(tiny_dir)
    jacobi = {"method": "jacobi"}
    reqs = [GenerateRequest("a", [5, 6, 7], greedy(4)),
            GenerateRequest("b", [8, 9, 10], greedy(4), "refine", jacobi)]  # fmt: skip
    loads, _ = run(core, reqs)
    assert loads[0].decoder == MIXED


def decode_intensity(tiny_dir, batch: int) -> float:
    core = make_core(tiny_dir)
    reqs = [GenerateRequest(f"r{i}", [5 + i] * 24, greedy(6)) for i in range(batch)]
    loads, _ = run(core, reqs)
    (step, *_) = [ld for ld in loads if ld.decode_rows == batch and not ld.prefill_tokens]
    return step.flops / step.read_bytes


def test_decode_intensity_grows_with_the_batch(tiny_dir):
    """One weight read serves every row of a decode step: FLOPs per byte grow with the batch
    (almost in proportion while the weights outweigh the K/V), as the roofline says."""
    intensity = [decode_intensity(tiny_dir, b) for b in (1, 2, 4, 8)]
    assert intensity == sorted(intensity) and len(set(intensity)) == 4
    assert intensity[-1] / intensity[0] > 6


def test_device_peaks_given_or_measured():
    cpu = torch.device("cpu")
    given = device_peaks(cpu, torch.float32, 3e12, 5e14)
    assert (given.bandwidth, given.flops) == (3e12, 5e14)
    measured = device_peaks(cpu, torch.float32)
    assert 0 < measured.bandwidth < math.inf and 0 < measured.flops < math.inf


@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = EngineConfig(model=str(tiny_dir), served_name="tiny", device="cpu",
                          kv_cache_memory=8 << 20, peak_bandwidth=2.5e10,
                          peak_flops=3e11)  # fmt: skip
    live = LiveServer(ServerConfig(engine=engine))
    yield live
    live.stop()


def test_metrics_count_what_the_steps_read(server):
    c = config_shape(server.core.engine.hf_config)
    assert scrape(server.url, "stride_device_peak_bandwidth_bytes_per_second") == 2.5e10
    assert scrape(server.url, "stride_device_peak_flops_per_second") == 3e11
    prompt, new = list(range(5, 5 + 21)), 7
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0.0, "ignore_eos": True}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == new
    server.wait_idle()
    p = len(prompt)
    read = p + sum(p + j for j in range(1, new))
    want = new * (c["layer_bytes"] + c["head_bytes"]) + read * c["kv_bytes"]
    assert scrape(server.url, "stride_engine_read_bytes_total", decoder="ar") == want
    assert scrape(server.url, "stride_engine_forward_passes_total", decoder="ar") == new
    assert scrape(server.url, "stride_engine_scored_tokens_total", kind="prefill") == p
    assert scrape(server.url, "stride_engine_scored_tokens_total", kind="decode") == new - 1
    assert scrape(server.url, "stride_engine_step_seconds_total", decoder="ar") > 0
    for decoder in ("speculative", "refine", MIXED):  # at 0 from the start
        assert scrape(server.url, "stride_engine_read_bytes_total", decoder=decoder) == 0
