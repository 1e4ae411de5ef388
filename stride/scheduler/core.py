"""The step loop's body: schedule, let decoders propose, one forward, let decoders commit.

`EngineCore` is single-threaded and synchronous; `client.EngineClient` runs it on its own thread
and feeds it through queues. Every admitted request leaves through exactly one terminal output.

Fault isolation: one request's failure is that request's error (`internal_error`), never the
engine's. Work done per sequence (admission, a decoder's `extra_tokens`, applying a commit,
detokenizing, finishing) fails the sequence it raised for. A batched call (a decoder's
`propose` or `commit` over its sequences, a model group's step) that raises cannot be pinned on
one of them: its sequences drop their decoder state (as on preemption), become suspects, and are
run again in halves, one half per step with the decoder's other sequences held back, until the
one that fails alone is found and failed (bisection: `suspects`). A forward
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
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from stride.decoders.base import (
    Commit,
    Decoder,
    DecoderError,
    DecodersConfig,
    ModelGroup,
    StepContext,
)
from stride.decoders.grammar import GrammarError, Grammars
from stride.decoders.registry import build_decoders
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.roofline import StepLoad
from stride.engine.sequence import Sequence, Status
from stride.scheduler import prompt_logprobs
from stride.scheduler.detokenizer import Detokenizer
from stride.scheduler.executor import Batch, DecoderBurst, Executor, Forward, InFlight
from stride.scheduler.outputs import (
    EngineError,
    GenerateRequest,
    QueueFull,
    RequestOutput,
    RequestRejected,
    StepStats,
)
from stride.scheduler.policy import Scheduler, SchedulerConfig
from stride.scheduler.suspects import Suspects
from stride.scheduler.timeline import Timeline

log = logging.getLogger(__name__)


@dataclass
class _StepOutputs:
    """What a step hands out: outputs, and those whose text is decoded at the step's end."""

    outputs: list[RequestOutput]
    untexted: list[tuple[RequestOutput, Detokenizer]] = field(default_factory=list)


@dataclass
class CoreConfig:
    """Everything a core is built from: plain data, so an engine process can be handed it."""

    engine: EngineConfig
    scheduler: SchedulerConfig
    decoders: DecodersConfig

    def build(self) -> EngineCore:
        """Load the model and set up the decoders: the one way an `EngineCore` is built."""
        engine = Engine(self.engine)
        return EngineCore(engine, self.scheduler, build_decoders(engine, self.decoders))


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
        self.ctx = StepContext(eos_ids=engine.eos_ids, device=engine.device)
        self.executor = Executor(engine, self.decoders, self.config.fused_decode_steps)
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._grouped: dict[str, Sequence] = {}  # sequences that a model group runs
        self._num_deadlines = 0  # sequences in flight with a deadline
        self._in_flight: Counter[str] = Counter()  # sequences in flight, by decoder
        self._timelines: dict[str, Timeline] = {}  # of the traced requests in flight
        self._next: InFlight | None = None  # the next step, launched on the device already
        self.last_batch_size = 0
        self.last_num_tokens = 0
        # Fault isolation: sequences that run apart (`suspects`), failed requests' outputs.
        self._suspects = Suspects()
        self._failed: list[RequestOutput] = []
        self._broken: dict[str, tuple[Exception, str]] = {}  # during scheduling
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
        self._in_flight[seq.decoder] += 1
        self._detok[seq.request_id] = detok
        if req.trace:
            self._timelines[seq.request_id] = Timeline(seq.arrival_time)
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
            load=self.executor.load.priced(self.engine.shape),
        )

    def stats_without_step(self) -> StepStats:
        """The numbers after a change no step made (an abort): the gauges must see the freed
        sequence and KV blocks now, since an engine left idle runs no step to report them."""
        return replace(self.stats(), batch_size=0, num_tokens=0, load=StepLoad())

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule → forward → commit; then decode the step's text.

        A step's forward may be in flight already (launched ahead, or a burst that follows the
        last one on the device: see `executor`); it is committed here, and its successor, if
        any, launched before the commit waits for the device.
        """
        self.executor.load = StepLoad()
        out = _StepOutputs(self._expire_deadlines())
        if self._grouped:
            self._step_groups(out)
        inflight, self._next = self._next or self.launch(), None
        if inflight is not None:
            self._next = self._follow(inflight)
            self.commit(inflight, out, chained=self._next is not None)
            if self._next is None and self.executor.may_launch_ahead(
                self._alone and not self._suspects, +self._in_flight
            ):
                self._next = self.launch()
        self._detokenize(out)  # last: with a forward launched ahead, while the device computes
        return out.outputs + self._take_failed()

    @property
    def _alone(self) -> bool:
        """Nobody waits to be scheduled and no model group runs beside the target."""
        return not self.scheduler.waiting and not self._grouped

    def launch(self) -> InFlight | None:
        """Schedule, let decoders propose, and start the step on the device (see `executor`).

        What fails for some sequences (see the module docstring) leaves the plan without them.
        """
        self._broken = {}  # filled by the schedule's callbacks
        plan = self.scheduler.schedule(self._extra_tokens, self._release)
        if self._broken:
            for rid, (error, what) in self._broken.items():
                self._fail(self.seqs.get(rid), error, what)
            plan = [item for item in plan if item.seq.status is Status.RUNNING]
        plan = self._suspects.without_held(plan)
        self.last_batch_size = len(plan)
        if not plan:
            return None
        now = time.monotonic()
        for item in plan:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        inflight = self.executor.launch(
            Batch.of(plan), self._propose, self.ctx, self._alone, bool(self._suspects)
        )
        if inflight is not None:
            self.last_num_tokens = inflight.num_tokens
            for seq, error in inflight.failed:
                self._fail(seq, error, "scoring")
        return inflight

    def _propose(self, batch: Batch) -> Batch | None:
        """Each decoder's proposals for its sequences; the batch without those that failed."""
        dropped: set[int] = set()
        plan, proposals = batch.plan, batch.proposals
        for name, idx in batch.by_decoder.items():
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
        if not dropped:
            return batch
        batch = batch.without(dropped)
        return batch if batch.plan else None

    def _follow(self, inflight: InFlight) -> InFlight | None:
        """The step that continues `inflight` on the device before it is committed, if any."""
        follower = self.executor.follow(inflight, self._alone, len(self.scheduler.running))
        if follower is not None:
            self.last_batch_size = len(follower.batch.plan)
            self.last_num_tokens = follower.num_tokens
        return follower

    def commit(self, inflight: InFlight, out: _StepOutputs, chained: bool = False) -> None:
        """Every live sequence of a launched step commits what it made; `chained`: a burst that
        continues it is in flight already (the blocks reserved for that one stay)."""
        cache = self.engine.cache
        if isinstance(inflight, Forward):
            if self._timelines:
                self._note_prefill(inflight)
            for seq, first, rows in inflight.prompt_logits:
                if seq.status is not Status.FINISHED:
                    try:
                        prompt_logprobs.record(seq, first, rows)
                    except Exception as e:
                        self._fail(seq, e, "scoring the prompt of")
        for item in inflight.batch.plan:  # a prefill chunk: its KV stays, nothing to sample
            if not item.completes_tail and item.seq.status is not Status.FINISHED:
                item.seq.num_cached += item.num_tail
                cache.seal(item.seq)
        plan = inflight.batch.plan
        for name, idx in inflight.live():
            decoder, seqs = self.decoders[name], [plan[i].seq for i in idx]
            try:  # passes the decoder did not commit itself (a burst): the tokens stand
                inflight.advance(decoder, seqs)
            except Exception:
                log.exception("decoder %s: advance failed; its sequences start afresh", name)
                seqs = [seq for seq in seqs if self._reset(seq)]
                idx = [i for i in idx if plan[i].seq.status is not Status.FINISHED]
            before = [seq.stats.draft_tokens for seq in seqs]
            try:
                commits = inflight.commits(decoder, idx, self.ctx)
                _check_count(name, "commits", commits, seqs)
            except Exception as e:
                self._batch_failed(name, seqs, "committing for", e)
                continue
            self._suspects.passed(name, seqs)
            if isinstance(inflight, DecoderBurst):  # (the burst's commit counted its drafts)
                drafted = [s.stats.draft_tokens - b for s, b in zip(seqs, before, strict=True)]
                passes = [c.forward_passes for c in commits]
                self.executor.load.add_burst(seqs, passes, drafted)
            proposals = inflight.batch.proposals
            for i, seq, commit in zip(idx, seqs, commits, strict=True):
                proposal = proposals[i]
                proposed = 0 if proposal is None else len(proposal.tokens)
                self._apply_guarded(seq, commit, out, trim=not chained, proposed=proposed)

    def _note_prefill(self, inflight: Forward) -> None:
        """The traced sequences' prefill chunks in a forward being committed (tails of several
        tokens: a prompt's chunks, or its recomputation after a preemption)."""
        now = time.monotonic()
        for item in inflight.batch.plan:
            timeline = self._timelines.get(item.seq.request_id)
            if timeline is not None and item.num_tail > 1:
                chunk = (inflight.launched_at, now, item.num_tail, item.seq.num_cached)
                timeline.prefill.append(chunk)

    def _apply_guarded(
        self,
        seq: Sequence,
        commit: Commit,
        out: _StepOutputs,
        trim: bool = True,
        proposed: int = 0,
    ) -> None:
        try:
            output = self._apply(seq, commit, out.untexted, trim, proposed)
        except Exception as e:
            self._fail(seq, e, "applying the tokens of")
            return
        if output is not None:
            out.outputs.append(output)

    def _detokenize(self, out: _StepOutputs) -> None:
        for output, detok in out.untexted:
            try:
                output.text = detok.take(final=False)
            except Exception as e:
                self._fail(self.seqs.get(output.request_id), e, "detokenizing")

    def _take_failed(self) -> list[RequestOutput]:
        failed, self._failed = self._failed, []
        return failed

    def _step_groups(self, out: _StepOutputs) -> None:
        """One batched pass of every model group (diffusion LMs) over all of its sequences."""
        groups: dict[ModelGroup, list[Sequence]] = defaultdict(list)
        for seq in self._grouped.values():
            group = self.decoders[seq.decoder].model_group(seq)
            if group is not None:
                groups[group].append(seq)
        for group, seqs in groups.items():
            active = self._suspects.active(group, seqs)
            if active is not None:
                seqs = [s for s in seqs if s.request_id in active]
            try:
                commits = group.step(seqs, self.ctx)
                _check_count(type(group).__name__, "commits", commits, seqs)
            except Exception as e:
                self._batch_failed(group, seqs, "stepping the model group of", e)
                continue
            self._suspects.passed(group, seqs)
            for seq, commit in zip(seqs, commits, strict=True):
                self._apply_guarded(seq, commit, out)

    def _apply(
        self,
        seq: Sequence,
        commit: Commit,
        untexted: list[tuple[RequestOutput, Detokenizer]],
        trim: bool = True,
        proposed: int = 0,
    ) -> RequestOutput | None:
        """Append a commit's tokens under the stop rules, roll back rejected KV, emit output.

        An output that does not end its request gets its text later, from `untexted`. `trim`:
        give back blocks past the cached tokens (not while a chained burst writes into them).
        `proposed`: how many tokens the decoder proposed after the tail (a traced request's
        timeline notes refinement passes by it).
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
        else:  # a greedy burst: one token per pass
            seq.stats.committed_per_pass += [1] * n
        if self._timelines and seq.request_id in self._timelines:
            refining = proposed > 0 or seq.request_id in self._grouped
            now = time.monotonic()
            self._timelines[seq.request_id].committed(now, seq.stats, proposed, n, refining)
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
            self._suspects.clear(seq.request_id)
        self._num_deadlines -= seq.deadline is not None
        self._in_flight[seq.decoder] -= 1
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
        if self._timelines:
            out.timeline = self._finish_timeline(seq)
        return out

    def _finish_timeline(self, seq: Sequence) -> Timeline | None:
        timeline = self._timelines.pop(seq.request_id, None)
        if timeline is not None:
            timeline.scheduled = seq.first_scheduled_time
            timeline.first_token = seq.first_token_time
            timeline.finished = time.monotonic()
            timeline.cached_tokens = seq.cached_prompt_tokens
        return timeline

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
        self._next = None
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
        if self._timelines and seq.request_id in self._timelines:
            self._timelines[seq.request_id].preempted(time.monotonic())
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

        They start afresh (`_reset`) and run apart until the one that fails alone is found
        (`suspects`).
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
        self._suspects.split(key, [s.request_id for s in seqs if self._reset(s)])


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
