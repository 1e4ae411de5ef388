"""EAGLE trees in the device loop on the GPU: the Triton decode kernel under tree masks and the
tree kernel over whole trees (`DecodeMetadata.tree_rows`) against the torch reference, and tree
cycles as CUDA graphs decoding exactly what AR does in fp32
(and what the same cycles do eagerly)."""

from __future__ import annotations

import itertools

import pytest
import torch

from stride.decoders.registry import DecodersConfig, build_decoders
from stride.decoders.speculative.device_tree import TreeShape
from stride.decoders.speculative.layout import Fixed
from stride.decoders.speculative.tree import Tree
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.kernels.decode_attention import (
    DecodeMetadata,
    decode_attention,
    decode_attention_reference,
)
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.cores import PROMPTS, alone_then_together, greedy, run
from tests.helpers.eagle import random_head, record_bursts
from tests.helpers.models import make_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

TREE = dict(draft="eagle", num_speculative_tokens=4, adaptive=False, tree_nodes=24, tree_topk=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", [None, (4, 16, 2), (1, 32, 4)], ids=["auto", "split", "one"])
def test_the_kernel_under_tree_masks_equals_the_reference(dtype, launch):
    """Trees of up to 128 rows after prefixes of several lengths (splits that see nothing of a
    tile included), and rows without a tree alongside (an all-visible mask)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, blocks = 8, 2, 64, 16, 200
    dev = torch.device("cuda")
    k_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen).to(dev, dtype)
    v_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen).to(dev, dtype)
    starts, masks, lens, tables = [], [], [], []
    for prefix, n in [(0, 5), (37, 64), (300, 128), (1, 1), (15, 17)]:
        table = torch.randperm(blocks, generator=gen)[:40].to(torch.int32)
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
                   for i in range(n - 1)]  # fmt: skip
        sees = torch.zeros(n, 128, dtype=torch.bool)
        sees[:, :n] = Tree([0] * (n - 1), parents).mask()
        for r in range(n):
            starts.append(prefix)
            masks.append(sees[r])
            lens.append(prefix + r + 1)
            tables.append(table)
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long, device=dev),
        block_tables=torch.stack(tables).to(dev),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_size=block,
        tree_start=torch.tensor(starts, device=dev),
        tree_mask=torch.stack(masks).to(dev),
    )
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dev, dtype)
    got = decode_attention(q, k_cache, v_cache, meta, launch)
    want = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.float(), want, **tol)
    plain = DecodeMetadata(meta.slot_mapping, meta.block_tables, meta.context_lens, block)
    full = DecodeMetadata(meta.slot_mapping, meta.block_tables, meta.context_lens, block,
                          meta.tree_start, torch.ones_like(meta.tree_mask))  # fmt: skip
    torch.testing.assert_close(
        decode_attention(q, k_cache, v_cache, full, launch).float(),
        decode_attention(q, k_cache, v_cache, plain, launch).float(),
        **tol,
    )


def test_the_kernel_reads_rows_sharing_a_block_table_and_tree_start_as_views():
    """A tree level's expansion rows at batch 1 share their sequence's block table and tree
    start as views of the loop's buffers with a stride of 0 (`cycles.Fixed.per_row`); the
    kernel reads them as the reference does, not the buffers' next rows (other sequences')."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block, blocks, rows, prefix = 8, 2, 64, 16, 40, 6, 37
    dev = torch.device("cuda")
    k_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen).to(dev)
    v_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen).to(dev)
    tables = torch.zeros(8, 10, dtype=torch.int32, device=dev)  # the loop's buffers: row 0 the
    tables[0] = torch.randperm(blocks, generator=gen)[:10].to(dev)  # sequence's, the rest stale
    base = torch.zeros(8, dtype=torch.long, device=dev)
    base[0] = prefix
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, rows - 1)]
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.long, device=dev),
        block_tables=Fixed.per_row(tables[:1], rows),
        context_lens=torch.arange(prefix + 1, prefix + rows + 1, dtype=torch.int32, device=dev),
        block_size=block,
        tree_start=Fixed.per_row(base[:1], rows),
        tree_mask=Tree([0] * (rows - 1), parents).mask().to(dev),
    )
    assert meta.tree_start.stride(0) == 0 and meta.block_tables.stride(0) == 0
    q = torch.randn(rows, heads, dim, generator=gen).to(dev)
    torch.testing.assert_close(
        decode_attention(q, k_cache, v_cache, meta),
        decode_attention_reference(q, k_cache, v_cache, meta),
        atol=1e-4,
        rtol=1e-4,
    )


def _trees(
    rows: int, batch: int, prefix: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple:
    """`batch` random trees of `rows` rows (parents first) after prefixes of `prefix` tokens, as
    the verify step lays them out: q, caches and whole-tree metadata on the GPU."""
    gen = torch.Generator().manual_seed(rows * 7 + batch * 3 + prefix)
    block, dev = 16, torch.device("cuda")
    per_seq = -(-(prefix + rows) // block)
    blocks = batch * per_seq + 5
    k_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen).to(dev, dtype)
    v_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen).to(dev, dtype)
    tables = torch.randperm(blocks, generator=gen)[: batch * per_seq].view(batch, per_seq)
    sees = []
    for _ in range(batch):
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
                   for i in range(rows - 1)]  # fmt: skip
        sees.append(Tree([0] * (rows - 1), parents).mask())
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(batch * rows, dtype=torch.long, device=dev),
        block_tables=tables.to(torch.int32).repeat_interleave(rows, 0).to(dev),
        context_lens=(prefix + 1 + torch.arange(rows)).repeat(batch).to(dev, torch.int32),
        block_size=block,
        tree_start=torch.full((batch * rows,), prefix, device=dev),
        tree_mask=torch.cat(sees).to(dev),
        tree_rows=rows,
    )
    q = torch.randn(batch * rows, heads, dim, generator=gen).to(dev, dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(12, 3), (8, 2)])
@pytest.mark.parametrize("rows", [16, 64, 128])
def test_the_tree_kernel_equals_the_reference(rows, heads, kv_heads, dim, dtype):
    """Whole trees (each prefix read once for all of a tree's rows) at batch 1 and 3, after
    prefixes of 1 to 1000 tokens, with the engine's launch shape, split and unsplit."""
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for batch, prefix in itertools.product((1, 3), (1, 100, 1000)):
        q, k_cache, v_cache, meta = _trees(rows, batch, prefix, heads, kv_heads, dim, dtype)
        want = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta)
        for launch in (None, (4, 16, 2), (1, 32, 4)):
            got = decode_attention(q, k_cache, v_cache, meta, launch)
            torch.testing.assert_close(got.float(), want, **tol)


def test_the_tree_kernel_replays_in_a_graph_over_other_prefixes():
    """Captured once, the kernel follows the prefix length, masks and tables of each replay."""
    long = _trees(64, 2, 1000, 9, 3, 64, torch.bfloat16)
    q, k_cache, v_cache, meta = (x.clone() if torch.is_tensor(x) else x for x in long)
    decode_attention(q, k_cache, v_cache, meta)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, meta)
    for prefix in (1000, 100, 1, 999):
        src_q, src_k, src_v, src = _trees(64, 2, prefix, 9, 3, 64, torch.bfloat16)
        for dst, x in [(q, src_q), (meta.context_lens, src.context_lens),
                       (meta.tree_start, src.tree_start), (meta.tree_mask, src.tree_mask)]:
            dst.copy_(x)  # fmt: skip
        meta.block_tables[:, : src.block_tables.shape[1]].copy_(src.block_tables)
        k_cache[: len(src_k)].copy_(src_k)
        v_cache[: len(src_v)].copy_(src_v)
        graph.replay()
        want = decode_attention_reference(src_q.float(), src_k.float(), src_v.float(), src)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def _core(model: str, head: str) -> EngineCore:
    engine = Engine(
        EngineConfig(model=model, device="cuda", dtype="float32", kv_cache_memory=256 << 20)
    )
    decoders = build_decoders(engine, DecodersConfig(draft_head=head))
    return EngineCore(engine, SchedulerConfig(fused_decode_steps=4), decoders)


def test_tree_cycles_in_cuda_graphs_decode_exactly(tmp_path):
    model = make_model_dir(tmp_path / "target", layers=4)
    head = random_head(model, tmp_path / "head")
    core = _core(str(model), str(head))
    cycles = core.decoders["speculative"].eagle.cycles
    assert cycles.graphs
    prompts = PROMPTS + [list(range(60, 77)), [3, 4], list(range(200, 230)), [9] * 11]
    ref, _ = run(core, [GenerateRequest(str(i), p, greedy(32)) for i, p in enumerate(prompts)])
    ran = record_bursts(core)
    alone, together = alone_then_together(core, prompts, greedy(32), "speculative", TREE, alone=2)
    assert alone == {i: ref[i] for i in alone}
    assert together == ref
    shapes = [shape for _, shape, _ in ran]
    assert shapes and not any(s.is_chain for s in shapes)
    assert any(key[1] == s for s in shapes for key in cycles._graphs)  # captured, replayed
    cycles.graphs = False  # the same cycles, eagerly
    _, together = alone_then_together(core, prompts, greedy(32), "speculative", TREE, alone=0)
    assert together == ref
    cycles.graphs = True
    for shape in (TreeShape.of(63, 6, 8), TreeShape.of(127, 8, 10)):
        assert cycles.replay_ms(1, shape) > 0 and cycles.replay_ms(8, shape, context=200) > 0
