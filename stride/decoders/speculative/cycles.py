"""EAGLE on the device: several draft → verify → accept cycles per host sync, chains and trees.

At batch 1 a verification pass of this model costs about what the host spends between two
passes (sync, commit, schedule, pack), so a cycle that goes through the host pays twice. Here
a whole cycle is tensor work on the device, replayed as one CUDA graph per (batch bucket,
`TreeShape`); a chain of K drafts is the tree with one child per level:

1. drafts: a chain drafts token 1 from the head's output for the last real row (`g`), then
   K - 1 head rows each read the draft before and the output before (the head's argmax, or in
   a sampled cycle a draw from the head's distribution under each row's own temperature,
   top-k, top-p and min-p); a tree is EAGLE-2's
   (`device_tree.draft_tree`): `topk` head rows per level, in scratch slots past the root's,
   each seeing the prefix and its ancestors' rows;
2. verify: the target scores [tail, drafts] (N rows per sequence, in the N slots from the
   tail's, each a decode row at the position after its parent's that sees the prefix, its
   ancestors and itself: `DecodeMetadata.tree_mask`, a chain's the causal one; the rows of a
   sequence are one tree for the attention kernel, which reads their prefix once) and hands
   out their hidden states;
3. accept (`verify.accept_greedy`): the longest path of drafts equal to the target's argmax
   after their parents; the target's argmax after it is the bonus token (a sampled tree: its
   draws instead, `_drawn`; a sampled chain: `verify.verify`, the rejection rule, then a draw
   from the residual or the bonus distribution; every uniform and draw from `counter` keyed by
   the request's seed and the token's position, as on the host, so a seeded request's tokens
   do not depend on the path or the batch; greedy rows of the batch have one-hot
   distributions); the committed tokens
   of the cycle go to an output buffer; a tree's accepted rows then move their keys and values
   to the slots of the positions they take (`device_tree.compact`);
4. catch up: depth + 1 head rows read the accepted path's hidden states and the token after
   each (a draft, or the bonus), in the slots of their positions: row n's output is the next
   cycle's `g`.

Rows past the accepted ones write keys and values (target and head) that the next cycle
overwrites before anything reads them: every row writes its slot before attending, and attends
only to the prefix and its own rows. Only rows with nothing for the host to do between tokens
(no penalties, bias, grammar, logprobs: `bursts.runnable`). Elsewhere than on a GPU with graphs
the same code runs eagerly (what the CPU tests check).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stride.decoders import counter
from stride.decoders.speculative.device_tree import DraftedTree, TreeShape, compact, draft_tree
from stride.decoders.speculative.draws import row_probabilities
from stride.decoders.speculative.layout import Fixed, Rows, reach
from stride.decoders.speculative.verify import accept_greedy, verify
from stride.engine.eagle import HeadRunner
from stride.engine.fused import FusedHead
from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.engine.runner import ModelRunner
from stride.engine.sequence import SamplingParams

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8)  # batch sizes with graphs: bursts pay where the host is a large share
STREAMS = (counter.TARGET, counter.DRAFT, counter.ACCEPT)  # `bases`' rows: stream s is row s
GREEDY_ROW = SamplingParams(temperature=0.0).draw_row  # padding rows' settings
Pick = Callable[[torch.Tensor, int], torch.Tensor]  # (head outputs, draft j) -> token ids


@dataclass
class CycleResult:
    """What `EagleCycles.run` leaves: committed tokens on their way to the host, each
    sequence's new `g` (its last real row's head output) on the device, and the cycles' own
    time: on a GPU, events around their replays (read once the copy has arrived, no sync of its
    own); elsewhere, measured as they ran."""

    tokens: torch.Tensor  # [cycles, B, depth + 1] (host), -1 past each cycle's committed tokens
    counts: torch.Tensor  # [cycles, B] tokens committed per cycle
    roots: torch.Tensor  # [B, H]
    copied: torch.cuda.Event | None
    cycles_timed: tuple[torch.cuda.Event, torch.cuda.Event] | float

    def per_sequence(self) -> list[list[list[int]]]:
        """Each sequence's committed tokens, cycle by cycle (waits for the copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens, counts = self.tokens.tolist(), self.counts.tolist()
        return [
            [tokens[c][b][: counts[c][b]] for c in range(len(counts))]
            for b in range(len(counts[0]))
        ]

    def cycle_seconds(self) -> float:
        """The cycles' time on the device, seconds (after `per_sequence`)."""
        if isinstance(self.cycles_timed, float):
            return self.cycles_timed
        start, end = self.cycles_timed
        return start.elapsed_time(end) / 1e3


class EagleCycles:
    """The device loop of one target and one head (see the module docstring)."""

    def __init__(self, runner: ModelRunner, heads: HeadRunner, max_cycles: int = 8) -> None:
        self.runner, self.heads, self.head = runner, heads, heads.head
        self.model = runner.model
        self.vocab = runner.model.config.vocab_size
        self.block_size = runner.cache.block_size
        device = runner.cache.k.device
        self.graphs = runner.graphs is not None
        # launch a batch's next burst at its commit, before the host's work (`bursts.Ahead`):
        # where cycles are graphs, whose replays the host work between bursts would leave idle
        self.ahead = self.graphs
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
        # sampled cycles: each row's settings (`draw_row`) and its key bases in each stream
        self.floats = torch.tensor([GREEDY_ROW] * b, dtype=torch.float32, device=device)
        self.bases = torch.zeros(len(STREAMS), b, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, TreeShape], torch.cuda.CUDAGraph] = {}
        self._constants: dict[tuple[int, TreeShape], Fixed] = {}
        self._pool = None

    def fits(self, seqs, cycles: int, shape: TreeShape, starts: list[int] | None = None) -> bool:
        """Can a burst of these sequences run here (batch, depth, cycles, graph width), from
        their cached lengths or `starts`?"""
        if len(seqs) > BUCKETS[-1] or shape.depth > self.max_depth or cycles > self.max_cycles:
            return False
        if not self.graphs:
            return True
        start = max(s.num_cached for s in seqs) if starts is None else max(starts)
        blocks = -(-(start + reach(shape, cycles)) // self.block_size)
        return blocks <= self.tables.shape[1]

    def warm(self, batch: int, shape: TreeShape) -> bool:
        """Has a burst of `batch` sequences in `shape` run here before (its graph captured)?"""
        return not self.graphs or (next(b for b in BUCKETS if b >= batch), shape) in self._graphs

    def run(self, seqs, roots: torch.Tensor, shape: TreeShape, cycles: int) -> CycleResult:
        """`cycles` cycles of `shape` for `seqs` (each with KV slots reserved for
        `num_cached + reach(shape, cycles)` tokens), from their roots `g` [B, H]."""
        n = len(seqs)
        bucket = next(b for b in BUCKETS if b >= n)
        graph = self._graph(bucket, shape) if self.graphs else None  # (captured before packing)
        self._copy_tables(seqs, bucket)
        base = torch.ones(bucket, dtype=torch.long)  # padding rows: block 0, never handed out
        base[:n] = torch.tensor([s.num_cached for s in seqs])
        tail = torch.zeros(bucket, dtype=torch.long)
        tail[:n] = torch.tensor([s.token_ids[-1] for s in seqs])
        self.base[:bucket].copy_(base, non_blocking=True)
        self.tail[:bucket].copy_(tail, non_blocking=True)
        self.g[:bucket].zero_()
        self.g[:n].copy_(roots)
        if shape.sampled:
            rows = [s.params.draw_row for s in seqs] + [GREEDY_ROW] * (bucket - n)
            bases = np.zeros((len(STREAMS), bucket), dtype=np.int64)
            bases[:, :n] = [counter.bases([s.seed for s in seqs], st) for st in STREAMS]
            self.floats[:bucket].copy_(torch.tensor(rows, dtype=torch.float32), non_blocking=True)
            self.bases[:, :bucket].copy_(torch.from_numpy(bases), non_blocking=True)
        return self._replay(n, bucket, shape, cycles, graph)

    def resume(self, rows, shape: TreeShape, cycles: int) -> CycleResult:
        """`cycles` more cycles of `shape` on the rows of the last `run` or `resume` (`rows`:
        their sequences in the same order, None for one that ended: its row runs on block 0,
        which is never handed out), from where those left them on the device (positions, last
        tokens, roots, sampling rows), without waiting for their tokens: what a burst launched
        ahead runs (`bursts.Ahead`). Each sequence needs KV slots for `reach(shape, cycles)`
        tokens past the cached length the last cycles leave it."""
        n = len(rows)
        bucket = next(b for b in BUCKETS if b >= n)
        graph = self._graph(bucket, shape) if self.graphs else None
        self._copy_tables(rows, bucket)  # (with the blocks reserved since)
        # Rows of no sequence (ended ones, the bucket's padding) start again where `run` starts
        # padding rows: every cycle moves a row's positions on, which would otherwise leave the
        # block tables after enough bursts launched ahead in a row.
        idle = [r for r, seq in enumerate(rows) if seq is None] + list(range(n, bucket))
        if idle:
            at = torch.tensor(idle).to(self.base.device, non_blocking=True)
            self.base.index_fill_(0, at, 1)
        return self._replay(n, bucket, shape, cycles, graph)

    def _copy_tables(self, seqs, bucket: int) -> None:
        """The sequences' block tables to the device (rows past them, and None's: block 0, never
        handed out; copied in stream order, after any cycles still reading them)."""
        width = max(len(s.block_table) for s in seqs if s is not None)
        if not self.graphs and self.tables.shape[1] < width:
            self.tables = torch.zeros(len(self.tables), width, dtype=torch.int32,
                                      device=self.base.device)  # fmt: skip
        tables = torch.zeros(bucket, self.tables.shape[1], dtype=torch.int32)
        for i, s in enumerate(seqs):
            if s is not None:
                tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        self.tables[:bucket].copy_(tables, non_blocking=True)

    def _replay(self, n: int, bucket: int, shape: TreeShape, cycles: int, graph) -> CycleResult:
        """Run `cycles` cycles from the state on the device; their tokens start on their way to
        the host."""
        self.cycle.zero_()
        cuda = self.base.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            began = time.perf_counter()
        for _ in range(cycles):
            if graph is not None:
                graph.replay()
            else:
                self._cycle(bucket, shape)
        tokens = self.tokens[:cycles, :n, : shape.advance]
        counts = self.counts[:cycles, :n]
        if not cuda:
            return CycleResult(tokens, counts, self.g[:n].clone(), None,
                               time.perf_counter() - began)  # fmt: skip
        end.record()
        tokens = tokens.to("cpu", non_blocking=True)
        counts = counts.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return CycleResult(tokens, counts, self.g[:n].clone(), copied, (start, end))

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

    def _fixed(self, b: int, shape: TreeShape) -> Fixed:
        fixed = self._constants.get((b, shape))
        if fixed is None:  # (made eagerly: a graph is captured only after a first eager cycle)
            fixed = self._constants[(b, shape)] = Fixed.of(b, shape, self.base.device)
        return fixed

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of head outputs (in the head's dtype on the GPU)."""
        if isinstance(self.head_forward, FusedHead):
            return self.head_forward.logits(h, self.lm_weight)
        return self.head.logits(h)

    def _best(self, h: torch.Tensor) -> torch.Tensor:
        """The most likely draft of each head output, as a target token id."""
        if isinstance(self.head_forward, FusedHead):
            return self.draft_ids[self.head_forward.best(h, self.lm_weight)]
        return self.draft_ids[self.head.logits(h).argmax(-1)]

    def _draw(self, h: torch.Tensor, j: int, qs: list[torch.Tensor], ranks: int) -> torch.Tensor:
        """A sampled cycle's draft j of each head output: a draw from the head's distribution
        under the row's settings, keyed by the row's seed and the draft's position (as
        `drafters.run_drafts` draws on the host); its distribution over the target's
        vocabulary goes to `qs`."""
        b = len(h)
        probs = row_probabilities(self._logits(h), self.floats[:b], ranks)
        ids = self.draft_ids.expand(b, -1)
        keys = counter.keys_at(self.bases[counter.DRAFT, :b], self.base[:b] + 1 + j)
        picked = counter.pick(probs, keys, ids, self.vocab)
        qs.append(probs.new_zeros(b, self.vocab).scatter_(1, ids, probs))
        return self.draft_ids[picked]

    def _draft_chain(self, b: int, k: int, rows: Rows, fixed: Fixed, pick: Pick) -> DraftedTree:
        """`pick(h, j)`: draft j of the head outputs `h` [B, H], as target token ids."""
        g, tables = self.g[:b], self.tables[:b]
        # chain row j (at context index base + j - 1) reads draft j: its slot, context length
        # and position as [B] vectors of their own (one copy each, not a computation per row)
        slots, lens = rows.slots.t().contiguous(), rows.lens.t().contiguous()
        positions = rows.at.t()
        h, d = g, pick(g, 0)
        drafts = [d]
        kv = (self.heads.k, self.heads.v)
        for j in range(1, k):
            meta = DecodeMetadata(slots[j - 1], tables, lens[j - 1], self.block_size)
            h = self.head_forward(d, h, positions[j - 1], kv, meta)
            d = pick(h, j)
            drafts.append(d)
        return DraftedTree(torch.cat([self.tail[:b, None], torch.stack(drafts, 1)], 1),
                           *fixed.chain)  # fmt: skip

    def _draft_tree(self, b: int, shape: TreeShape, rows: Rows, fixed: Fixed) -> DraftedTree:
        k, levels = shape.topk, shape.depth - 1

        # Every level's rows at once: scratch row s of a sequence (level s // k + 1, row s % k)
        # sits in the slot of context index base + s, at position base + s // k.
        def by_level(x: torch.Tensor) -> torch.Tensor:  # [B, scratch] -> [levels, B * k]
            return x[:, : shape.scratch].view(b, levels, k).transpose(0, 1).reshape(levels, b * k)

        slots, lens = by_level(rows.slots), by_level(rows.lens)
        positions = by_level(self.base[:b, None] + fixed.scratch_levels)
        tables = fixed.per_row(self.tables[:b], k)
        starts = fixed.per_row(self.base[:b], k)
        kv = (self.heads.k, self.heads.v)

        def expand(level: int, tokens, hidden, sees) -> torch.Tensor:
            meta = DecodeMetadata(slots[level - 1], tables, lens[level - 1], self.block_size,
                                  starts, sees)  # fmt: skip
            return self.head_forward(tokens, hidden, positions[level - 1], kv, meta)

        def logprobs(h: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(self._logits(h).float(), -1)

        return draft_tree(shape, self.g[:b], self.tail[:b], expand, logprobs, self.draft_ids,
                          fixed.tree)  # fmt: skip

    @torch.inference_mode()  # (eager, off the GPU: no autograd graph through the buffers)
    def _cycle(self, b: int, shape: TreeShape) -> None:
        base, tail, g, tables = self.base[:b], self.tail[:b], self.g[:b], self.tables[:b]
        fixed, n_rows, depth = self._fixed(b, shape), shape.nodes, shape.depth
        # every slot the cycle writes, from the tail's: context index base + s (s < span)
        at = base[:, None] + fixed.steps
        rows = Rows(at, self._slots(at, tables), (at + 1).to(torch.int32))
        # 1. drafts
        qs: list[torch.Tensor] = []  # a sampled chain's draft distributions
        drawn_chain = shape.sampled and shape.is_chain
        if drawn_chain:
            tree = self._draft_chain(
                b, depth, rows, fixed, lambda h, j: self._draw(h, j, qs, shape.ranks)
            )
        elif shape.is_chain:
            tree = self._draft_chain(b, depth, rows, fixed, lambda h, j: self._best(h))
        else:
            tree = self._draft_tree(b, shape, rows, fixed)
        # 2. verify every row in the N slots from the tail's, each at its parent's position + 1
        # (a tree's rows, a chain's too, share its prefix: the kernel reads it once for all)
        sees = fixed.causal if shape.is_chain else tree.sees.flatten(0, 1)
        meta = self._rows_meta(rows, n_rows, fixed, sees)
        positions = (base[:, None] + tree.depths).flatten()
        kv = (self.runner.cache.k, self.runner.cache.v)
        aux_layers = self.head.config.aux_layers
        hidden, aux = self.runner.forward_fn(tree.tokens.flatten(), positions, kv, meta,
                                             aux=aux_layers)  # fmt: skip
        logits = self.model.lm_head(hidden)
        steps = fixed.steps[: depth + 1]
        if drawn_chain:  # 3. accept by the rejection rule, then draw the token after
            n, bonus = self._accept_sampled(logits, tree.tokens[:, 1:], torch.stack(qs, 1), shape)
            path = torch.where(steps <= n[:, None], steps, 0)
        else:  # 3. accept the longest path of drafts equal to the target's choice, then its next
            if shape.sampled:  # (a sampled tree: its draws)
                best = self._drawn(logits, tree.depths, shape.ranks)
            else:
                best = logits.argmax(-1).view(b, n_rows)  # (in its dtype: the same argmax)
            n, path, bonus = accept_greedy(tree.tokens, tree.parents, tree.sees, tree.depths,
                                           best, depth)  # fmt: skip
        after = torch.cat([tree.tokens.gather(1, path[:, 1:]), bonus[:, None]], 1)
        after = torch.where(steps < n[:, None], after, bonus[:, None])  # the token after each
        committed = torch.where(steps <= n[:, None], after, -1)
        self.tokens[:, :b, : depth + 1].index_copy_(0, self.cycle, committed[None])
        self.counts[:, :b].index_copy_(0, self.cycle, (n + 1)[None])
        features = aux.view(b, n_rows, -1)
        if not shape.is_chain:  # (a chain's path is already where it belongs)
            compact([self.runner.cache.k, self.runner.cache.v], path, n,
                    lambda p: self._slots(p, tables), base)  # fmt: skip
            features = features.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
            meta = self._rows_meta(rows, depth + 1, fixed, fixed.causal)
        # 4. catch up: the path's head rows (a chain's are its verified rows, under the same
        # causal mask); row n's output drafts the next cycle
        outs = self.head_forward(after.flatten(), self.head.project(features.flatten(0, 1)),
                                 rows.at[:, : depth + 1].flatten(), (self.heads.k, self.heads.v),
                                 meta)  # fmt: skip
        outs = outs.view(b, depth + 1, -1)
        g.copy_(outs.gather(1, n[:, None, None].expand(b, 1, outs.shape[-1]))[:, 0])
        tail.copy_(bonus)
        base.add_(n + 1)
        self.cycle.add_(1)

    def _accept_sampled(
        self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, shape: TreeShape
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled chain's accepted drafts [B] and the token after them [B], from the target's
        logits [B * (K + 1), V] over [tail, drafts], the drafts [B, K] and their distributions
        q [B, K, V] in `shape`: `verify.verify`, its uniforms and the last draw keyed as
        `verify_sampled`'s."""
        b, k = drafts.shape
        p = row_probabilities(logits, Fixed.per_row(self.floats[:b], k + 1), shape.ranks)
        places = self.base[:b, None] + 1 + self._fixed(b, shape).steps[: k + 1]
        u = counter.unit(counter.keys_at(self.bases[counter.ACCEPT, :b, None], places[:, :k]))
        n, dist = verify(p.view(b, k + 1, -1), q, drafts, torch.full_like(self.base[:b], k), u)
        keys = counter.keys_at(self.bases[counter.TARGET, :b], places.gather(1, n[:, None])[:, 0])
        return n, counter.pick(dist, keys)

    def _drawn(self, logits: torch.Tensor, depths: torch.Tensor, ranks: int) -> torch.Tensor:
        """A sampled tree's target choices [B, N]: the target's draw after each of its rows
        (`logits` [B * N, V]), at the row's position and with the noise a plain step draws
        with there, as `verify.verify_drawn` draws on the host."""
        b, n = depths.shape
        p = row_probabilities(logits, Fixed.per_row(self.floats[:b], n), ranks)
        places = self.base[:b, None] + 1 + depths  # the token each row draws
        keys = counter.keys_at(self.bases[counter.TARGET, :b, None], places)
        return counter.pick(p, keys.flatten()).view(b, n)

    def _rows_meta(self, rows: Rows, r: int, fixed: Fixed, sees: torch.Tensor) -> DecodeMetadata:
        """Decode rows for the first `r` slots of every sequence's span, one tree of `r` rows
        per sequence under `sees` [B * r, r] (`DecodeMetadata.tree_rows`)."""
        b = len(rows.at)
        return DecodeMetadata(
            slot_mapping=rows.slots[:, :r].flatten(),
            block_tables=fixed.per_row(self.tables[:b], r),
            context_lens=rows.lens[:, :r].flatten(),
            block_size=self.block_size,
            tree_start=fixed.per_row(self.base[:b], r),
            tree_mask=sees,
            tree_rows=r,
        )
