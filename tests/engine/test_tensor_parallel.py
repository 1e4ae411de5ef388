"""Tensor parallelism on the CPU (fp32, gloo over loopback): every split gives one device's tokens.

Each engine starts its worker processes for real, serves every decoder asked of it in one run,
and is stopped (workers gone, process group left) before the next starts; one device's runs are
made once per module (`tests/helpers/parallel.py`). The layouts are checked without processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from stride.decoders.registry import DecodersConfig
from stride.engine.config import EngineConfig
from stride.engine.parallel import Layout
from stride.engine.workers import WorkerDied
from stride.scheduler.client import EngineClient
from stride.scheduler.core import CoreConfig
from stride.scheduler.outputs import GenerateRequest, RequestOutput
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.adapters import random_adapter
from tests.helpers.cores import PROMPTS, greedy
from tests.helpers.eagle import random_head
from tests.helpers.models import make_diffusion_dir, make_model_dir
from tests.helpers.parallel import VARIANTS, generate, make_core
from tests.helpers.servers import wait_gone

TARGET_ONLY = [v for v in VARIANTS if not v.startswith("eagle")]


def layout(heads: int, kv: int, world: int, rank: int, vocab: int = 384, ffn: int = 128):
    config = AutoConfig.for_model(
        "llama", hidden_size=8 * heads, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=8, intermediate_size=ffn, vocab_size=vocab,
    )  # fmt: skip
    return Layout.of(config, world, rank)


# ---- the layout: who holds what --------------------------------------------------------------


def test_even_split_gives_each_rank_whole_kv_groups():
    shares = [layout(8, 4, 2, r) for r in range(2)]
    assert [(s.heads, s.kv_heads) for s in shares] == [
        (range(0, 4), range(0, 2)),
        (range(4, 8), range(2, 4)),
    ]
    assert [s.ffn for s in shares] == [range(0, 64), range(64, 128)]


def test_uneven_split_deals_out_whole_kv_groups():
    """SmolLM2-135M's shape: 9 heads in 3 KV groups; two ranks get one and two groups."""
    shares = [layout(9, 3, 2, r) for r in range(2)]
    assert [(s.heads, s.kv_heads) for s in shares] == [
        (range(0, 3), range(0, 1)),
        (range(3, 9), range(1, 3)),
    ]


def test_more_ranks_than_kv_heads_replicate_them():
    shares = [layout(4, 2, 4, r) for r in range(4)]
    assert [s.kv_heads for s in shares] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.heads for s in shares] == [range(r, r + 1) for r in range(4)]
    uneven = [layout(4, 2, 3, r) for r in range(3)]  # group 0 split over two ranks
    assert [(s.heads, s.kv_heads) for s in uneven] == [
        (range(0, 1), range(0, 1)),
        (range(1, 2), range(0, 1)),
        (range(2, 4), range(1, 2)),
    ]


def test_a_rank_without_a_head_is_refused():
    with pytest.raises(ValueError, match="leaves rank .* without an attention head"):
        layout(4, 2, 5, 0)


def test_vocabulary_slices_are_padded_to_one_width():
    shares = [layout(4, 2, 3, r, vocab=389) for r in range(3)]
    assert [s.vocab for s in shares] == [range(0, 130), range(130, 260), range(260, 389)]
    assert {s.vocab_per_rank for s in shares} == {130}
    table = torch.randn(389, 64)
    parts = [s.shard("model.embed_tokens.weight", table) for s in shares]
    assert [len(p) for p in parts] == [130, 130, 130]
    assert torch.equal(torch.cat(parts)[:389], table) and not parts[2][129].any()


def test_shards_reassemble_the_whole_tensors():
    shares = [layout(9, 3, 2, r, ffn=130) for r in range(2)]
    q, o = torch.randn(72, 64), torch.randn(64, 72)
    down = torch.randn(64, 130)
    name = "model.layers.0."
    assert torch.equal(torch.cat([s.shard(name + "self_attn.q_proj.weight", q) for s in shares]), q)
    assert torch.equal(
        torch.cat([s.shard(name + "self_attn.o_proj.weight", o) for s in shares], 1), o
    )
    assert torch.equal(torch.cat([s.shard(name + "mlp.down_proj.weight", down) for s in shares], 1),
                       down)  # fmt: skip
    norm = torch.randn(64)
    assert all(s.shard(name + "input_layernorm.weight", norm) is norm for s in shares)


# ---- whole engines: every decoder, token for token ------------------------------------------


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tp") / "draft", seed=1)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return make_diffusion_dir(tmp_path_factory.mktemp("tp") / "bert")


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory) -> Path:
    """Tied embeddings, 6 heads in 3 KV groups, 130 MLP columns, a vocabulary of 389: no size
    above 1 splits it evenly."""
    return make_model_dir(
        tmp_path_factory.mktemp("tp") / "odd", seed=3, hidden_size=96, num_attention_heads=6,
        num_key_value_heads=3, head_dim=16, intermediate_size=130, vocab_size=389,
        tie_word_embeddings=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_runs(tiny_dir, draft_dir, bert_dir) -> dict[int, dict[str, list[int]]]:
    decoders = dict(draft_model=str(draft_dir), diffusion_model=str(bert_dir))
    return {tp: generate(tiny_dir, tp, TARGET_ONLY, **decoders) for tp in (1, 2, 3)}


@pytest.mark.parametrize("tp", [2, 3])
def test_every_decoder_matches_one_device(tiny_runs, tp):
    """TP=3 over 4 heads in 2 KV groups: one group split over two ranks, its KV head on both."""
    assert tiny_runs[tp] == tiny_runs[1]
    assert len(tiny_runs[1]) == len(TARGET_ONLY) * len(PROMPTS)
    for name in ("ngram", "early_exit", "draft_model", "jacobi", "lookahead"):  # lossless
        for i in range(len(PROMPTS)):
            assert tiny_runs[tp][f"{name}-{i}"] == tiny_runs[1][f"ar-{i}"]


@pytest.fixture(scope="module")
def small_vocab_head(eagle_target, tmp_path_factory) -> Path:
    """A head drafting over the lowest 200 ids: its head rows are gathered from the target's."""
    return random_head(eagle_target, tmp_path_factory.mktemp("tp") / "head200", draft_vocab=200)


@pytest.mark.parametrize("tp", [2, 3])
def test_eagle_heads_draft_for_a_split_target(eagle_target, eagle_head, eagle_ref, tp):
    """The head runs on rank 0 over the gathered embedding and head; features come from rank
    0's copy of the residual stream, which every rank holds whole."""
    variants = ("ar", "eagle", "eagle_tree")
    got = generate(eagle_target, tp, variants, draft_head=str(eagle_head))
    assert got == generate(eagle_target, 1, variants, draft_head=str(eagle_head))
    for name in variants:
        for i in range(len(PROMPTS)):
            assert got[f"{name}-{i}"] == eagle_ref[i][:16]


def test_eagle_head_with_a_draft_vocabulary(eagle_target, small_vocab_head, eagle_ref):
    got = generate(eagle_target, 2, ("eagle",), draft_head=str(small_vocab_head))
    assert got == generate(eagle_target, 1, ("eagle",), draft_head=str(small_vocab_head))
    assert [got[f"eagle-{i}"] for i in range(len(PROMPTS))] == [
        eagle_ref[i][:16] for i in range(len(PROMPTS))
    ]


@pytest.mark.parametrize("tp", [2, 3])
def test_uneven_splits_and_tied_padded_vocabulary_match_one_device(odd_dir, tp):
    variants = ("ar", "early_exit", "jacobi")
    assert generate(odd_dir, tp, variants) == generate(odd_dir, 1, variants)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_biases_and_qk_norms_split(tiny_dirs, arch):
    variants = ("ar", "ngram")
    assert generate(tiny_dirs[arch], 2, variants) == generate(tiny_dirs[arch], 1, variants)


@pytest.mark.parametrize("tp", [2, 3])
def test_default_model_matches_one_device(default_engine, tp):
    """SmolLM2-135M (9 heads, 3 KV groups): TP=2 splits its groups one and two."""
    tok = default_engine.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fib(n):")]
    variants = ("ar", "ngram", "early_exit")
    reference = generate(None, 1, variants, prompts, n=12)
    assert generate(None, tp, variants, prompts, n=12) == reference
    assert reference["ngram-1"] == reference["ar-1"]


def test_kv_copies_reach_every_rank(tiny_dir):
    """What a tree's accepted path does to the cache (`KVCache.move`), here by hand: after the
    prompt, positions 0-1's K/V overwrite 2-3's. One device decodes on from that cache; so must
    two, which they do only if the workers' caches were copied too."""

    def decode(tp: int, move: bool) -> list[int]:
        core = make_core(tiny_dir, tp)
        try:
            core.add(GenerateRequest("r", PROMPTS[2], greedy(12)))
            tokens = core.step()[0].token_ids  # the prompt, and its first token
            if move:
                seq = core.seqs["r"]
                core.engine.cache.move(seq, [0, 1], [2, 3])
            while core.has_work:
                for out in core.step():
                    tokens += out.token_ids
            return tokens
        finally:
            if core.engine.workers is not None:
                core.engine.workers.close()

    moved = decode(1, True)
    assert moved != decode(1, False)  # the copy changes what follows
    assert decode(2, True) == moved


def test_a_mask_adapter_is_refused_on_a_split_model(tiny_dir, tiny_hf, tmp_path):
    """The introspective method's adapter hooks whole projections: not offered split (yet)."""
    random_adapter(tiny_hf).save(tmp_path / "adapter")
    with pytest.raises(ValueError, match="does not run on a model split over devices"):
        make_core(tiny_dir, 2, mask_adapter=str(tmp_path / "adapter"))


# ---- a dead worker is an engine fault --------------------------------------------------------


def test_a_dead_worker_fails_the_engine(tiny_dir):
    core = make_core(tiny_dir, 2)
    workers = core.engine.workers
    try:
        core.add(GenerateRequest("r", PROMPTS[0], greedy(64)))
        core.step()
        (pid,) = workers.pids
        os.kill(pid, signal.SIGKILL)
        wait_gone({pid}, timeout=30)
        with pytest.raises(WorkerDied, match="rank 1 exited with code -9"):
            for _ in range(64):
                core.step()
        assert workers.dead == "tensor-parallel rank 1 exited with code -9"
        with pytest.raises(WorkerDied):  # and stays failed: every later pass refuses
            core.engine.runner.forward([])
    finally:
        workers.close()


def test_a_pass_failing_on_rank_0_alone_stops_the_workers(tiny_dir):
    """The workers would wait in the pass's first collective for rank 0 forever: they are
    killed at once, and the engine fails (its supervision restarts it)."""
    core = make_core(tiny_dir, 2)
    workers, runner = core.engine.workers, core.engine.runner
    pids = set(workers.pids)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    runner._forward_eager = broken  # rank 0's share of every pass (CPU: no graphs)
    try:
        core.add(GenerateRequest("r", PROMPTS[0], greedy(4)))
        with pytest.raises(RuntimeError, match="injected"):
            core.step()
        wait_gone(pids, timeout=10)
        assert workers.dead == "rank 0 failed mid-pass: RuntimeError: injected"
        with pytest.raises(WorkerDied):
            runner.forward([])
    finally:
        workers.close()


def test_the_supervision_restarts_an_engine_whose_worker_died(tiny_dir):
    """Thread mode: the request in flight ends with engine_dead, a fresh engine (new workers,
    new process group) starts after the backoff and serves the next request as before."""
    config = CoreConfig(
        EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=16 << 20,
                     tensor_parallel_size=2),
        SchedulerConfig(),
        DecodersConfig(),
    )  # fmt: skip
    client = EngineClient(config.build(), rebuild=config.build)
    first = client.core.engine.workers

    async def collect(req: GenerateRequest, kill: int | None = None) -> list[RequestOutput]:
        outs = []
        async for _, out in client.generate(req):
            outs.append(out)
            if kill is not None and len(outs) == 1:
                os.kill(kill, signal.SIGKILL)
        return outs

    try:
        (pid,) = first.pids
        outs = asyncio.run(collect(GenerateRequest("long", PROMPTS[0], greedy(1000)), pid))
        assert outs[-1].error is not None and outs[-1].error.code == "engine_dead"
        assert "tensor-parallel rank 1 exited with code -9" in outs[-1].error.message
        deadline = time.monotonic() + 120
        while (client.dead is not None or client.core.engine.workers is first) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert client.dead is None and set(client.core.engine.workers.pids).isdisjoint({pid})
        outs = asyncio.run(collect(GenerateRequest("next", PROMPTS[1], greedy(8))))
        assert outs[-1].finish_reason == "length"
        reference = generate(tiny_dir, 1, ("ar",), [PROMPTS[1]], n=8)["ar-0"]
        assert [t for out in outs for t in out.token_ids] == reference
    finally:
        client.shutdown()
        workers = client.core.engine.workers
        workers.close()
        wait_gone(set(workers.pids) | set(first.pids), timeout=30)
