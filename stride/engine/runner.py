"""One forward pass of the target model over everything the scheduler picked this step.

Each `Span` is one sequence's share of the ragged batch: the tokens to score (its uncached tail,
or a prefix of it during chunked prefill, then whatever its decoder proposed), their positions,
an optional mask among them, and how many trailing rows need logits. Keys and values of every
scored token are written to the slots right after the sequence's cached ones; the decoder's
commit decides how many of them stay.

On a GPU the layers run through fused Triton kernels (`fused.FusedForward`), and short spans
(a decode token, a speculative tail plus its drafts, a Jacobi window, lookahead's masked
branches) skip the general path: each of their tokens becomes one row of a decode step replayed
as a CUDA graph (`cuda_graphs.DecodeGraphs`), masked rows under their span's mask. A step that
is one span over a long context replays as one tree (`ONE_SPAN_READ`): its context is read once
for all its rows. Masked spans whose context the graphs cannot hold run as decode rows of one
eager pass (`_forward_rows`), and whatever else the step holds (prefill chunks) runs eagerly on
the general path. All write disjoint KV slots, so the split is invisible to callers.

A span may hold MASK slots (`adapter.MASK_TOKEN`, the `introspective` refine method): with a
`MaskAdapter` attached, a pass that has any runs the module forward with the adapter gated to
their rows; where the fused kernels run, the adapter is merged into them too
(`FusedForward.adapt`) and such spans replay as rows of graphs of their own
(`DecodeGraphs.capture_adapted`), else as decode rows of an eager pass (`_forward_rows`).

A sequence whose `features` list is set (an EAGLE-drafted one) also gets, for every token this
pass scores, the residual stream after the layers `capture_features` named, appended to that
list as one [tokens, width] tensor per pass: the draft head reads them without extra passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from stride.engine import fused
from stride.engine.adapter import MASK_TOKEN, MaskAdapter
from stride.engine.attention import use_planless_sdpa
from stride.engine.cuda_graphs import MASK_WIDTH, DecodeGraphs
from stride.engine.kernels.decode_attention import decode_kernel_supported
from stride.engine.kv_cache import KVCache
from stride.engine.model import CausalLM
from stride.engine.sequence import Sequence
from stride.engine.spans import Span, decode_rows, graph_masks, prepare, span_mask

# A span replays as rows of the decode graph (no per-kernel launches: a prefill's host work
# falls from ~20 ms to one replay) while it has at most MAX_GRAPH_QUERY tokens and its rows read
# at most GRAPH_KV_READ bytes of K/V: each row reads its whole context, which one eager pass
# (flash attention) reads once, so long spans over long contexts stay eager. Short prompts and
# the suffixes of prefix-cached prompts are such spans.
MAX_GRAPH_QUERY = 64
GRAPH_KV_READ = 4 << 30
# A step that is one sequence's span of several tokens (a prompt's tail after a prefix cache
# hit, a proposal at batch 1) replays as one tree, its context read once for all its rows, once
# its rows would read at least this many context tokens row by row: below it, the row kernel's
# many small programs finish sooner than the tree kernel's few.
ONE_SPAN_READ = 16384


class SampledTokens:
    """Tokens [steps, B] sampled on the device by a launch, their copy to the host queued right
    behind them: reading them waits for their own launch only, not for one queued after it (the
    executor's next launch, fed from these on the device), which a plain `.tolist()` would."""

    def __init__(self, on_device: torch.Tensor) -> None:
        self.on_device = on_device
        self.steps = len(on_device)
        self._copied: torch.cuda.Event | None = None
        self._host = on_device
        if on_device.is_cuda:
            self._host = on_device.to("cpu", non_blocking=True)  # into pinned memory
            self._copied = torch.cuda.Event()
            self._copied.record()

    def per_sequence(self) -> list[list[int]]:
        """Each sequence's tokens, in step order (synchronises with this burst)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.T.tolist()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        device: torch.device,
        cuda_graphs: bool = True,
        fused_kernels: bool = True,
        max_graph_batch: int = 256,
        max_graph_context: int = 8192,
        all_reduce: str = "auto",
    ) -> None:
        """`all_reduce`: how a rank of a split model sums decode-sized products (`collectives`)."""
        self.model = model
        self.cache = cache
        self.device = device
        use_planless_sdpa(device)
        self.forward_fn = model
        if fused_kernels and fused.supported(model, device):
            self.forward_fn = fused.FusedForward(model, all_reduce)
        self.aux_layers: tuple[int, ...] = ()  # see `capture_features`
        self.adapter: MaskAdapter | None = None  # see `attach_adapter`
        # The whole model's K/V per token (from its config, not this rank's cache): ranks of a
        # split model must all pick the same spans for the graph, or their collectives differ.
        config, attn = model.config, model.model.layers[0].self_attn
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        item = cache.k.element_size()
        self._kv_bytes_per_token = 2 * model.num_layers * kv_heads * attn.head_dim * item
        self.graphs: DecodeGraphs | None = None
        head_dim = model.model.layers[0].self_attn.head_dim
        self._graph_args = None
        if cuda_graphs and decode_kernel_supported(device, head_dim):
            max_len = getattr(model.config, "max_position_embeddings", None) or max_graph_context
            max_blocks = -(-min(max_len, max_graph_context) // cache.block_size)
            self._graph_args = (max_graph_batch, max_blocks)
            self.graphs = DecodeGraphs(model, self.forward_fn, cache, max_graph_batch, max_blocks)

    def capture_features(self, layers: tuple[int, ...]) -> None:
        """From now on, passes capture the outputs of `layers` for sequences with `features`
        (the decode graphs are captured again to write them too)."""
        if layers == self.aux_layers:
            return
        self.aux_layers = tuple(layers)
        if self._graph_args is not None:
            self.graphs = None  # free the old graphs' memory pool first
            self.graphs = DecodeGraphs(
                self.model, self.forward_fn, self.cache, *self._graph_args, aux=self.aux_layers
            )
            self._adapt_graphs()

    def release_graphs(self) -> None:
        """Drop the decode graphs (and any collectives they captured: a tensor-parallel group
        cannot be left while they live); passes run eagerly from now on."""
        self.graphs = None
        self._graph_args = None  # (`capture_features` would capture them again)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def attach_adapter(self, adapter: MaskAdapter) -> None:
        """From now on, MASK slots in spans run `adapter` (on their rows only)."""
        self.adapter = adapter.attach(self.model)
        fast = self.forward_fn
        if isinstance(fast, fused.FusedForward) and not fast.parallel:
            fast.adapt(adapter)
            self._adapt_graphs()

    def _adapt_graphs(self) -> None:
        """Capture the graphs for spans with MASK slots, where the fused kernels run them."""
        fast = self.forward_fn
        if self.graphs is not None and isinstance(fast, fused.FusedForward) and fast.adapted:
            self.graphs.capture_adapted()

    def can_feed(self, slots: int) -> bool:
        """Can a decode row whose context holds `slots` slots take its token from the device
        (a fed row: where graphs run, it must be one of their rows)?"""
        graphs = self.graphs
        return graphs is None or -(-slots // self.cache.block_size) <= graphs.max_blocks

    @torch.inference_mode()
    def forward(
        self,
        spans: list[Span],
        num_layers: int | None = None,
        fed: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Score all spans in one pass; returns each span's [num_logits, vocab] fp32 logits.
        `fed`: the device tokens that fed spans read (`Span.fed`); those replay as graph rows."""
        graphs = self.graphs
        if graphs is None or num_layers not in (None, self.model.num_layers):
            return self._forward_eager(spans, num_layers, fed=fed)
        out: list[torch.Tensor | None] = [None] * len(spans)
        if len(spans) == 1 and self._one_span(spans[0]):
            self._forward_graph(spans, [0], out, fed, one_span=True)
            return out  # type: ignore[return-value]
        groups: dict[bool, list[int]] = {False: [], True: []}  # by: holds MASK slots?
        filled = {False: 0, True: 0}  # each group's rows
        for i, c in enumerate(spans):
            if not self._graphable(c):
                if c.fed is not None:
                    raise ValueError(f"a fed span of {c.seq.request_id} does not fit the graphs")
                continue
            adapted = MASK_TOKEN in c.token_ids
            if filled[adapted] + len(c.token_ids) > graphs.max_batch:
                self._forward_graph(spans, groups[adapted], out, fed, adapted=adapted)
                groups[adapted], filled[adapted] = [], 0
            groups[adapted].append(i)
            filled[adapted] += len(c.token_ids)
        for adapted, group in groups.items():
            if group:
                self._forward_graph(spans, group, out, fed, adapted=adapted)
        rows = [i for i, o in enumerate(out) if o is None and self._as_rows(spans[i])]
        if rows:
            for i, logits in zip(rows, self._forward_rows([spans[i] for i in rows]), strict=True):
                out[i] = logits
        rest = [i for i, o in enumerate(out) if o is None]
        if rest:
            eager = self._forward_eager([spans[i] for i in rest], num_layers)
            for i, logits in zip(rest, eager, strict=True):
                out[i] = logits
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def decode_steps(
        self,
        seqs: list[Sequence],
        tokens: list[int] | torch.Tensor,
        steps: int,
        sample: Callable[[torch.Tensor, int], torch.Tensor],
        offsets: list[int] | None = None,
    ) -> SampledTokens:
        """`steps` decode steps of one token per sequence, each step's input the last one's sample.

        Step 0 feeds `tokens`: each sequence's first token as host ints, or as a device tensor
        (where some are the last samples of a launch not yet committed, which this one
        continues: sequence i's positions then start `offsets[i]` past its `num_cached`).
        `sample` maps step s's [B, vocab] logits and s to [B] token ids on the device. Every
        sequence needs KV slots for `offsets[i] + steps` new tokens. With CUDA graphs the steps
        are queued with no host sync in between, so the host's per-step work (commit, schedule,
        pack) is paid once per `steps` tokens; elsewhere each step is an eager pass.
        """
        offsets = offsets or [0] * len(seqs)
        graphs = self.graphs
        if graphs is not None and self.decodes_in_graphs(seqs):
            tables = [s.block_table for s in seqs]
            starts = [s.num_cached + o for s, o in zip(seqs, offsets, strict=True)]
            lengths = [s + 1 for s in starts]
            aux = None
            if self.aux_layers and any(s.features is not None for s in seqs):
                aux = graphs.aux.new_empty(steps, len(seqs), graphs.aux.shape[1])
            made = graphs.run_steps(tokens, starts, lengths, tables, steps, sample, aux)
            if aux is not None:  # each step's rows, as the eager steps below hand them out
                for i, seq in enumerate(seqs):
                    if seq.features is not None:
                        seq.features.append(aux[:, i])
            return SampledTokens(made)
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)
        sampled = []
        for s in range(steps):
            # One placeholder token per span: the ids themselves come from `tokens`.
            spans = [Span(seq, [0], 1, offset=o + s) for seq, o in zip(seqs, offsets, strict=True)]
            tokens = sample(torch.cat(self._forward_eager(spans, None, tokens)), s)
            sampled.append(tokens)
        return SampledTokens(torch.stack(sampled))

    def decodes_in_graphs(self, seqs: list[Sequence]) -> bool:
        """Do `decode_steps` of these sequences replay the decode graphs (their `sample` then
        reads a view of the graphs' logits buffer: the same memory at every step)?"""
        graphs = self.graphs
        return (
            graphs is not None
            and len(seqs) <= graphs.max_batch
            and all(len(s.block_table) <= graphs.max_blocks for s in seqs)
        )

    def _graphable(self, c: Span) -> bool:
        """Short spans replay as graph rows: a decode token, K drafts, a Jacobi window, and
        masked ones (lookahead's branches) whose mask covers at most MASK_WIDTH slots."""
        n = len(c.token_ids)
        context = c.seq.num_cached + c.offset + n
        return self._fits_graphs(c) and n * context * self._kv_bytes_per_token <= GRAPH_KV_READ

    def _one_span(self, c: Span) -> bool:
        """Does a step of this span alone replay as one tree (`ONE_SPAN_READ`)?"""
        n = len(c.token_ids)
        return (
            n > 1
            and n * (c.seq.num_cached + c.offset) >= ONE_SPAN_READ
            and self._fits_graphs(c)
            and MASK_TOKEN not in c.token_ids
        )

    def _fits_graphs(self, c: Span) -> bool:
        """Can the decode graphs' buffers hold this span's rows: their count, mask width and
        block table (MASK slots: and graphs that run the adapter)?"""
        return (
            len(c.token_ids) <= MAX_GRAPH_QUERY
            and (c.mask is None or c.mask.shape[1] <= MASK_WIDTH)
            and len(c.seq.block_table) <= self.graphs.max_blocks
            and (self.graphs.adapted or MASK_TOKEN not in c.token_ids)
        )

    def _as_rows(self, c: Span) -> bool:
        """A short masked span that the graphs cannot take (its context is longer than their
        block tables, or it holds MASK slots) runs as decode rows of an eager pass
        (`_forward_rows`); long ones, a prompt with a proposal riding along, stay on the
        general path, which reads a context once."""
        n = len(c.token_ids)
        context = c.seq.num_cached + c.offset + n
        return (
            (c.mask is not None or MASK_TOKEN in c.token_ids)
            and n <= MAX_GRAPH_QUERY
            and n * context * self._kv_bytes_per_token <= GRAPH_KV_READ
        )

    def _forward_rows(self, spans: list[Span]) -> list[torch.Tensor]:
        """Masked spans as decode rows of one eager pass: each token a row whose context ends at
        its own slot and that sees, of the slots its span's mask covers, what the mask allows
        (`DecodeMetadata.tree_mask`). The paged decode kernel reads each row's keys from its
        blocks: no padded gather of every context, no dense mask, no per-layer SDPA of a dozen
        kernels (the general path's cost, which made a lookahead step 20 plain ones)."""
        meta, ids, at, logit_rows = decode_rows(spans, self.cache.block_size, self.device)
        forward_fn, ids, gate = self._with_adapter(spans, ids)
        with gate:
            hidden = self._layers(forward_fn, spans, ids, at, meta, None)
        logits = self.model.logits(hidden[logit_rows])
        return list(logits.split([c.num_logits for c in spans]))

    def _forward_eager(
        self,
        spans: list[Span],
        num_layers: int | None,
        tokens: torch.Tensor | None = None,
        fed: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """`tokens`, if given, replaces the spans' token ids (already on the device); `fed`:
        the tokens that fed spans read (`Span.fed`)."""
        meta, packed, positions, rows = prepare(spans, self.cache.block_size, self.device)
        tokens = packed if tokens is None else tokens
        if fed is not None:
            feeds, row = [], 0  # (packed row, row of `fed`)
            for c in spans:
                if c.fed is not None:
                    feeds.append((row, c.fed))
                row += len(c.token_ids)
            pairs = torch.tensor(feeds).to(self.device, non_blocking=True)
            tokens = tokens.clone()
            tokens[pairs[:, 0]] = fed[pairs[:, 1]]
        forward_fn, tokens, gate = self._with_adapter(spans, tokens)
        with gate:
            hidden = self._layers(forward_fn, spans, tokens, positions, meta, num_layers)
        logits = self.model.logits(hidden[rows])
        return list(logits.split([c.num_logits for c in spans]))

    def _with_adapter(
        self, spans: list[Span], tokens: torch.Tensor
    ) -> tuple[Callable, torch.Tensor, contextlib.AbstractContextManager]:
        """The forward for these spans' packed rows (`tokens`), and the context it runs in: the
        module forward with the adapter gated to their MASK slots' rows, if they hold any."""
        masked = _mask_rows(spans) if self.adapter is not None else []
        if not masked:
            return self.forward_fn, tokens, contextlib.nullcontext()
        # The slots' embedding comes from the adapter: any id will do for the lookup.
        rows = torch.tensor(masked).to(self.device, non_blocking=True)
        return self.model, tokens.clamp(min=0), self.adapter.on_rows(rows)

    def _layers(self, forward_fn, spans, tokens, positions, meta, num_layers) -> torch.Tensor:
        """The layers over the spans' packed rows; their sequences that collect features get
        theirs (`capture_features`) when every layer ran."""
        kv = (self.cache.k, self.cache.v)
        if num_layers is None and self._wants_features(spans):
            hidden, aux = forward_fn(tokens, positions, kv, meta, aux=self.aux_layers)
            _hand_out(spans, range(len(spans)), aux)
            return hidden
        return forward_fn(tokens, positions, kv, meta, num_layers)

    def _wants_features(self, spans: list[Span]) -> bool:
        return bool(self.aux_layers) and any(c.seq.features is not None for c in spans)

    def _forward_graph(
        self,
        spans: list[Span],
        group: list[int],
        out: list[torch.Tensor | None],
        fed: torch.Tensor | None,
        one_span: bool = False,
        adapted: bool = False,
    ) -> None:
        """Replay the decode graph with one row per token of the grouped spans (`one_span`:
        one span, its rows one tree: `_one_span`; `adapted`: their MASK slots run the adapter).

        Token i of a span is a decode row whose context ends at itself: every layer writes all
        rows' K/V before any row attends, so row i sees rows 0..i-1 of its span, which is
        exactly causal attention over the span. A masked span's rows see, of the slots its
        mask covers, what the mask allows; when the group has one, the other rows' masks let
        each see its own slot (and, before it, its whole context).
        """
        tokens: list[int] = []
        positions: list[int] = []
        lengths: list[int] = []
        tables: list[list[int]] = []
        feeds: list[tuple[int, int]] = []  # (graph row, row of `fed`)
        for i in group:
            c = spans[i]
            start, n = c.seq.num_cached + c.offset, len(c.token_ids)
            if c.fed is not None:
                feeds.append((len(tokens), c.fed))
            tokens += c.token_ids
            positions += c.positions or range(start, start + n)
            lengths += range(start + 1, start + n + 1)
            tables += [c.seq.block_table] * n
        features = self._wants_features([spans[i] for i in group])
        fed_rows = (feeds, fed) if feeds else None
        if one_span:
            masks = span_mask(spans[group[0]], lengths)
        else:
            masks = graph_masks([spans[i] for i in group], lengths, always=adapted)
        logits = self.graphs.run(
            tokens, positions, lengths, tables, features, fed_rows, masks, one_span, adapted
        )
        if features:
            _hand_out(spans, group, self.graphs.aux[: len(tokens)])
        offset = 0
        for i in group:
            c = spans[i]
            offset += len(c.token_ids)
            out[i] = logits[offset - c.num_logits : offset]


def _mask_rows(spans: list[Span]) -> list[int]:
    """The packed rows of the spans' MASK slots."""
    out: list[int] = []
    offset = 0
    for c in spans:
        if MASK_TOKEN in c.token_ids:
            out.extend(offset + i for i, t in enumerate(c.token_ids) if t == MASK_TOKEN)
        offset += len(c.token_ids)
    return out


def _hand_out(spans: list[Span], which, aux: torch.Tensor) -> None:
    """Append each listed span's rows of `aux` (packed in span order) to its sequence's
    `features`, as a copy (a graph's buffer is overwritten by the next replay)."""
    offset = 0
    for i in which:
        c = spans[i]
        n = len(c.token_ids)
        if c.seq.features is not None:
            c.seq.features.append(aux[offset : offset + n].clone())
        offset += n
