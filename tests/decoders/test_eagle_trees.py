"""EAGLE trees in the device loop (eagerly on the CPU): the tree mask in decode attention, trees
drafted as tensors, greedy acceptance as tensors, and tree bursts that decode exactly what AR
does, with the accepted path's keys and values moved where plain decoding would have put them.
(CUDA graphs and the Triton kernel: test_eagle_trees_gpu.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from stride.decoders.speculative import cycles as cycles_module
from stride.decoders.speculative.device_tree import TreeShape, ancestors, top_k
from stride.decoders.speculative.tree import Tree
from stride.decoders.speculative.verify import accept_greedy, verify_greedy
from stride.engine.attention import attend
from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import PROMPTS, greedy, run
from tests.helpers.eagle import eagle_core, free, record_bursts

TREE = dict(draft="eagle", num_speculative_tokens=3, adaptive=False, tree_nodes=8, tree_topk=3)
TOKENS = 16


def _random_tree(n: int, gen: torch.Generator) -> list[int]:
    """Parents of n nodes (parents first; -1: under the root)."""
    return [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]


def test_the_tree_mask_in_decode_attention_equals_a_dense_mask():
    """Rows of trees in consecutive slots after their prefixes, attending under the tree mask,
    against attention over each row's context with a dense mask written out by hand."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block, blocks = 4, 2, 16, 4, 40
    k_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen)
    rows, starts, masks, lens, tables, dense = [], [], [], [], [], []
    for seq, (prefix, n) in enumerate([(5, 7), (13, 9), (1, 4)]):
        table = torch.randperm(blocks, generator=gen)[:10].to(torch.int32)
        tree = Tree([0] * (n - 1), _random_tree(n - 1, gen))
        sees = tree.mask()  # [root, nodes]
        for r in range(n):
            rows.append(seq)
            starts.append(prefix)
            masks.append(sees[r])
            lens.append(prefix + r + 1)
            tables.append(table)
            full = torch.zeros(prefix + n, dtype=torch.bool)
            full[:prefix] = True
            full[prefix:] = sees[r]
            dense.append((table, full))
    q = torch.randn(len(rows), heads, dim, generator=gen)
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(len(rows), dtype=torch.long),
        block_tables=torch.stack(tables),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_size=block,
        tree_start=torch.tensor(starts),
        tree_mask=torch.nn.utils.rnn.pad_sequence(masks, batch_first=True),
    )
    out = attend(q, k_cache, v_cache, meta)
    for i, (table, full) in enumerate(dense):
        pos = torch.arange(len(full))
        slots = table[pos // block].long() * block + pos % block
        keys = k_cache[slots].repeat_interleave(heads // kv_heads, 1)  # [L, H, D]
        values = v_cache[slots].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", q[i], keys) / dim**0.5
        probs = F.softmax(scores.masked_fill(~full, float("-inf")), -1)
        torch.testing.assert_close(out[i], torch.einsum("hl,lhd->hd", probs, values))


def test_greedy_acceptance_as_tensors_follows_the_matching_path():
    """A tree whose second branch matches: the path, its length and the token after it."""
    #            root
    #        /     |     \
    #      n0(7)  n1(8)  n2(9)
    #       |      |  \
    #     n3(1)  n4(2) n5(3)
    #              |
    #            n6(4)
    tree = Tree([7, 8, 9, 1, 2, 3, 4], [-1, -1, -1, 0, 1, 1, 4])
    best = torch.tensor([8, 0, 3, 0, 0, 0, 0, 0])  # after: root → 8 (n1), n1 → 3 (n5), n5 → 0
    best_rows = torch.zeros(8, 50)
    best_rows[torch.arange(8), best] = 1.0
    assert verify_greedy(best_rows, [tree]) == ([[1, 5]], [0])
    tokens = torch.tensor([[5] + tree.tokens])
    parents = torch.tensor([[0] + [p + 1 for p in tree.parents]])
    depths = torch.tensor([[0] + tree.depths()])
    n, path, bonus = accept_greedy(tokens, parents, tree.mask()[None], depths, best[None], 3)
    assert n.tolist() == [2] and path.tolist() == [[0, 2, 6, 0]] and bonus.tolist() == [0]


def test_ancestors_from_parents_are_the_tree_mask():
    gen = torch.Generator().manual_seed(1)
    trees = [Tree([0] * n, _random_tree(n, gen)) for n in (0, 1, 6, 40)]
    trees.append(Tree.chain([0] * 40))
    width = 41
    parents = torch.zeros(len(trees), width, dtype=torch.long)
    for i, tree in enumerate(trees):
        parents[i, 1 : len(tree) + 1] = torch.tensor(tree.parents, dtype=torch.long) + 1
    sees = ancestors(parents)
    for i, tree in enumerate(trees):
        n = len(tree) + 1
        assert torch.equal(sees[i, :n, :n], tree.mask())
        assert not sees[i, n:, 1:n].any()  # (padding rows: under the root)


@pytest.mark.parametrize("shape", [(3, 8192), (2, 4, 1024), (5, 300), (1, 49152)])
def test_two_pass_top_k_is_torch_topk(shape):
    """Chunked (and short rows plainly): the same sorted values and indices, ties aside."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    for k in (1, 8, 16):
        values, index = top_k(x, k)
        want = x.topk(k, -1)
        assert torch.equal(values, want.values) and torch.equal(index, want.indices)


def test_verify_greedy_over_several_trees_and_chains():
    trees = [Tree.chain([4, 5, 6]), Tree([7, 8], [-1, -1]), Tree.chain([])]
    best = torch.tensor([4, 5, 9, 0] + [8, 0, 1] + [3])
    rows = torch.zeros(len(best), 20)
    rows[torch.arange(len(best)), best] = 1.0
    paths, last = verify_greedy(rows, trees)
    assert paths == [[0, 1], [1], []] and last == [9, 1, 3]


def _trees_drafted(monkeypatch) -> list:
    """Record every tree the device loop drafts."""
    made = []
    real = cycles_module.draft_tree

    def spy(*args):
        tree = real(*args)
        made.append(tree)
        return tree

    monkeypatch.setattr(cycles_module, "draft_tree", spy)
    return made


def test_device_trees_are_closed_under_ancestors_and_are_the_host_drafters(
    eagle_target, eagle_head, monkeypatch
):
    """The first cycle's tree of each sequence, drafted on the device, holds the same nodes
    (as root-to-node token paths) as `EagleDrafter.draft_trees` makes on the host from the
    same head state; rows come parents first and see exactly their ancestors."""
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    eagle = core.decoders["speculative"].eagle
    made = _trees_drafted(monkeypatch)
    host: list = []
    real_burst = eagle.burst

    def burst(seqs, shape, cycles):
        if not host:
            depths, budgets = [shape.depth] * len(seqs), [shape.nodes - 1] * len(seqs)
            host.append(eagle.draft_trees(seqs, depths, budgets, shape.topk))
            made.clear()
        return real_burst(seqs, shape, cycles)

    eagle.burst = burst
    requests = [GenerateRequest(str(i), p, greedy(8), "speculative", TREE)
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    run(core, requests)
    assert host and made
    device = made[0]
    for b, tree in enumerate(host[0]):
        tokens, parents = device.tokens[b].tolist(), device.parents[b].tolist()
        depths, sees = device.depths[b].tolist(), device.sees[b]
        assert len(tokens) == len(tree) + 1
        for r in range(1, len(tokens)):
            assert parents[r] < r and depths[r] == depths[parents[r]] + 1
            ancestors = {r}
            p = r
            while p:
                p = parents[p]
                ancestors.add(p)
            assert set(sees[r].nonzero()[:, 0].tolist()) == ancestors
        on_device = {tuple(_path(tokens, parents, r)) for r in range(1, len(tokens))}
        host_paths = {tuple(_path([0] + tree.tokens, [0] + [p + 1 for p in tree.parents], r))
                      for r in range(1, len(tree) + 1)}  # fmt: skip
        assert on_device == host_paths


def _path(tokens: list[int], parents: list[int], r: int) -> list[int]:
    out = []
    while r:
        out.append(tokens[r])
        r = parents[r]
    return out[::-1]


@pytest.fixture(scope="module")
def batch_prompts() -> list[list[int]]:
    """Eight prompts of different lengths (two cross a block boundary)."""
    return PROMPTS + [list(range(60, 77)), [3, 4], list(range(200, 230)), [9] * 11]


def _ar(target, prompts: list[list[int]]) -> dict[str, list[int]]:
    tokens, _ = run(eagle_core(target, None), [GenerateRequest(str(i), p, greedy(TOKENS))
                                               for i, p in enumerate(prompts)])  # fmt: skip
    return tokens


def test_tree_bursts_decode_exactly_alone_and_in_a_batch(eagle_target, eagle_head, batch_prompts):
    ref = _ar(eagle_target, batch_prompts)
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    ran = record_bursts(core)
    tokens, _ = run(core, [GenerateRequest("a", batch_prompts[0], greedy(TOKENS),
                                           "speculative", TREE)])  # fmt: skip
    assert tokens["a"] == ref["0"]
    assert ran and all(not shape.is_chain for _, shape, _ in ran) and max(n for *_, n in ran) > 1
    requests = [GenerateRequest(str(i), p, greedy(TOKENS), "speculative", TREE)
                for i, p in enumerate(batch_prompts)]  # fmt: skip
    ran.clear()
    tokens, _ = run(core, requests)
    assert tokens == ref
    assert max(b for b, *_ in ran) == len(batch_prompts)
    assert free(core)


def test_an_accepted_path_off_the_first_rows_moves_its_keys_and_values(
    eagle_target, eagle_head, monkeypatch
):
    """Each cycle's tree gets the true continuation planted on the path to its last row (rows
    far from their depths), so every cycle accepts a whole path there: the accepted rows' keys
    and values are moved to their positions' slots and the head catches up on them; the next
    cycles, and the whole output, are AR's (as if those tokens were decoded one by one)."""
    prompts = [PROMPTS[1], PROMPTS[2]]
    ref = _ar(eagle_target, prompts)
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    loop = core.decoders["speculative"].eagle.cycles
    order: list[str] = []
    real_run = loop.run

    def run_cycles(seqs, roots, shape, n):
        order[:] = [s.request_id for s in seqs]
        return real_run(seqs, roots, shape, n)

    loop.run = run_cycles
    moved = []
    real = cycles_module.draft_tree

    def planted(*args):
        tree = real(*args)
        last = tree.tokens.shape[1] - 1
        for b, rid in enumerate(order):
            truth = prompts[int(rid)] + ref[rid]
            base = int(loop.base[b])
            on_path = tree.sees[b, last].nonzero()[:, 0].tolist()
            for r in range(1, last + 1):
                pos = base + int(tree.depths[b, r])
                if pos >= len(truth):
                    continue
                if r in on_path:
                    tree.tokens[b, r] = truth[pos]
                    moved.append(r != int(tree.depths[b, r]))
                elif int(tree.tokens[b, r]) == truth[pos]:
                    tree.tokens[b, r] = (truth[pos] + 1) % len(loop.draft_ids)
        return tree

    monkeypatch.setattr(cycles_module, "draft_tree", planted)
    requests = [GenerateRequest(str(i), p, greedy(TOKENS), "speculative", TREE)
                for i, p in enumerate(prompts)]  # fmt: skip
    tokens, stats = run(core, requests)
    assert tokens == ref
    assert any(moved)
    assert all(s["tokens_per_pass"] > 1.5 for s in stats.values())
    # and alone, after a batch has left the cache's slots dirty
    order.clear()
    tokens, _ = run(core, [replace(requests[1], request_id="1")])
    assert tokens["1"] == ref["1"]


def test_tree_shapes_fit_what_eagle2_can_draft():
    assert TreeShape.of(8, 3, 3) == TreeShape(9, 3, 3)
    assert TreeShape.of(64, 2, 2) == TreeShape(7, 2, 2)  # 2 + 4 candidates
    assert TreeShape.of(2, 4, 3) == TreeShape(3, 2, 3)  # no deeper than its nodes
    assert TreeShape.chain(4) == TreeShape(5, 4, 1) and TreeShape.chain(4).is_chain
