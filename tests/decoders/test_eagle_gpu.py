"""EAGLE on the GPU: greedy chains as device cycles in CUDA graphs (the head on fused kernels)
decode exactly what plain decoding does, in fp32; sampled chains and trees draw what the host
draws."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stride.decoders.registry import DecodersConfig, build_decoders
from stride.decoders.speculative import draws
from stride.decoders.speculative.device_tree import TreeShape
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.fused import FusedHead
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.cores import PROMPTS, greedy, run
from tests.helpers.eagle import CHAIN, TREE, random_head
from tests.helpers.models import make_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def cuda_core(
    model: str | None, head: str | None, scheduler: SchedulerConfig | None = None, **config
) -> EngineCore:
    engine = Engine(
        EngineConfig(
            model=model, device="cuda", dtype="float32", kv_cache_memory=256 << 20, **config
        )
    )
    decoders = build_decoders(engine, DecodersConfig(draft_head=head))
    return EngineCore(engine, scheduler or SchedulerConfig(), decoders)


def test_device_cycles_decode_exactly_on_the_gpu(tmp_path):
    model = make_model_dir(tmp_path / "target", layers=4)
    head = random_head(model, tmp_path / "head")
    core = cuda_core(str(model), str(head))
    cycles = core.decoders["speculative"].eagle.cycles
    assert cycles.graphs and isinstance(cycles.head_forward, FusedHead)
    for i, prompt in enumerate(PROMPTS):
        ref, _ = run(core, [GenerateRequest("r", prompt, greedy(24))])
        for options in (CHAIN, TREE):
            request = GenerateRequest("s", prompt, greedy(24), "speculative", options)
            tokens, _ = run(core, [request])
            assert tokens["s"] == ref["r"], (i, options)
    assert cycles.replay_ms(1, TreeShape.chain(CHAIN["num_speculative_tokens"])) > 0
    batch = [GenerateRequest(str(i), p, greedy(24), "speculative", CHAIN)
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    tokens, _ = run(core, batch)
    for i, prompt in enumerate(PROMPTS):
        ref, _ = run(core, [GenerateRequest("r", prompt, greedy(24))])
        assert tokens[str(i)] == ref["r"]


@pytest.mark.parametrize(
    "options, truncation",
    [(CHAIN, {"top_p": 0.95, "top_k": 20}), (CHAIN, {"top_k": 20}), (TREE, {"top_p": 0.95}),
     (TREE, {})],  # fmt: skip
    ids=["chain-sorted", "chain-top-k", "tree-sorted", "tree-unranked"],
)
def test_sampled_rows_in_graphs_draw_what_the_host_draws_seed_for_seed(
    tmp_path, options, truncation
):
    """Seeded sampled requests of a fixed chain or tree: the graphed loop's tokens equal those
    of steps drafted and verified on the host (no bursts), alone and beside a greedy row (AR's),
    with their tokens ranked as `draws.ranks` says (all, the best TOP_MAX, none). (A sampled
    tree's are `ar`'s own: every token the target's seeded draw.)"""
    model = make_model_dir(tmp_path / "target", layers=4)
    head = random_head(model, tmp_path / "head")
    sampled = SamplingParams(max_tokens=24, temperature=0.9, ignore_eos=True, **truncation)
    requests = [GenerateRequest(str(i), p, replace(sampled, seed=i), "speculative", options)
                for i, p in enumerate(PROMPTS[:3])]  # fmt: skip
    host = cuda_core(str(model), str(head), SchedulerConfig(fused_decode_steps=1))
    ref, _ = run(host, requests)
    core = cuda_core(str(model), str(head))
    cycles = core.decoders["speculative"].eagle.cycles
    greedy_ref, _ = run(core, [GenerateRequest("g", PROMPTS[3], greedy(24))])
    tokens, stats = run(core, requests + [
        GenerateRequest("s", PROMPTS[3], greedy(24), "speculative", options)])  # fmt: skip
    k = options["num_speculative_tokens"]
    shape = TreeShape.chain(k, True, draws.ranks([sampled]))
    if options.get("tree_nodes"):
        shape = TreeShape.of(options["tree_nodes"], k, options["tree_topk"], True, shape.ranks)
    assert (4, shape) in cycles._graphs
    assert all(tokens[str(i)] == ref[str(i)] for i in range(3))
    assert tokens["s"] == greedy_ref["g"]


def test_the_shipped_head_on_the_default_model_decodes_exactly_and_accepts(tmp_path):
    core = cuda_core(None, None)
    tok = core.engine.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in ("Write a haiku about a cat sleeping in the sun.", "Why is the sky blue?")
    ]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    ref, _ = run(core, [GenerateRequest(str(i), p, greedy(48)) for i, p in enumerate(prompts)])
    options = dict(CHAIN, num_speculative_tokens=5)
    tokens, stats = run(
        core, [GenerateRequest(str(i), p, greedy(48), "speculative", options)
               for i, p in enumerate(prompts)]  # fmt: skip
    )
    assert tokens == ref
    assert all(s["accepted_tokens"] > 0 for s in stats.values())


def test_adaptive_requests_loop_on_graphed_features_and_decode_exactly(tmp_path):
    """The default options on a GPU: plain graphed steps, then the loop policy's bursts, whose
    head catch-ups find the target's features for every position the plain steps decoded."""
    model = make_model_dir(tmp_path / "target", layers=4)
    head = random_head(model, tmp_path / "head")
    core = cuda_core(str(model), str(head), enable_prefix_caching=False)  # (whole prefills)
    spec = core.decoders["speculative"]
    assert spec.device_loop
    eagle, missing = spec.eagle, []
    real = eagle._catch_up

    def catch_up(seqs):
        for seq in seqs:
            cur = eagle.cursors.get(seq.request_id)
            n = seq.num_cached - (cur.done if cur else 0)
            held = sum(len(f) for f in seq.features or [])
            if (cur is None or cur.root is None or n) and held < n:
                missing.append((seq.request_id, n, held))
        return real(seqs)

    eagle._catch_up = catch_up
    ref, _ = run(core, [GenerateRequest(str(i), p, greedy(64)) for i, p in enumerate(PROMPTS)])
    options = {"draft": "eagle"}
    for _ in range(2):  # (the second time, the policy has measured its candidates)
        tokens, _ = run(core, [GenerateRequest(str(i), p, greedy(64), "speculative", options)
                               for i, p in enumerate(PROMPTS)])  # fmt: skip
        assert tokens == ref
    assert spec.loop.rates and not missing
