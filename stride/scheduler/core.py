"""The step loop's body: schedule, let decoders propose, one forward, let decoders commit.

`EngineCore` is single-threaded and synchronous; `client.EngineClient` runs it on its own thread
and feeds it through queues. Every admitted request leaves through exactly one terminal output.

Fault isolation: one request's failure is that request's error (`internal_error`), never the
engine's. Work done per sequence (admission, a decoder's `extra_tokens`, applying a commit,
detokenizing, finishing) fails the sequence it raised for. A batched call (a decoder's
`propose` or `commit` over its sequences, a model group's step) that raises cannot be pinned on
one of them: its sequences drop their decoder state (as on preemption), become suspects, and are
run again in halves, one half per step with the decoder's other sequences held back, until the
one that fails alone is found and failed (bisection: a few steps for one culprit). A forward
pass that raises is retried one sequence at a time; sequences whose forward fails alone fail,
and only if none succeeds does the step raise: then the engine is broken, and the client
declares it dead (and restarts it).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.base import (
    Burst,
    Commit,
    Decoder,
    DecoderError,
    ModelGroup,
    Proposal,
    StepContext,
)
from stride.decoders.grammar import GrammarError, Grammars
from stride.decoders.registry import build_decoders
from stride.engine.engine import Engine
from stride.engine.kv_cache import OutOfBlocks
from stride.engine.runner import Chunk, SampledTokens
from stride.engine.sequence import Sequence, Status
from stride.scheduler import prompt_logprobs
from stride.scheduler.detokenizer import Detokenizer
from stride.scheduler.outputs import (
    EngineError,
    GenerateRequest,
    QueueFull,
    RequestOutput,
    RequestRejected,
    StepStats,
)
from stride.scheduler.policy import Scheduled, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

FUSE_MAX_BATCH = 8  # bursts of several decode steps only for batches up to this size


@dataclass
class _Launched:
    """A forward pass started but not yet committed: its plan, proposals and logits rows."""

    plan: list[Scheduled]
    by_decoder: dict[str, list[int]]  # plan indices that complete their tail, by decoder
    proposals: list[Proposal | None]
    logits: list[torch.Tensor]
    tokens: SampledTokens | None = None  # fused decode steps: [steps, plan] tokens, no logits
    burst: Burst | None = None  # a decoder's passes on the device (`Decoder.burst`)


class EngineCore:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig | None = None,
        decoders: dict[str, Decoder] | None = None,
    ) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.scheduler = Scheduler(self.config, engine.cache, engine.max_model_len)
        self.decoders = decoders or build_decoders(engine)
        self.grammars = Grammars(engine.tokenizer, engine.hf_config.vocab_size, engine.eos_ids)
        self.ctx = StepContext(eos_ids=engine.eos_ids, device=engine.device, engine=engine)
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._grouped: dict[str, Sequence] = {}  # sequences that a model group runs
        self._num_deadlines = 0  # sequences in flight with a deadline
        # Decoders whose commit is a plain per-row sample, and how many sequences use others.
        self._plain = {n for n, d in self.decoders.items() if type(d) is Autoregressive}
        self._unplain: Counter[str] = Counter()
        # On a GPU, the next step's forward is launched before this step's text is decoded.
        self.launch_ahead = engine.runner.graphs is not None
        self._launched: _Launched | None = None
        steps = self.config.fused_decode_steps
        self.fused_decode_steps = steps if steps is not None else 8 if self.launch_ahead else 1
        # A fused burst's continuation is launched before the burst is committed (`_chain`):
        # on the CPU everything is synchronous, and it would only make arrivals wait longer.
        self.chain_fused = self.launch_ahead
        graphs = engine.runner.graphs
        self._max_burst_batch = graphs.max_batch if graphs is not None else 1 << 30
        self.last_batch_size = 0
        self.last_num_tokens = 0
        # Fault isolation: per batch (a decoder's name, a model group), groups of request ids
        # to run apart, first group first; and failed requests' outputs for this step.
        self._suspects: dict[Hashable, list[set[str]]] = {}
        self._failed: list[RequestOutput] = []
        self._broken: dict[str, tuple[Exception, str]] = {}  # during scheduling
        # Prompt logprobs: the rows of this launch's chunks that score prompt tokens (plan
        # index -> first position, count), and after the forward their logits, until commit.
        self._prompt_rows: dict[int, tuple[int, int]] = {}
        self._prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = []
        # Everything alive now (model, tokenizer, graphs, imported modules) lives as long as the
        # loop: keep it out of the cyclic collector, whose full passes over that heap would
        # otherwise stall a step for hundreds of ms every few dozen steps. Collect first, so that
        # garbage of earlier engines (tests make many) is not frozen with it.
        gc.collect()
        gc.freeze()

    # ---- admission and cancellation ---------------------------------------------------------

    def add(self, req: GenerateRequest) -> None:
        """Admit a request or raise RequestRejected / QueueFull; nothing else is touched then.

        An error of Stride's own while admitting (not the request's fault) is this request's
        RequestRejected with code `internal_error`: nothing was added, the loop goes on.
        """
        try:
            seq, detok, grouped = self._admissible(req)
        except (QueueFull, RequestRejected):
            raise
        except Exception as e:
            log.exception("admitting request %s failed", req.request_id)
            raise RequestRejected(
                f"internal error while admitting the request: {type(e).__name__}",
                code="internal_error",
            ) from e
        self.seqs[seq.request_id] = seq
        self._num_deadlines += seq.deadline is not None
        if seq.decoder not in self._plain:
            self._unplain[seq.decoder] += 1
        self._detok[seq.request_id] = detok
        if grouped:  # a model of the decoder's own runs it (diffusion); see _step_groups
            seq.status = Status.RUNNING
            self._grouped[seq.request_id] = seq
        else:
            self.scheduler.enqueue(seq)

    def _admissible(self, req: GenerateRequest) -> tuple[Sequence, Detokenizer, bool]:
        """Check `req` and build what admitting it adds: its sequence, detokenizer, and whether
        a model group runs it. Touches nothing."""
        if req.request_id in self.seqs:
            raise RequestRejected(f"duplicate request id {req.request_id!r}")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFull("the waiting queue is full")
        n_prompt, p = len(req.prompt_ids), req.params
        if n_prompt == 0:
            raise RequestRejected("the prompt is empty", param="prompt")
        if n_prompt + p.max_tokens > self.engine.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {n_prompt} and max_tokens asks for {p.max_tokens}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        cache = self.engine.cache
        if -(-(n_prompt + p.max_tokens) // cache.block_size) > cache.num_usable_blocks:
            raise RequestRejected(
                "prompt plus max_tokens do not fit in this server's KV cache",
                code="context_length_exceeded",
                param="max_tokens",
            )
        vocab = self.engine.hf_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_ids):
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        decoder = self.decoders.get(req.decoder)
        if decoder is None:
            raise RequestRejected(
                f"unknown decoder {req.decoder!r}; valid decoders: {', '.join(self.decoders)}",
                code="invalid_decoder",
                param="decoder",
            )
        try:
            options = decoder.validate(p, req.decoder_options)
        except DecoderError as e:
            raise RequestRejected(str(e), code="invalid_decoder", param="decoder") from e

        seq = Sequence(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            params=p,
            decoder=req.decoder,
            decoder_options=options,
            priority=req.priority,
            deadline=None if req.timeout is None else time.monotonic() + req.timeout,
        )
        grouped = decoder.model_group(seq) is not None
        if p.constraint is not None:
            if grouped:
                raise RequestRejected(
                    f"structured outputs are not supported by decoder {req.decoder!r} "
                    f"with these options ({seq.decoder_options})",
                    code="invalid_decoder",
                    param="decoder",
                )
            try:
                seq.grammar = self.grammars.matcher(p.constraint)
            except GrammarError as e:
                raise RequestRejected(str(e), param="response_format") from e
        if p.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token has no logprob
        if p.seed is not None:
            seq.generator = torch.Generator(self.engine.device).manual_seed(p.seed)
        decoder.admit(seq)  # (what the decoder sets up on the new sequence only)
        detok = Detokenizer(self.engine.tokenizer, p.stop, p.skip_special_tokens)
        return seq, detok, grouped

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        return None if seq is None else self._finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.seqs)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> StepStats:
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.engine.cache.usage,
            batch_size=self.last_batch_size,
            num_tokens=self.last_num_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
        )

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._expire_deadlines()
        untexted: list[tuple[RequestOutput, Detokenizer]] = []
        if self._grouped:
            outputs += self._step_groups(untexted)
        launched, self._launched = self._launched or self._launch(), None
        if launched is not None:
            # A fused burst whose plan goes on is followed on the device before it is committed.
            self._launched = self._chain_guarded(launched)
            self._commit(launched, outputs, untexted, chained=self._launched is not None)
            if self._launched is None and self._may_launch_ahead():
                self._launched = self._launch()
        # Decoding text last: with a forward launched ahead, this runs while the GPU computes.
        for out, detok in untexted:
            try:
                out.text = detok.take(final=False)
            except Exception as e:
                self._fail(self.seqs.get(out.request_id), e, "detokenizing")
        outputs += self._failed
        self._failed = []
        return outputs

    def _may_launch_ahead(self) -> bool:
        """Launch the next step's forward now, before this step's text is decoded?

        Only on the GPU path, when nobody waits, and when every decoder in flight is plain or
        agrees (its `may_launch_ahead()`: its next plan is fixed once it has committed): then
        the next step's plan is the one it would pick itself, unless a request arrives (it joins
        a step later) or leaves (its row is dropped) in between.
        """
        if not self.launch_ahead or self.scheduler.waiting or self._grouped or self._suspects:
            return False
        for name, count in self._unplain.items():
            agrees = getattr(self.decoders[name], "may_launch_ahead", None)
            try:
                if count and (agrees is None or not agrees()):
                    return False
            except Exception:
                log.exception("decoder %s: may_launch_ahead failed", name)
                return False
        return True

    def _launch(self) -> _Launched | None:
        """Schedule, let decoders propose, and start the forward pass (asynchronous on a GPU).

        What fails for some sequences (see the module docstring) leaves the plan without them.
        """
        self._broken = {}  # filled by the schedule's callbacks
        plan = self.scheduler.schedule(self._extra_tokens, self._release)
        if self._broken:
            for rid, (error, what) in self._broken.items():
                self._fail(self.seqs.get(rid), error, what)
            plan = [item for item in plan if item.seq.status is Status.RUNNING]
        plan = self._without_held(plan)
        self.last_batch_size = len(plan)
        if not plan:
            return None
        by_decoder = _by_decoder(plan)
        proposals: list[Proposal | None] = [None] * len(plan)
        burst = self._burst(plan, by_decoder)
        if burst is not None:
            self.last_num_tokens = len(plan)
            return _Launched(plan, by_decoder, proposals, [], burst=burst)
        dropped: set[int] = set()
        for name, idx in by_decoder.items():
            seqs = [plan[i].seq for i in idx]
            try:
                props = self.decoders[name].propose(seqs, self.ctx)
                _check_count(name, "proposals", props, seqs)
            except Exception as e:
                self._batch_failed(name, seqs, "proposing for", e)
                dropped.update(idx)
                continue
            for i, prop in zip(idx, props, strict=True):
                if len(prop.tokens) > plan[i].extra:
                    error = RuntimeError(f"decoder {name} proposed more tokens than it reserved")
                    self._fail(plan[i].seq, error, "proposing for")
                    dropped.add(i)
                else:
                    proposals[i] = prop
        if dropped:
            kept = [i for i in range(len(plan)) if i not in dropped]
            plan, proposals = [plan[i] for i in kept], [proposals[i] for i in kept]
            by_decoder = _by_decoder(plan)
            if not plan:
                return None

        self._prompt_rows = {}  # filled by _chunk
        chunks = [
            self._chunk(i, item, prop)
            for i, (item, prop) in enumerate(zip(plan, proposals, strict=True))
        ]
        steps = self._fused_steps_guarded(plan, by_decoder)
        if steps:
            self.last_num_tokens = len(chunks) * steps
            seqs, tails = [c.seq for c in chunks], [c.token_ids[0] for c in chunks]
            sample = Autoregressive.device_sample
            try:
                tokens = self.engine.runner.decode_steps(seqs, tails, steps, sample)
                return _Launched(plan, by_decoder, proposals, [], tokens)
            except Exception:  # the plain forward below tells whose fault it is
                log.exception("fused decode steps failed; running a plain forward instead")
        self.last_num_tokens = sum(len(c.token_ids) for c in chunks)
        logits, failed = self._forward(chunks)
        for i, rows in self._prompt_rows.items():  # split off the rows that score prompt tokens
            if i not in failed:
                self._prompt_logits.append((plan[i].seq, rows[0], logits[i][: rows[1]]))
                logits[i] = logits[i][rows[1] :]
        if failed:
            for i, error in failed.items():
                self._fail(plan[i].seq, error, "scoring")
            kept = [i for i in range(len(plan)) if i not in failed]
            plan, proposals = [plan[i] for i in kept], [proposals[i] for i in kept]
            logits = [logits[i] for i in kept]
            by_decoder = _by_decoder(plan)
        return _Launched(plan, by_decoder, proposals, logits)

    def _forward(self, chunks: list[Chunk]) -> tuple[list[torch.Tensor], dict[int, Exception]]:
        """The step's forward pass: each chunk's logits, and what the chunks that fail alone
        raised (none when the batch went through; their logits are placeholders). If the batch
        raises, each chunk runs again alone; if none succeeds, the fault is the engine's: raise.
        """
        try:
            return self.engine.runner.forward(chunks), {}
        except Exception as e:
            if len(chunks) == 1:
                raise
            log.warning(
                "a forward pass over %d sequences failed (%s: %s); retrying each alone",
                len(chunks),
                type(e).__name__,
                e,
            )
            logits: list[torch.Tensor] = []
            failed: dict[int, Exception] = {}
            for i, chunk in enumerate(chunks):
                try:
                    logits += self.engine.runner.forward([chunk])
                except Exception as alone:
                    failed[i] = alone
                    logits.append(torch.empty(0))
            if len(failed) == len(chunks):
                raise
            return logits, failed

    def _fused_steps_guarded(self, plan: list[Scheduled], by_decoder: dict[str, list[int]]) -> int:
        if self._suspects:
            return 0
        try:
            return self._fused_steps(plan, by_decoder)
        except Exception:  # what `_fused_steps` reserved goes back when the step commits
            log.exception("choosing fused decode steps failed; running a plain forward")
            return 0

    def _chain_guarded(self, launched: _Launched) -> _Launched | None:
        try:
            return self._chain(launched)
        except Exception:  # nothing launched: the next step launches from scratch
            log.exception("chaining fused decode steps failed")
            return None

    def _fused_steps(self, plan: list[Scheduled], by_decoder: dict[str, list[int]]) -> int:
        """How many decode steps this engine step runs as one fused burst (0: a plain forward).

        A burst's steps run back to back with each step's argmax fed to the next on the device,
        so the host's per-step work (sync, commit, schedule, pack, launch) is paid once for
        several tokens, and the burst can be chained (`_chain`): the next one is queued before
        it is committed, so that work overlaps the GPU. Several steps per burst only for small
        batches (`FUSE_MAX_BATCH`), where host work is a large share of a step: a request
        arriving meanwhile waits up to `steps - 1` steps longer (a burst more if chained), and a
        sequence that stops early wastes the rest of its steps. A larger batch, up to what the
        decode graphs take, runs 1-step bursts, and only to chain them: chaining costs neither
        the wait nor the waste, and buys the overlap. Bursts need plain greedy decoding in every
        row (`Autoregressive.fusable`) and nobody waiting to join; another decoder's rows join
        for as many steps as it would decode them as `ar` (`Decoder.plain_steps`), if above 1
        (an answer of 1 may need this step's `commit`, e.g. to time it). `fused_decode_steps`
        of 1 turns bursts off at every batch size.
        """
        steps = self.fused_decode_steps
        if steps <= 1 or self.scheduler.waiting or self._grouped:
            return 0
        if len(plan) > FUSE_MAX_BATCH:
            if not self.chain_fused or len(plan) > self._max_burst_batch:
                return 0
            steps = 1
        for item in plan:
            seq = item.seq
            if not (item.completes_tail and item.num_tail == 1 and Autoregressive.fusable(seq)):
                return 0
            left = seq.params.max_tokens - seq.num_output_tokens
            steps = min(steps, left, self.engine.max_model_len - len(seq.token_ids))
        for name, idx in by_decoder.items():
            if name not in self._plain:
                plain = self.decoders[name].plain_steps([plan[i].seq for i in idx])
                if plain <= 1:
                    return 0
                steps = min(steps, plain)
        if steps <= 1:
            return 1 if self.chain_fused else 0  # unchained, a 1-step burst buys nothing
        try:
            for item in plan:
                self.engine.cache.reserve(item.seq, item.seq.num_cached + steps)
        except OutOfBlocks:
            return 0  # what was reserved goes back when the step commits (`_apply` trims)
        return steps

    def _burst(self, plan: list[Scheduled], by_decoder: dict[str, list[int]]) -> Burst | None:
        """A decoder's own passes on the device (`Decoder.burst`), when the whole step is its
        sequences' decodes, nobody waits and bursts are on (`fused_decode_steps` > 1)."""
        if (
            self.fused_decode_steps <= 1
            or len(by_decoder) != 1
            or self.scheduler.waiting
            or self._grouped
        ):
            return None
        ((name, idx),) = by_decoder.items()
        if name in self._plain or len(idx) != len(plan):
            return None
        if any(item.num_tail != 1 for item in plan):
            return None
        seqs = [item.seq for item in plan]
        return self.decoders[name].burst(seqs, self.fused_decode_steps, self.ctx)

    def _chain(self, launched: _Launched) -> _Launched | None:
        """Launch the fused burst that continues `launched`'s, before `launched` is committed.

        Committing a burst waits for its tokens; with the next burst already queued, the GPU
        runs it meanwhile instead of idling through the host's sync, commit, schedule and pack.
        Its plan is `launched`'s minus the sequences finished since (aborted, expired, or
        stopped by the commit before) and those that `launched` takes to max_tokens; its first
        tokens are their rows of `launched`'s last sample, picked on the device; its steps are
        what `_fused_steps` would allow once `launched` has committed. A sequence that stops
        otherwise in that commit still has a row, skipped when this burst commits. Nothing new
        joins: the chain ends when someone waits (a request arriving meanwhile waits at most one
        more burst, and no prefill starves) or when something else runs. Another decoder's rows
        join for as long as its `plain_steps`, asked before `launched` commits (for `launched`'s
        first step), allows.
        """
        done = launched.tokens.steps if launched.tokens is not None else 0
        if not done or not self.chain_fused or self.scheduler.waiting or self._grouped:
            return None
        old, alive = launched.plan, 0
        kept: list[int] = []  # indices into `old`
        lefts: list[int] = []
        for i, item in enumerate(old):
            seq = item.seq
            if seq.status is Status.FINISHED:
                continue
            alive += 1
            left = seq.params.max_tokens - seq.num_output_tokens - done  # once committed
            if left > 0:  # else `launched` ends it (length)
                kept.append(i)
                lefts.append(left)
        if not kept or alive != len(self.scheduler.running):
            return None
        plan, by_decoder, proposals = old, launched.by_decoder, launched.proposals
        if len(kept) < len(old):
            plan, proposals = [old[i] for i in kept], [proposals[i] for i in kept]
            by_decoder = defaultdict(list)
            for j, item in enumerate(plan):
                by_decoder[item.seq.decoder].append(j)
        steps = self.fused_decode_steps if len(plan) <= FUSE_MAX_BATCH else 1
        steps = min(steps, min(lefts))  # (`add` keeps max_tokens within max_model_len)
        for name, idx in by_decoder.items():
            if name not in self._plain:
                plain = self.decoders[name].plain_steps([plan[j].seq for j in idx])
                steps = min(steps, plain - done)
        if steps < 1:
            return None
        try:
            for item in plan:  # the burst's first step writes the K/V of `launched`'s last token
                self.engine.cache.reserve(item.seq, item.seq.num_cached + done + steps)
        except OutOfBlocks:
            return None  # what was reserved goes back when `launched` commits (`_apply` trims)
        self.last_batch_size, self.last_num_tokens = len(plan), len(plan) * steps
        seqs = [item.seq for item in plan]
        first = launched.tokens.on_device[-1]  # picked by `rows` if some sequences left
        rows = None if plan is old else kept
        sample = Autoregressive.device_sample
        tokens = self.engine.runner.decode_steps(seqs, first, steps, sample, done, rows)
        return _Launched(plan, by_decoder, proposals, [], tokens)

    def _commit(
        self,
        launched: _Launched,
        outputs: list[RequestOutput],
        untexted: list[tuple[RequestOutput, Detokenizer]],
        chained: bool = False,
    ) -> None:
        """Commit a launched forward; `chained`: a burst continuing it is in flight already."""
        if launched.tokens is not None:
            self._commit_fused(launched, outputs, untexted, chained)
            return
        if launched.burst is not None:
            seqs = [item.seq for item in launched.plan]
            for seq, commit in zip(seqs, launched.burst.commits(), strict=True):
                if seq.status is not Status.FINISHED:
                    out = self._apply(seq, commit, untexted)
                    if out is not None:
                        outputs.append(out)
            return
        plan, proposals, logits = launched.plan, launched.proposals, launched.logits
        for seq, first, rows in self._prompt_logits:
            if seq.status is not Status.FINISHED:
                try:
                    prompt_logprobs.record(seq, first, rows)
                except Exception as e:
                    self._fail(seq, e, "scoring the prompt of")
        self._prompt_logits = []
        cache = self.engine.cache
        for item in plan:
            if not item.completes_tail and item.seq.status is not Status.FINISHED:
                item.seq.num_cached += item.num_tail
                cache.seal(item.seq)
        for name, idx in launched.by_decoder.items():
            # Sequences aborted or expired since the launch lose their rows.
            idx = [i for i in idx if plan[i].seq.status is not Status.FINISHED]
            if not idx:
                continue
            seqs = [plan[i].seq for i in idx]
            props = [proposals[i] for i in idx]
            try:
                commits = self.decoders[name].commit(
                    seqs, props, [logits[i] for i in idx], self.ctx
                )
                _check_count(name, "commits", commits, seqs)
            except Exception as e:
                self._batch_failed(name, seqs, "committing for", e)
                continue
            self._passed(name, seqs)
            for seq, commit in zip(seqs, commits, strict=True):
                try:  # (inline: a call per sequence and step is dear at 256 sequences)
                    out = self._apply(seq, commit, untexted)
                except Exception as e:
                    self._fail(seq, e, "applying the tokens of")
                    continue
                if out is not None:
                    outputs.append(out)

    def _commit_fused(
        self,
        launched: _Launched,
        outputs: list[RequestOutput],
        untexted: list[tuple[RequestOutput, Detokenizer]],
        chained: bool,
    ) -> None:
        """Fused decode steps: each sequence commits its `steps` tokens, all but the last cached.

        With a `chained` burst in flight, the blocks reserved for it stay (no trim in `_apply`).
        """
        plan, steps = launched.plan, launched.tokens.steps
        for name, idx in launched.by_decoder.items():  # propose ran, commit does not
            if name not in self._plain:
                seqs = [plan[i].seq for i in idx if plan[i].seq.status is not Status.FINISHED]
                try:
                    if seqs:
                        self.decoders[name].fused(seqs, steps)
                except Exception:  # its count of steps is off; the tokens are plain greedy
                    log.exception("decoder %s: fused failed; its sequences start afresh", name)
                    for seq in seqs:
                        self._reset(seq)
        for item, tokens in zip(plan, launched.tokens.per_sequence(), strict=True):
            if item.seq.status is not Status.FINISHED:
                commit = Commit(tokens, [None] * steps, steps - 1, forward_passes=steps)
                try:
                    out = self._apply(item.seq, commit, untexted, trim=not chained)
                except Exception as e:
                    self._fail(item.seq, e, "applying the tokens of")
                    continue
                if out is not None:
                    outputs.append(out)

    def _step_groups(
        self, untexted: list[tuple[RequestOutput, Detokenizer]]
    ) -> list[RequestOutput]:
        """One batched pass of every model group (diffusion LMs) over all of its sequences."""
        groups: dict[ModelGroup, list[Sequence]] = defaultdict(list)
        for seq in self._grouped.values():
            group = self.decoders[seq.decoder].model_group(seq)
            if group is not None:
                groups[group].append(seq)
        outputs: list[RequestOutput] = []
        for group, seqs in groups.items():
            active = self._active(group, seqs)
            if active is not None:
                seqs = [s for s in seqs if s.request_id in active]
            try:
                commits = group.step(seqs, self.ctx)
                _check_count(type(group).__name__, "commits", commits, seqs)
            except Exception as e:
                self._batch_failed(group, seqs, "stepping the model group of", e)
                continue
            self._passed(group, seqs)
            for seq, commit in zip(seqs, commits, strict=True):
                try:
                    out = self._apply(seq, commit, untexted)
                except Exception as e:
                    self._fail(seq, e, "applying the tokens of")
                    continue
                if out is not None:
                    outputs.append(out)
        return outputs

    def _chunk(self, index: int, item: Scheduled, prop: Proposal | None) -> Chunk:
        seq = item.seq
        start = seq.num_cached
        tail = seq.token_ids[start : start + item.num_tail]
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        chunk = self._decoder_chunk(seq, start, tail, prop)
        if seq.prompt_logprobs is not None:
            rows = prompt_logprobs.rows_wanted(seq, start, item.num_tail)
            if rows is not None:  # they come before the decoder's rows
                self._prompt_rows[index] = rows
                chunk.num_logits += rows[1]
        return chunk

    @staticmethod
    def _decoder_chunk(seq: Sequence, start: int, tail: list[int], prop: Proposal | None) -> Chunk:
        if prop is None:
            return Chunk(seq, tail, num_logits=0)
        if not prop.tokens and prop.positions is None:
            return Chunk(seq, tail, 1, None, prop.mask)
        positions = None
        if prop.positions is not None:
            positions = list(range(start, start + len(tail))) + prop.positions
        return Chunk(seq, tail + prop.tokens, 1 + len(prop.tokens), positions, prop.mask)

    def _apply(
        self,
        seq: Sequence,
        commit: Commit,
        untexted: list[tuple[RequestOutput, Detokenizer]],
        trim: bool = True,
    ) -> RequestOutput | None:
        """Append a commit's tokens under the stop rules, roll back rejected KV, emit output.

        An output that does not end its request gets its text later, from `untexted`. `trim`:
        give back blocks past the cached tokens (not while a chained burst writes into them).
        """
        token_ids = seq.token_ids
        cached = len(token_ids)  # the whole tail was scored
        if commit.kv_from is not None and commit.kv_from != list(range(commit.kv_keep)):
            src = [cached + i for i in commit.kv_from]
            self.engine.cache.move(seq, src, list(range(cached, cached + commit.kv_keep)))
        seq.num_cached = cached + commit.kv_keep
        if trim:
            self.engine.cache.trim(seq)
        seq.stats.forward_passes += commit.forward_passes
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()

        p, detok = seq.params, self._detok[seq.request_id]
        num_prompt = len(seq.prompt_ids)
        first = len(token_ids) == num_prompt
        eos_ids = () if p.ignore_eos else self.ctx.eos_ids
        grammar = seq.grammar
        reason: str | None = None
        stop_reason: str | int | None = None
        n = 0
        for token in commit.tokens:
            token_ids.append(token)
            n += 1
            produced = len(token_ids) - num_prompt
            stop_string = detok.add(token)
            if grammar is not None and grammar.advance(token):
                reason = "stop"  # the grammar allows nothing more
            elif produced >= p.min_tokens:
                if token in p.stop_token_ids:
                    reason, stop_reason = "stop", token
                elif token in eos_ids:
                    reason = "stop"
                elif stop_string is not None:
                    reason, stop_reason = "stop", stop_string
            if reason is None and produced >= p.max_tokens:
                reason = "length"
            if reason is not None:
                break
        self.engine.cache.seal(seq)  # before a finish frees them: the next turn may use them
        if commit.per_pass is not None:  # a burst's passes, up to the tokens kept
            kept = n
            for made in commit.per_pass:
                if kept <= 0:
                    break
                seq.stats.committed_per_pass.append(min(made, kept))
                kept -= made
        elif commit.forward_passes == 1:
            seq.stats.committed_per_pass.append(n)
        else:  # fused decode steps: one token per pass
            seq.stats.committed_per_pass += [1] * n
        out = RequestOutput(seq.request_id, commit.tokens[:n], logprobs=commit.logprobs[:n])
        if first and seq.prompt_logprobs is not None:
            out.prompt_logprobs = seq.prompt_logprobs
        if reason is not None:
            return self._finish(seq, reason, out, stop_reason)
        untexted.append((out, detok))
        out.num_prompt_tokens = num_prompt
        out.num_output_tokens = len(token_ids) - num_prompt
        return out

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        out: RequestOutput | None = None,
        stop_reason: str | int | None = None,
        error: EngineError | None = None,
    ) -> RequestOutput:
        out = out or RequestOutput(seq.request_id)
        try:
            self.decoders[seq.decoder].release(seq, self.ctx)
        except Exception:  # the request is over either way; its decoder may leak a little
            log.exception("releasing the decoder state of request %s failed", seq.request_id)
        self.scheduler.remove(seq)
        del self.seqs[seq.request_id]
        self._grouped.pop(seq.request_id, None)
        if self._suspects:
            self._clear_suspect(seq.request_id)
        self._num_deadlines -= seq.deadline is not None
        if seq.decoder not in self._plain:
            self._unplain[seq.decoder] -= 1
        try:
            out.text = self._detok.pop(seq.request_id).take(final=True)
        except Exception as e:
            log.exception("detokenizing request %s failed", seq.request_id)
            if error is None:
                reason = "error"
                error = EngineError("internal_error", f"detokenizing failed: {type(e).__name__}")
        out.finish_reason = reason
        out.stop_reason = stop_reason
        out.error = error
        self._fill_counts(seq, out)
        out.decoder_stats = {"decoder": seq.decoder, **seq.stats.as_dict()}
        out.timings = _timings(seq)
        return out

    def _fill_counts(self, seq: Sequence, out: RequestOutput) -> None:
        out.num_prompt_tokens = seq.num_prompt_tokens
        out.num_output_tokens = seq.num_output_tokens
        out.num_cached_tokens = seq.cached_prompt_tokens

    def _expire_deadlines(self) -> list[RequestOutput]:
        if not self._num_deadlines:
            return []
        now = time.monotonic()
        late = [s for s in self.seqs.values() if s.deadline is not None and s.deadline <= now]
        return [
            self._finish(
                s,
                "deadline",
                error=EngineError("deadline_exceeded", "the request's deadline passed"),
            )
            for s in late
        ]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The loop is dying: every request still in flight gets an error as its last output."""
        error = EngineError("engine_dead", message)
        self._launched = None
        outs = []
        for seq in list(self.seqs.values()):
            try:
                outs.append(self._finish(seq, "error", error=error))
            except Exception:  # the state may be broken; still answer the client
                outs.append(RequestOutput(seq.request_id, finish_reason="error", error=error))
                self.seqs.pop(seq.request_id, None)
        return outs

    # ---- fault isolation (see the module docstring) -----------------------------------------

    def _extra_tokens(self, seq: Sequence, cap: int) -> int:
        """The scheduler's callback; a decoder failing here fails `seq` once scheduling ends."""
        try:
            return self.decoders[seq.decoder].extra_tokens(seq, cap)
        except Exception as e:
            self._broken.setdefault(seq.request_id, (e, "scheduling"))
            return 0

    def _release(self, seq: Sequence) -> None:
        """The scheduler's callback on preemption (a failure fails `seq` once scheduling ends)."""
        try:
            self.decoders[seq.decoder].release(seq, self.ctx)
        except Exception as e:
            self._broken.setdefault(seq.request_id, (e, "preempting"))

    def _reset(self, seq: Sequence) -> bool:
        """Drop `seq`'s decoder state, as preemption does (the decoder rebuilds it from the
        tokens); False if even that failed, which fails `seq`."""
        try:
            self.decoders[seq.decoder].release(seq, self.ctx)
        except Exception as e:
            self._fail(seq, e, "resetting the decoder of")
            return False
        return True

    def _fail(self, seq: Sequence | None, error: Exception, what: str) -> None:
        """`seq`'s request fails with `internal_error` (its output goes out with this step's)."""
        if seq is None or seq.request_id not in self.seqs:
            return
        log.error("request %s failed while %s it", seq.request_id, what, exc_info=error)
        message = f"internal error while {what} this request: {type(error).__name__}: {error}"
        error_out = EngineError("internal_error", message[:500])
        self._failed.append(self._finish(seq, "error", error=error_out))

    def _batch_failed(
        self, key: Hashable, seqs: list[Sequence], what: str, error: Exception
    ) -> None:
        """A batched call over `seqs` raised: fail the one sequence, or bisect several.

        They start afresh (`_reset`) and are split in two suspect groups, which run before
        anything else of `key`, one group per step (`_active`), until the one that fails alone.
        """
        if len(seqs) == 1:
            self._fail(seqs[0], error, what)
            return
        log.warning(
            "%s %d sequences failed (%s: %s); running them apart to find the one",
            what,
            len(seqs),
            type(error).__name__,
            error,
        )
        ids = [s.request_id for s in seqs if self._reset(s)]
        half = (len(ids) + 1) // 2
        rest = [g - set(ids) for g in self._suspects.get(key, [])]
        groups = [g for g in (set(ids[:half]), set(ids[half:]), *rest) if g]
        if groups:
            self._suspects[key] = groups

    def _passed(self, key: Hashable, seqs: list[Sequence]) -> None:
        """A batched call over `seqs` went through: they are suspects no more."""
        groups = self._suspects.get(key)
        if groups:
            ids = {s.request_id for s in seqs}
            groups = [g - ids for g in groups if g - ids]
            if groups:
                self._suspects[key] = groups
            else:
                del self._suspects[key]

    def _active(self, key: Hashable, candidates: list[Sequence]) -> set[str] | None:
        """The suspect group of `key` that runs this step: the first one with a member among
        `candidates`; None: no suspects there, all of them run as usual."""
        ids = {s.request_id for s in candidates}
        return next((g for g in self._suspects.get(key, ()) if g & ids), None)

    def _clear_suspect(self, request_id: str) -> None:
        """A finished request is nobody's suspect (no suspects left: fused steps again)."""
        for key in list(self._suspects):
            groups = [g - {request_id} for g in self._suspects[key]]
            if any(groups):
                self._suspects[key] = [g for g in groups if g]
            else:
                del self._suspects[key]

    def _without_held(self, plan: list[Scheduled]) -> list[Scheduled]:
        """The plan without the sequences that a suspect group of their decoder holds back."""
        if not self._suspects:
            return plan
        active: dict[str, set[str] | None] = {}
        for name in {item.seq.decoder for item in plan} & self._suspects.keys():
            active[name] = self._active(name, [i.seq for i in plan if i.seq.decoder == name])
        return [
            item
            for item in plan
            if active.get(item.seq.decoder) is None
            or item.seq.request_id in active[item.seq.decoder]
        ]


def _by_decoder(plan: list[Scheduled]) -> dict[str, list[int]]:
    """Plan indices of the sequences that complete their tail, by decoder."""
    by_decoder: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(plan):
        if item.completes_tail:
            by_decoder[item.seq.decoder].append(i)
    return by_decoder


def _check_count(name: str, what: str, got: list, seqs: list[Sequence]) -> None:
    if len(got) != len(seqs):
        raise RuntimeError(f"{name} returned {len(got)} {what} for {len(seqs)} sequences")


def _timings(seq: Sequence) -> dict[str, Any]:
    now = time.monotonic()
    t: dict[str, Any] = {"e2e": now - seq.arrival_time}
    if seq.first_scheduled_time is not None:
        t["queue"] = seq.first_scheduled_time - seq.arrival_time
    if seq.first_token_time is not None:
        t["ttft"] = seq.first_token_time - seq.arrival_time
        decode_time = now - seq.first_token_time
        if seq.num_output_tokens > 1 and decode_time > 0:
            t["decode_tokens_per_s"] = (seq.num_output_tokens - 1) / decode_time
    return t
