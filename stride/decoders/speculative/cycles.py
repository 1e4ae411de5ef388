"""EAGLE on the device: several draft → verify → accept cycles per host sync, chains and trees.

At batch 1 a verification pass of this model costs about what the host spends between two
passes (sync, commit, schedule, pack), so a cycle that goes through the host pays twice. Here
a whole cycle is tensor work on the device, replayed as one CUDA graph per (batch bucket,
`TreeShape`); a chain of K drafts is the tree with one child per level:

1. drafts: a chain drafts token 1 from the head's output for the last real row (`g`), then
   K - 1 head rows each read the draft before and the output before; a tree is EAGLE-2's
   (`device_tree.draft_tree`): `topk` head rows per level, in scratch slots past the root's,
   each seeing the prefix and its ancestors' rows;
2. verify: the target scores [tail, drafts] (N rows per sequence, in the N slots from the
   tail's, each a decode row at the position after its parent's that sees the prefix, its
   ancestors and itself: `DecodeMetadata.tree_mask`, a chain's the causal one; the rows of a
   sequence are one tree for the attention kernel, which reads their prefix once) and hands
   out their hidden states;
3. accept (`verify.accept_greedy`): the longest path of drafts equal to the target's argmax
   after their parents; the target's argmax after it is the bonus token; the committed tokens
   of the cycle go to an output buffer; a tree's accepted rows then move their keys and values
   to the slots of the positions they take (`device_tree.compact`);
4. catch up: depth + 1 head rows read the accepted path's hidden states and the token after
   each (a draft, or the bonus), in the slots of their positions: row n's output is the next
   cycle's `g`.

Rows past the accepted ones write keys and values (target and head) that the next cycle
overwrites before anything reads them: every row writes its slot before attending, and attends
only to the prefix and its own rows. Greedy only, and only for plain greedy rows (no penalties,
bias, logprobs): acceptance is the argmax, computed here. Elsewhere than on a GPU with graphs
the same code runs eagerly (what the CPU tests check).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stride.decoders.speculative.device_tree import (
    DraftedTree,
    TreeShape,
    chain_tree,
    compact,
    draft_tree,
)
from stride.decoders.speculative.verify import accept_greedy
from stride.engine.eagle import HeadRunner
from stride.engine.fused import FusedHead
from stride.engine.kernels import layer as kernels
from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.engine.runner import ModelRunner

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8)  # batch sizes with graphs: bursts pay where the host is a large share


@dataclass
class CycleResult:
    """What `EagleCycles.run` leaves: committed tokens on their way to the host, and each
    sequence's new `g` (its last real row's head output) on the device."""

    tokens: torch.Tensor  # [cycles, B, depth + 1] (host), -1 past each cycle's committed tokens
    counts: torch.Tensor  # [cycles, B] tokens committed per cycle
    roots: torch.Tensor  # [B, H]
    copied: torch.cuda.Event | None

    def per_sequence(self) -> list[list[list[int]]]:
        """Each sequence's committed tokens, cycle by cycle (waits for the copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens, counts = self.tokens.tolist(), self.counts.tolist()
        return [
            [tokens[c][b][: counts[c][b]] for c in range(len(counts))]
            for b in range(len(counts[0]))
        ]


class EagleCycles:
    """The device loop of one target and one head (see the module docstring)."""

    def __init__(self, runner: ModelRunner, heads: HeadRunner, max_cycles: int = 8) -> None:
        self.runner, self.heads, self.head = runner, heads, heads.head
        self.model = runner.model
        self.block_size = runner.cache.block_size
        device = runner.cache.k.device
        self.graphs = runner.graphs is not None
        self.head_forward = FusedHead(self.head) if self.graphs and FusedHead.supported(
            self.head) else self.head  # fmt: skip
        self.draft_ids = self.head.draft_ids
        self.lm_weight = self.head.head_weight()
        b, width = BUCKETS[-1], runner.graphs.max_blocks if self.graphs else 0
        hidden = self.head.config.hidden_size
        self.max_cycles, self.max_depth = max_cycles, 16
        self.base = torch.zeros(b, dtype=torch.long, device=device)
        self.tail = torch.zeros(b, dtype=torch.long, device=device)
        self.g = torch.zeros(b, hidden, dtype=self.head.fc.weight.dtype, device=device)
        self.tables = torch.zeros(b, width, dtype=torch.int32, device=device)
        self.cycle = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.full((max_cycles, b, self.max_depth + 1), -1, dtype=torch.long,
                                 device=device)  # fmt: skip
        self.counts = torch.zeros(max_cycles, b, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, TreeShape], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def fits(self, seqs, cycles: int, shape: TreeShape) -> bool:
        """Can a burst of these sequences run here (batch, depth, cycles, graph width)?"""
        if len(seqs) > BUCKETS[-1] or shape.depth > self.max_depth or cycles > self.max_cycles:
            return False
        if not self.graphs:
            return True
        blocks = -(-(max(s.num_cached for s in seqs) + reach(shape, cycles)) // self.block_size)
        return blocks <= self.tables.shape[1]

    def warm(self, batch: int, shape: TreeShape) -> bool:
        """Has a burst of `batch` sequences in `shape` run here before (its graph captured)?"""
        return not self.graphs or (next(b for b in BUCKETS if b >= batch), shape) in self._graphs

    def run(self, seqs, roots: torch.Tensor, shape: TreeShape, cycles: int) -> CycleResult:
        """`cycles` cycles of `shape` for `seqs` (each with KV slots reserved for
        `num_cached + reach(shape, cycles)` tokens), from their roots `g` [B, H]."""
        n, device = len(seqs), self.base.device
        bucket = next(b for b in BUCKETS if b >= n)
        graph = self._graph(bucket, shape) if self.graphs else None  # (captured before packing)
        width = max(len(s.block_table) for s in seqs)
        if not self.graphs and self.tables.shape[1] < width:
            self.tables = torch.zeros(len(self.tables), width, dtype=torch.int32, device=device)
        tables = torch.zeros(bucket, self.tables.shape[1], dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        base = torch.ones(bucket, dtype=torch.long)  # padding rows: block 0, never handed out
        base[:n] = torch.tensor([s.num_cached for s in seqs])
        tail = torch.zeros(bucket, dtype=torch.long)
        tail[:n] = torch.tensor([s.token_ids[-1] for s in seqs])
        self.tables[:bucket].copy_(tables, non_blocking=True)
        self.base[:bucket].copy_(base, non_blocking=True)
        self.tail[:bucket].copy_(tail, non_blocking=True)
        self.g[:bucket].zero_()
        self.g[:n].copy_(roots)
        self.cycle.zero_()
        for _ in range(cycles):
            if graph is not None:
                graph.replay()
            else:
                self._cycle(bucket, shape)
        tokens = self.tokens[:cycles, :n, : shape.advance]
        counts = self.counts[:cycles, :n]
        copied = None
        if device.type == "cuda":
            tokens = tokens.to("cpu", non_blocking=True)
            counts = counts.to("cpu", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return CycleResult(tokens, counts, self.g[:n].clone(), copied)

    def replay_ms(self, batch: int, shape: TreeShape, context: int = 0, repeats: int = 50) -> float:
        """GPU time of one cycle (its graph replayed alone): what a cycle costs the device, against
        which a cycle's wall time shows the host's share. Rows on padding (block 0), or with
        `context` > 0 each on blocks of its own from block 1 on, `context` tokens in: it writes
        into those blocks, so nothing may be running (a benchmark's measurement)."""
        bucket = next(b for b in BUCKETS if b >= batch)
        graph = self._graph(bucket, shape)
        self.tables.zero_()
        if context:
            width = -(-(context + reach(shape, 1)) // self.block_size)
            blocks = 1 + torch.arange(bucket * width, device=self.tables.device)
            self.tables[:bucket, :width] = blocks.view(bucket, width).to(torch.int32)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.base.fill_(max(context, 1))
        graph.replay()
        start.record()
        for _ in range(repeats):
            self.cycle.zero_()
            self.base.fill_(max(context, 1))
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    def _graph(self, bucket: int, shape: TreeShape) -> torch.cuda.CUDAGraph:
        graph = self._graphs.get((bucket, shape))
        if graph is None:
            # Warm up (kernels compiled, handles made) on padding rows, then capture.
            self.tables[:bucket].zero_()
            self.base[:bucket].fill_(1)
            self.cycle.zero_()
            self._cycle(bucket, shape)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._cycle(bucket, shape)
            self._pool = graph.pool()
            self._graphs[(bucket, shape)] = graph
            log.info("captured EAGLE cycle graph: batch %d, %s", bucket, shape)
        return graph

    def _slots(self, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The cache slots of `positions` [B, J] under the sequences' block tables [B, W]."""
        bs = self.block_size
        return tables.gather(1, positions // bs).long() * bs + positions % bs

    def _meta(
        self,
        slots_at: torch.Tensor,
        tables: torch.Tensor,
        tree: tuple | None = None,
        tree_rows: int = 0,
    ) -> DecodeMetadata:
        """Decode rows writing the slots of context index `slots_at` [R] (their own context
        ends there), under `tree` = (tree_start [R], tree_mask [R, N]) if given; `tree_rows`:
        the rows are whole trees of that many rows (`DecodeMetadata.tree_rows`)."""
        return DecodeMetadata(
            slot_mapping=self._slots(slots_at[:, None], tables)[:, 0],
            block_tables=tables,
            context_lens=(slots_at + 1).to(torch.int32),
            block_size=self.block_size,
            tree_start=None if tree is None else tree[0],
            tree_mask=None if tree is None else tree[1].contiguous(),
            tree_rows=tree_rows,
        )

    def _head_rows(self, tokens, hidden, positions, tables, tree=None, tree_rows=0) -> torch.Tensor:
        kv = (self.heads.k, self.heads.v)
        meta = self._meta(positions, tables, tree, tree_rows)
        return self.head_forward(tokens, hidden, positions, kv, meta)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of head outputs."""
        if isinstance(self.head_forward, FusedHead):
            x = kernels.rms_norm(h, self.head.norm, None)
            return F.linear(x, self.lm_weight).float()
        return self.head.logits(h)

    def _draft_chain(self, b: int, k: int) -> DraftedTree:
        base, g, tables = self.base[:b], self.g[:b], self.tables[:b]
        h, d = g, self.draft_ids[self._logits(g).argmax(-1)]
        drafts = [d]
        for j in range(1, k):  # chain row j (position base + j - 1) reads draft j
            h = self._head_rows(d, h, base + (j - 1), tables)
            d = self.draft_ids[self._logits(h).argmax(-1)]
            drafts.append(d)
        return chain_tree(self.tail[:b], torch.stack(drafts, 1))

    def _draft_tree(self, b: int, shape: TreeShape) -> DraftedTree:
        k, levels = shape.topk, shape.depth - 1
        base, tables = self.base[:b], self.tables[:b]
        # Every level's rows at once: scratch row s of a sequence (level s // k + 1, row s % k)
        # sits in the slot of context index base + s, at position base + s // k.
        steps = torch.arange(shape.scratch, device=base.device)
        at = base[:, None] + steps

        def by_level(x: torch.Tensor) -> torch.Tensor:  # [B, scratch] -> [levels, B * k]
            return x.view(b, levels, k).transpose(0, 1).reshape(levels, b * k)

        slots, lens = by_level(self._slots(at, tables)), by_level(at + 1).to(torch.int32)
        positions = by_level(base[:, None] + steps // k)
        row_tables, starts = tables.repeat_interleave(k, 0), base.repeat_interleave(k)
        kv = (self.heads.k, self.heads.v)

        def expand(level: int, tokens, hidden, sees) -> torch.Tensor:
            meta = DecodeMetadata(slots[level - 1], row_tables, lens[level - 1], self.block_size,
                                  starts, sees)  # fmt: skip
            return self.head_forward(tokens, hidden, positions[level - 1], kv, meta)

        def logprobs(h: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(self._logits(h), -1)

        return draft_tree(shape, self.g[:b], self.tail[:b], expand, logprobs, self.draft_ids)

    def _cycle(self, b: int, shape: TreeShape) -> None:
        base, tail, g, tables = self.base[:b], self.tail[:b], self.g[:b], self.tables[:b]
        # 1. drafts
        tree = self._draft_chain(b, shape.depth) if shape.is_chain else self._draft_tree(b, shape)
        n_rows, depth = shape.nodes, shape.depth
        # 2. verify every row in the N slots from the tail's, each at its parent's position + 1
        slots_at = (base[:, None] + torch.arange(n_rows, device=base.device)).flatten()
        row_tables = tables.repeat_interleave(n_rows, 0)
        # (a tree's rows, a chain's too, share its prefix: the kernel reads it once for all)
        mask = (base.repeat_interleave(n_rows), tree.sees.flatten(0, 1))
        meta = self._meta(slots_at, row_tables, mask, n_rows)
        positions = (base[:, None] + tree.depths).flatten()
        kv = (self.runner.cache.k, self.runner.cache.v)
        aux_layers = self.head.config.aux_layers
        hidden, aux = self.runner.forward_fn(tree.tokens.flatten(), positions, kv, meta,
                                             aux=aux_layers)  # fmt: skip
        best = self.model.logits(hidden).argmax(-1).view(b, n_rows)
        # 3. accept the longest path of drafts equal to the target's choice, then its next one
        n, path, bonus = accept_greedy(tree.tokens, tree.parents, tree.sees, tree.depths, best,
                                       depth)  # fmt: skip
        steps = torch.arange(depth + 1, device=base.device)
        after = torch.cat([tree.tokens.gather(1, path[:, 1:]), bonus[:, None]], 1)
        after = torch.where(steps < n[:, None], after, bonus[:, None])  # the token after each
        committed = torch.where(steps <= n[:, None], after, -1)
        self.tokens[:, :b, : depth + 1].index_copy_(0, self.cycle, committed[None])
        self.counts[:, :b].index_copy_(0, self.cycle, (n + 1)[None])
        if not shape.is_chain:  # (a chain's path is already where it belongs)
            compact([self.runner.cache.k, self.runner.cache.v], path, n,
                    lambda p: self._slots(p, tables), base)  # fmt: skip
        # 4. catch up: the path's head rows; row n's output drafts the next cycle
        features = aux.view(b, n_rows, -1).gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
        catch_up = (base[:, None] + steps).flatten()
        if n_rows != depth + 1:
            row_tables = tables.repeat_interleave(depth + 1, 0)
        causal = torch.ones(depth + 1, depth + 1, dtype=torch.bool, device=base.device).tril()
        path_rows = (base.repeat_interleave(depth + 1), causal.repeat(b, 1))  # a chain's mask
        outs = self._head_rows(after.flatten(), self.head.project(features.flatten(0, 1)),
                               catch_up, row_tables, path_rows, depth + 1)  # fmt: skip
        g.copy_(outs.view(b, depth + 1, -1)[torch.arange(b, device=n.device), n])
        tail.copy_(bonus)
        base.add_(n + 1)
        self.cycle.add_(1)


def reach(shape: TreeShape, cycles: int) -> int:
    """Slots past `num_cached` that `cycles` cycles of `shape` may write."""
    return cycles * shape.advance + shape.span
