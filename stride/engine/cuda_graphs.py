"""Decode steps replayed as CUDA graphs: one graph per bucketed batch size, over fixed buffers.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python, the
launches, not the GPU, set the pace. Each bucket's whole forward (embedding to fp32 logits) is
captured once at start-up and replayed with new inputs copied into the same buffers: token ids,
positions, the slot each new K/V goes to, context lengths and block tables, all packed in one
pinned int32 host array that travels in one asynchronous copy. Rows past the real batch point at
block 0, which the KV cache never hands out, so padding writes and reads only harmless slots.

A replay may also take masks (`run(..., masks=...)`): each row then sees its context before its
`tree_start` and, of the MASK_WIDTH slots from there on, those its mask row allows
(`DecodeMetadata.tree_mask`): lookahead's branches, a draft tree verified outside the device
loop. And a replay whose rows are one sequence's span (`one_span`: a prompt's uncached tail
after a prefix cache hit, a speculative or Jacobi proposal at batch 1) runs them as one tree
(`DecodeMetadata.tree_rows`): the kernel reads the span's context once for all its rows, where
row by row each would read it whole. Every layout's graphs are captured at start-up with the
plain ones: one captured when a step first needed it stalled that step (kernels compiled, a
warm-up, the capture), and the request that first used lookahead or a one-span tree paid it.
Where a MASK-slot adapter is attached (`capture_adapted`), masked replays whose MASK slots run
it (`run(..., adapted=True)`: `introspective`'s passes) have graphs of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import chain
from typing import Literal

import numpy as np
import torch

from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.engine.kv_cache import KVCache
from stride.engine.model import CausalLM

log = logging.getLogger(__name__)

# Columns of the packed input array; block tables follow from column TABLE on.
TOKEN, POSITION, SLOT, LENGTH, START, TABLE = range(6)
MASK_WIDTH = 64  # the slots a masked replay's rows have masks over (runner.MAX_GRAPH_QUERY)
# How a replay's rows attend, and whether MASK slots among them run the adapter (module
# docstring); LAYOUTS are captured at start-up, "adapted" by `capture_adapted`.
Layout = Literal["rows", "masked", "one_span", "adapted"]
LAYOUTS: tuple[Layout, ...] = ("rows", "masked", "one_span")


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, *range(96, max_batch + 1, 32)]
    return [b for b in sizes if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        forward: Callable[..., torch.Tensor],
        cache: KVCache,
        max_batch: int,
        max_blocks: int,
        aux: tuple[int, ...] = (),
    ) -> None:
        """`forward` has `CausalLM.forward`'s signature (the model itself or `FusedForward`);
        `aux`: layers whose outputs a replay asked for them (`run(..., aux=True)`) also leaves
        in `self.aux` (rows as in logits): each bucket then has a graph with and one without,
        so that steps nobody needs them for do not pay for the copies."""
        self.model = model
        self.forward = forward
        self.cache = cache
        self.max_blocks = max_blocks
        self.buckets = batch_buckets(max_batch)
        device = cache.k.device
        width = TABLE + max_blocks
        self._host = torch.zeros(max_batch, width, dtype=torch.int32, pin_memory=True)
        self._host_np = self._host.numpy()
        self._inputs = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event()
        self._masks_host = torch.zeros(max_batch, MASK_WIDTH, dtype=torch.bool, pin_memory=True)
        self._masks = torch.zeros(max_batch, MASK_WIDTH, dtype=torch.bool, device=device)
        self._pad_all()
        self._steps_host: torch.Tensor | None = None  # `run_steps`' inputs, one array per step
        self._steps_inputs: torch.Tensor | None = None
        vocab = model.config.vocab_size  # (split over ranks, the head all-gathers it whole)
        self._logits = torch.empty(max_batch, vocab, dtype=torch.float32, device=device)
        self._aux_layers = aux
        width = model.config.hidden_size * len(aux)
        self.aux = torch.empty(max_batch, width, dtype=model.lm_head.weight.dtype, device=device)
        # (bucket, with aux, layout) -> graph
        self._graphs: dict[tuple[int, bool, Layout], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.adapted = False  # graphs for `run(..., adapted=True)` captured?
        variants = (False, True) if self._aux_layers else (False,)
        self._capture([
            (b, with_aux, layout)
            for b in reversed(self.buckets)  # largest first, so smaller ones reuse its memory
            for with_aux in variants
            for layout in LAYOUTS
            if layout != "one_span" or 1 < b <= MASK_WIDTH
        ])  # fmt: skip

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def replay(self, batch: int) -> None:
        """Replay bucket `batch`'s graph on whatever its buffers hold (timing the device alone:
        bench/bench_gpu.py)."""
        self._graphs[self._bucket(batch), False, "rows"].replay()

    def _step(self, batch: int, with_aux: bool, layout: Layout = "rows") -> None:
        x = self._inputs[:batch]
        masked = layout != "rows"
        meta = DecodeMetadata(
            slot_mapping=x[:, SLOT].long(),  # index_copy_ wants int64
            block_tables=x[:, TABLE:],
            context_lens=x[:, LENGTH].contiguous(),  # once per step, not once per layer
            block_size=self.cache.block_size,
            tree_start=x[:, START].contiguous() if masked else None,
            tree_mask=self._masks[:batch] if masked else None,
            tree_rows=batch if layout == "one_span" else 0,
        )
        tokens, positions, kv = x[:, TOKEN], x[:, POSITION], (self.cache.k, self.cache.v)
        if with_aux:
            hidden, aux = self.forward(tokens, positions, kv, meta, aux=self._aux_layers)
            self.aux[:batch].copy_(aux)
        elif layout == "adapted":
            hidden = self.forward(tokens, positions, kv, meta, adapted=True)
        else:
            hidden = self.forward(tokens, positions, kv, meta)
        self._logits[:batch].copy_(self.model.logits(hidden))

    def capture_adapted(self) -> None:
        """Capture the graphs of `run(..., adapted=True)`, once `forward` runs MASK slots with
        an adapter (`FusedForward.adapt`). The buffers are reset to padding first: the warm-up
        steps then write only block 0, whatever a replay left in them."""
        self._copied.synchronize()
        self._pad_all()
        self._capture([(b, False, "adapted") for b in reversed(self.buckets)])
        self.adapted = True

    def _pad_all(self) -> None:
        """Every row of the buffers a padding row (see `_pack`): one slot of block 0, a mask
        that sees it."""
        self._host_np[:] = 0
        self._host_np[:, LENGTH] = 1
        self._inputs.copy_(self._host)
        self._masks_host[:] = False
        self._masks_host[:, 0] = True
        self._masks.copy_(self._masks_host)

    @torch.inference_mode()
    def _capture(self, shapes: list[tuple[int, bool, Layout]]) -> None:
        """Capture `shapes`; padding rows (block 0, a mask of their own slot) make the warm-up
        steps harmless. A one-span replay has 2 to MASK_WIDTH rows."""
        for shape in shapes:  # compile kernels, create library handles, outside any capture
            self._step(*shape)
        torch.cuda.synchronize()
        for shape in shapes:
            self._graphs[shape] = self._captured(*shape)
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs for batch sizes %s", len(shapes), self.buckets)

    def _captured(self, batch: int, with_aux: bool, layout: Layout) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(batch, with_aux, layout)
        self._pool = graph.pool()
        return graph

    def run(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        tables: list[list[int]],
        aux: bool = False,
        fed: tuple[list[tuple[int, int]], torch.Tensor] | None = None,
        masks: tuple[list[int], torch.Tensor] | None = None,
        one_span: bool = False,
        adapted: bool = False,
    ) -> torch.Tensor:
        """One decode step for len(tokens) sequences; returns their [B, vocab] fp32 logits.

        `lengths` counts each sequence's context including the new token, whose K/V goes to the
        slot of position `lengths - 1` in its block table. `aux`: leave the rows' hidden states
        of the `aux` layers in `self.aux` too. `fed`: (row, source) pairs and a device tensor:
        those rows take their token from that row of the tensor, not from `tokens`. `masks`:
        each row's tree start and its mask [B, <= MASK_WIDTH] (bool, host) over the slots from
        there (a row that sees its whole context: its own slot, and a mask of one True).
        `one_span`: the rows are one sequence's, their masks over its span (all of them then
        start where the span does): its context is read once for them all. The padding rows
        join that tree: its block table and start, a context reaching its first slot.
        `adapted`: MASK slots among the rows run the adapter (`capture_adapted`; needs masks).
        """
        n = len(tokens)
        bucket = self._bucket(n)
        layout: Layout = "rows" if masks is None else "one_span" if one_span else "masked"
        if adapted:
            assert masks is not None and not one_span, "an adapted replay is a masked one"
            layout = "adapted"
        graph = self._graphs[bucket, aux, layout]
        self._copied.synchronize()  # the previous step's copy has left the pinned buffers
        self._pack(self._host_np, tokens, positions, lengths, tables, bucket)
        if masks is not None:
            starts, mask = masks
            self._host_np[:n, START] = starts
            self._host_np[n:bucket, START] = 0
            self._masks_host[:bucket] = False
            self._masks_host[:n, : mask.shape[1]] = mask
            self._masks_host[n:bucket, 0] = True  # padding rows see their first slot
            if one_span:  # (padding rows keep slot 0 of block 0 for their own K/V)
                self._host_np[n:bucket, TABLE:] = self._host_np[0, TABLE:]
                self._host_np[n:bucket, START] = starts[0]
                self._host_np[n:bucket, LENGTH] = starts[0] + 1
            self._masks[:bucket].copy_(self._masks_host[:bucket], non_blocking=True)
        self._inputs[:bucket].copy_(self._host[:bucket], non_blocking=True)
        self._copied.record()
        if fed is not None:
            pairs, source = fed
            pairs_t = torch.tensor(pairs).to(source.device, non_blocking=True)
            self._inputs[pairs_t[:, 0], TOKEN] = source[pairs_t[:, 1]].to(self._inputs.dtype)
        graph.replay()
        # A copy: the next replay overwrites the buffer while a caller may still hold these rows.
        return self._logits[:n].clone()

    def run_steps(
        self,
        tokens: list[int] | torch.Tensor,
        positions: list[int],
        lengths: list[int],
        tables: list[list[int]],
        steps: int,
        sample: Callable[[torch.Tensor, int], torch.Tensor],
        aux_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`steps` decode steps in a row with no host sync: step s+1's input tokens are step s's
        `sample(logits, s)`, copied on the device. Returns the sampled tokens [steps, B] (device).
        `aux_out` [steps, B, width]: where each step leaves its rows' `aux` hidden states.

        Step 0's tokens are host ints, or a device tensor (holding the last samples of a launch
        still in flight: copied like a later step's, so nothing waits for that launch).
        Every sequence must have KV slots reserved for `steps` new tokens; step s writes the K/V
        of position `lengths - 1` + s.
        """
        n = len(lengths)
        fed = tokens if isinstance(tokens, torch.Tensor) else None  # fed on the device
        bucket = self._bucket(n)
        width = self._host.shape[1]
        if self._steps_host is None or len(self._steps_host) < steps * bucket:
            shape = (steps * self.max_batch, width)  # steps x bucket rows, back to back
            self._steps_host = torch.zeros(shape, dtype=torch.int32, pin_memory=True)
            self._steps_inputs = torch.zeros(shape, dtype=torch.int32, device=self._inputs.device)
        packed = steps * bucket  # rows of a contiguous prefix: one asynchronous copy
        host = self._steps_host[:packed].numpy().reshape(steps, bucket, width)
        self._copied.synchronize()
        self._pack(host[0], tokens if fed is None else 0, positions, lengths, tables, bucket)
        for s in range(1, steps):
            host[s] = host[0]
            host[s, :n, POSITION] += s
            host[s, :n, LENGTH] += s
            self._slots(host[s], n)
        inputs = self._steps_inputs[:packed]
        inputs.copy_(self._steps_host[:packed], non_blocking=True)
        self._copied.record()
        inputs = inputs.view(steps, bucket, width)
        sampled = torch.empty(steps, n, dtype=torch.long, device=self._inputs.device)
        graph = self._graphs[bucket, aux_out is not None, "rows"]
        for s in range(steps):
            self._inputs[:bucket].copy_(inputs[s])
            if fed is not None:
                self._inputs[:n, TOKEN].copy_(fed)
            graph.replay()
            if aux_out is not None:
                aux_out[s].copy_(self.aux[:n])
            sampled[s] = sample(self._logits[:n], s)
            fed = sampled[s]
        return sampled

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _pack(self, h: np.ndarray, tokens, positions, lengths, tables, bucket: int) -> None:
        """Write one step's rows into the packed array `h` and pad it up to `bucket` rows.

        `tokens`: a list, or one int for all rows (placeholders for tokens fed on the device)."""
        n = len(lengths)
        h[:n, TOKEN] = tokens
        h[:n, POSITION] = positions
        h[:n, LENGTH] = lengths
        # Block tables, ragged, scattered into their rows in one go.
        widths = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(widths.sum()))
        rows = np.repeat(np.arange(n), widths)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(widths) - widths, widths)
        h[rows, TABLE + cols] = flat
        self._slots(h, n)
        h[n:bucket, :TABLE] = 0
        h[n:bucket, LENGTH] = 1  # one slot of block 0: something to attend to, harmlessly

    def _slots(self, h: np.ndarray, n: int) -> None:
        """Each row's new K/V slot: position `length - 1` through its block table."""
        last = h[:n, LENGTH] - 1
        bs = self.cache.block_size
        h[:n, SLOT] = h[np.arange(n), TABLE + last // bs] * bs + last % bs
