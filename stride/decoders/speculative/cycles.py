"""Greedy EAGLE chains on the device: several draft → verify → accept cycles per host sync.

At batch 1 a verification pass of this model costs about what the host spends between two
passes (sync, commit, schedule, pack), so a cycle that goes through the host pays twice. Here
a whole cycle is tensor work on the device, replayed as one CUDA graph per (batch bucket, K):

1. drafts: the head's output for the last real row (`g`) drafts token 1; K - 1 head rows, each
   reading the draft before and the output before, draft the rest;
2. verify: the target scores [tail, drafts] (K + 1 rows per sequence, each a decode row whose
   context ends at itself) and hands out their hidden states;
3. accept: n = the drafts equal to the target's argmax before them; the target's argmax after
   them is the bonus token; the committed tokens of the cycle go to an output buffer;
4. catch up: K + 1 head rows read the verified rows' hidden states and the token after each
   (a draft, or the bonus): row n's output is the next cycle's `g`.

Rows past the accepted ones write keys and values (target and head) that the next cycle
overwrites before anything reads them: every row writes its slot before attending, and attends
only to slots up to its own. Greedy only, and only for plain greedy rows (no penalties, bias,
logprobs): acceptance is the argmax, computed here. Elsewhere than on a GPU with graphs the same
code runs eagerly (what the CPU tests check).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stride.engine.eagle import HeadRunner
from stride.engine.fused_head import FusedHead
from stride.engine.kernels import layer as kernels
from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.engine.runner import ModelRunner

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8)  # batch sizes with graphs: bursts pay where the host is a large share


@dataclass
class CycleResult:
    """What `EagleCycles.run` leaves: committed tokens on their way to the host, and each
    sequence's new `g` (its last real row's head output) on the device."""

    tokens: torch.Tensor  # [cycles, B, K + 1] (host), -1 past each cycle's committed tokens
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
        self.max_cycles, self.max_k = max_cycles, 16
        self.base = torch.zeros(b, dtype=torch.long, device=device)
        self.tail = torch.zeros(b, dtype=torch.long, device=device)
        self.g = torch.zeros(b, hidden, dtype=self.head.fc.weight.dtype, device=device)
        self.tables = torch.zeros(b, width, dtype=torch.int32, device=device)
        self.cycle = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.full((max_cycles, b, self.max_k + 1), -1, dtype=torch.long,
                                 device=device)  # fmt: skip
        self.counts = torch.zeros(max_cycles, b, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def fits(self, seqs, cycles: int, k: int) -> bool:
        """Can a burst of these sequences run here (batch, K, cycles, graph width)?"""
        if len(seqs) > BUCKETS[-1] or k > self.max_k or cycles > self.max_cycles:
            return False
        if not self.graphs:
            return True
        blocks = -(-(max(s.num_cached for s in seqs) + (cycles + 1) * (k + 1)) // self.block_size)
        return blocks <= self.tables.shape[1]

    def run(self, seqs, roots: torch.Tensor, k: int, cycles: int) -> CycleResult:
        """`cycles` cycles of K drafts for `seqs` (each with KV slots reserved for
        `num_cached + (cycles + 1) * (k + 1)` tokens), from their roots `g` [B, H]."""
        n, device = len(seqs), self.base.device
        bucket = next(b for b in BUCKETS if b >= n)
        graph = self._graph(bucket, k) if self.graphs else None  # (captured before packing)
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
                self._cycle(bucket, k)
        tokens, counts = self.tokens[:cycles, :n, : k + 1], self.counts[:cycles, :n]
        copied = None
        if device.type == "cuda":
            tokens = tokens.to("cpu", non_blocking=True)
            counts = counts.to("cpu", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return CycleResult(tokens, counts, self.g[:n].clone(), copied)

    def replay_ms(self, batch: int, k: int, repeats: int = 50) -> float:
        """GPU time of one cycle (its graph replayed alone, on padding rows): what a cycle costs
        the device, against which a cycle's wall time shows the host's share."""
        graph = self._graph(next(b for b in BUCKETS if b >= batch), k)
        self.tables.zero_()
        self.base.fill_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(repeats):
            self.cycle.zero_()
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    def _graph(self, bucket: int, k: int) -> torch.cuda.CUDAGraph:
        graph = self._graphs.get((bucket, k))
        if graph is None:
            # Warm up (kernels compiled, handles made) on padding rows, then capture.
            self.tables[:bucket].zero_()
            self.base[:bucket].fill_(1)
            self.cycle.zero_()
            self._cycle(bucket, k)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._cycle(bucket, k)
            self._pool = graph.pool()
            self._graphs[(bucket, k)] = graph
            log.info("captured EAGLE cycle graph: batch %d, %d drafts", bucket, k)
        return graph

    def _meta(self, positions: torch.Tensor, tables: torch.Tensor) -> DecodeMetadata:
        bs = self.block_size
        blocks = tables.gather(1, (positions // bs)[:, None])[:, 0].long()
        return DecodeMetadata(
            slot_mapping=blocks * bs + positions % bs,
            block_tables=tables,
            context_lens=(positions + 1).to(torch.int32),
            block_size=bs,
        )

    def _head_rows(self, tokens, hidden, positions, tables) -> torch.Tensor:
        kv = (self.heads.k, self.heads.v)
        return self.head_forward(tokens, hidden, positions, kv, self._meta(positions, tables))

    def _draft(self, h: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head_forward, FusedHead):
            x = kernels.rms_norm(h, self.head.norm, None)
            return self.draft_ids[F.linear(x, self.lm_weight).argmax(-1)]
        return self.draft_ids[self.head.logits(h).argmax(-1)]

    def _cycle(self, b: int, k: int) -> None:
        base, tail, g, tables = self.base[:b], self.tail[:b], self.g[:b], self.tables[:b]
        steps = torch.arange(k + 1, device=base.device)
        # 1. drafts: chain row j (position base + j - 1) reads draft j
        h, d = g, self._draft(g)
        drafts = [d]
        for j in range(1, k):
            h = self._head_rows(d, h, base + (j - 1), tables)
            d = self._draft(h)
            drafts.append(d)
        drafted = torch.stack(drafts, 1)  # [b, k]
        # 2. verify [tail, drafts] at positions base .. base + k
        positions = (base[:, None] + steps).flatten()
        row_tables = tables.repeat_interleave(k + 1, 0)
        tokens = torch.cat([tail[:, None], drafted], 1).flatten()
        kv = (self.runner.cache.k, self.runner.cache.v)
        meta = self._meta(positions, row_tables)
        aux_layers = self.head.config.aux_layers
        hidden, aux = self.runner.forward_fn(tokens, positions, kv, meta, aux=aux_layers)
        best = self.model.logits(hidden).argmax(-1).view(b, k + 1)
        # 3. accept the drafts equal to the target's choice before them, then its next choice
        n = (drafted == best[:, :k]).long().cumprod(1).sum(1)
        bonus = best.gather(1, n[:, None])[:, 0]
        after = torch.cat([drafted, bonus[:, None]], 1)  # the token after each verified row
        after = torch.where(steps < n[:, None], after, bonus[:, None])
        committed = torch.where(steps <= n[:, None], after, -1)
        self.tokens[:, :b, : k + 1].index_copy_(0, self.cycle, committed[None])
        self.counts[:, :b].index_copy_(0, self.cycle, (n + 1)[None])
        # 4. catch up: each verified row's head row; row n's output drafts the next cycle
        outs = self._head_rows(after.flatten(), self.head.project(aux), positions, row_tables)
        g.copy_(outs.view(b, k + 1, -1)[torch.arange(b, device=n.device), n])
        tail.copy_(bonus)
        base.add_(n + 1)
        self.cycle.add_(1)
