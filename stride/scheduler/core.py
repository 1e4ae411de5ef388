"""The step loop's body: schedule, let decoders propose, run on the device, apply.

    plan = scheduler.schedule(decoders)          # who runs, with how many tokens each
    batch = decoders.propose(plan)               # what each decoder wants scored
    results = executor.run(batch)                # launched; the launches it finishes
    outputs = core.apply(results)                # each finished, applied (stops); text out

`EngineCore` is single-threaded and synchronous; `client.EngineClient` runs it on its own thread
and feeds it through queues. Every admitted request leaves through exactly one terminal output.
The executor may keep one launch in flight across steps (plain steps sampled on the device):
then a step applies the launch before its own, and its fed rows continue from the pending tokens.
A decoder's burst may launch its sequences' next one at its commit (`Burst.followed`): then the
next step admits no waiting request, so that it runs that burst.

Fault isolation: one request's failure is that request's error (`internal_error`), never the
engine's. Work done per sequence (admission, applying a commit, detokenizing, finishing) fails
the sequence it raised for; the decoders' calls are isolated by `decoder_set`, and a forward pass
that raises is retried one sequence at a time by the executor: sequences whose forward fails
alone fail, and only if none succeeds does the step raise: then the engine is broken, and the
client declares it dead (and restarts it).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from stride.decoders import sampling
from stride.decoders.base import Commit, Decoder, DecodersConfig, StepContext
from stride.decoders.registry import build_decoders
from stride.engine import loader
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.roofline import StepLoad
from stride.engine.sequence import Sequence, Status
from stride.scheduler import prompt_logprobs
from stride.scheduler.batch import StepResult
from stride.scheduler.decoder_set import DecoderSet
from stride.scheduler.detokenizer import Detokenizer
from stride.scheduler.executor import Executor
from stride.scheduler.intake import Intake
from stride.scheduler.outputs import (
    EngineError,
    GenerateRequest,
    QueueFull,
    RequestOutput,
    RequestRejected,
    StepStats,
)
from stride.scheduler.policy import Plan, Scheduler, SchedulerConfig
from stride.scheduler.timeline import Timeline, timings

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

    def build(self, dead: EngineCore | None = None) -> EngineCore:
        """Load the model and set up the decoders: the one way an `EngineCore` is built.

        `dead`: the core of a loop that died in this process, built from this config. Its
        engine's weights and tokenizer are reused (`loader.reassembled` says why that is safe);
        the rest is built anew: modules, KV cache, runner, decoders, scheduler. A model split
        over ranks is loaded again: its worker processes may have died with it.
        """
        loaded = None
        if dead is not None and dead.engine.workers is None:
            loaded = loader.reassembled(dead.engine.loaded)
        engine = Engine(self.engine, loaded)
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
        burst_steps = self.config.fused_decode_steps
        if burst_steps is None:
            burst_steps = 8 if engine.runner.graphs is not None else 1
        ctx = StepContext(eos_ids=engine.eos_ids, device=engine.device, bursts=burst_steps > 1)
        self.decoders = DecoderSet(decoders or build_decoders(engine), ctx, burst_steps)
        self.executor = Executor(engine, self.decoders, burst_steps)
        self.intake = Intake(engine, self.decoders)
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._grouped: dict[str, Sequence] = {}  # sequences that a model group runs
        self._num_deadlines = 0  # sequences in flight with a deadline
        self._followed = False  # the last step's burst launched the next one (`Burst.followed`)
        self._in_flight: Counter[str] = Counter()  # sequences in flight, by decoder
        self._timelines: dict[str, Timeline] = {}  # of the traced requests in flight
        self._failed: list[RequestOutput] = []  # failed requests' outputs, out with the step's
        self.last_batch_size = 0
        self.last_num_tokens = 0
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
        if req.request_id in self.seqs:
            raise RequestRejected(f"duplicate request id {req.request_id!r}")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFull("the waiting queue is full")
        try:
            seq, grouped = self.intake.sequence(req)
        except (QueueFull, RequestRejected):
            raise
        except Exception as e:
            log.exception("admitting request %s failed", req.request_id)
            raise RequestRejected(
                f"internal error while admitting the request: {type(e).__name__}",
                code="internal_error",
            ) from e
        p = req.params
        self.seqs[seq.request_id] = seq
        self._num_deadlines += seq.deadline is not None
        self._in_flight[seq.decoder] += 1
        self._detok[seq.request_id] = Detokenizer(self.engine.tokenizer, p.stop,
                                                  p.skip_special_tokens)  # fmt: skip
        if req.trace:
            self._timelines[seq.request_id] = Timeline(seq.arrival_time)
        if grouped:  # a model of the decoder's own runs it (diffusion); see _step_groups
            seq.status = Status.RUNNING
            self._grouped[seq.request_id] = seq
        else:
            self.scheduler.enqueue(seq)

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
        """Schedule, propose, run, apply (see the module docstring)."""
        outputs = self._expire_deadlines() + self._step_groups()
        self.decoders.ctx.waiting = bool(self.scheduler.waiting)
        plan = self.scheduler.schedule(self.decoders, admit=not self._followed)
        self._note_plan(plan)
        batch = self.decoders.propose(plan.items, alone=self._alone)
        # (finishing a loop adds to its load)
        outputs += self.apply(self.executor.run(batch))
        self.last_batch_size, self.last_num_tokens = len(batch.plan), self.executor.load.tokens
        return outputs

    @property
    def _alone(self) -> bool:
        """Nobody waits to be scheduled (or those who do wait for the burst launched ahead:
        `Burst.followed`) and no model group runs beside the target."""
        return (self._followed or not self.scheduler.waiting) and not self._grouped

    def _note_plan(self, plan: Plan) -> None:
        """When each sequence was first scheduled, and the traced ones' preemptions."""
        now = time.monotonic()
        for item in plan.items:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        for seq in plan.preempted if self._timelines else ():
            if seq.request_id in self._timelines:
                self._timelines[seq.request_id].preempted(now)

    def apply(self, results: Iterable[StepResult]) -> list[RequestOutput]:
        """The results' commits under the stop rules, in launch order (each taken after the one
        before is applied: see `Executor.run`); then the step's text."""
        out = _StepOutputs([])
        applied = []
        for result in results:
            self._apply_result(result, out)
            applied.append(result)
        cache = self.engine.cache
        self._followed = False
        for result in applied:  # once all are in: an earlier result's trim would drop the slots
            burst = result.batch.burst  # of a later one's tokens (or of a burst launched ahead)
            if burst is not None and burst.followed:
                self._followed = True  # (the next step runs the burst launched ahead: `Burst`)
                continue
            for item in result.batch.plan:  # (the slots of rejected drafts go back)
                if (item.extra or burst) and item.seq.status is Status.RUNNING:
                    cache.trim(item.seq)
        for seq, error, what in self.decoders.take_failed():
            self._fail(seq, error, what)
        self._detokenize(out)
        return out.outputs + self._take_failed()

    def _apply_result(self, result: StepResult, out: _StepOutputs) -> None:
        for seq, error, what in result.failed:
            self._fail(seq, error, what)
        for rows in result.prompt_rows:
            if rows.seq.status is not Status.FINISHED:
                try:
                    prompt_logprobs.record(rows.seq, rows.first, rows.logits)
                except Exception as e:
                    self._fail(rows.seq, e, "scoring the prompt of")
        if self._timelines:
            now = time.monotonic()
            for chunk in result.chunks:
                timeline = self._timelines.get(chunk.seq.request_id)
                if timeline is not None:
                    timeline.prefill.append((result.launched_at, now, chunk.tokens, chunk.cached))
        plan, proposals = result.batch.plan, result.batch.proposals
        for i, commit in sorted(result.commits.items()):
            seq, proposal = plan[i].seq, proposals[i]
            if seq.status is Status.FINISHED:
                continue
            proposed = 0 if proposal is None else len(proposal.tokens)
            self._apply_guarded(seq, commit, out, proposed)

    def _apply_guarded(
        self, seq: Sequence, commit: Commit, out: _StepOutputs, proposed: int = 0
    ) -> None:
        try:
            output = self._apply(seq, commit, out.untexted, proposed)
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

    def _step_groups(self) -> list[RequestOutput]:
        """One batched pass of every model group (diffusion LMs) over all of its sequences."""
        if not self._grouped:
            return []
        out = _StepOutputs([])
        for seq, commit in self.decoders.step_groups(list(self._grouped.values())):
            self._apply_guarded(seq, commit, out)
        return out.outputs

    def _apply(
        self,
        seq: Sequence,
        commit: Commit,
        untexted: list[tuple[RequestOutput, Detokenizer]],
        proposed: int = 0,
    ) -> RequestOutput | None:
        """Append a commit's tokens under the stop rules, roll back rejected KV, emit output.

        An output that does not end its request gets its text later, from `untexted`. A token
        drawn without its grammar's mask that the grammar refuses is drawn again under the mask
        (`sampling.redrawn`) or ends the commit before it. `proposed`: how many tokens the
        decoder proposed after the tail (traced requests)."""
        token_ids = seq.token_ids
        cached = len(token_ids)  # the whole tail was scored
        if commit.kv_from is not None and commit.kv_from != list(range(commit.kv_keep)):
            src = [cached + i for i in commit.kv_from]
            self.engine.cache.move(seq, src, list(range(cached, cached + commit.kv_keep)))
        seq.num_cached = cached + commit.kv_keep
        seq.stats.forward_passes += commit.forward_passes
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        p, detok = seq.params, self._detok[seq.request_id]
        num_prompt = len(seq.prompt_ids)
        first = len(token_ids) == num_prompt
        eos_ids = () if p.ignore_eos else self.engine.eos_ids
        reason: str | None = None
        stop_reason: str | int | None = None
        n = 0
        grammar = seq.grammar
        checked = grammar is not None and not commit.masked  # drawn without the mask
        for token in commit.tokens:
            taken = checked and grammar.take(token)  # (checked and consumed)
            refused = checked and not taken
            if refused:  # drawn again under the mask now, or on the host once re-scored
                token = seq.redraw(sampling.redrawn(seq, commit.drawn_from, n))
                if token is None:
                    break
            token_ids.append(token)
            n += 1
            produced = len(token_ids) - num_prompt
            stop_string = detok.add(token)
            if grammar is not None and (grammar.stopped if taken else grammar.advance(token)):
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
            if reason is not None or refused:
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
        else:  # a burst: one token per pass
            seq.stats.committed_per_pass += [1] * n
        if self._timelines and seq.request_id in self._timelines:
            refining = proposed > 0 or seq.request_id in self._grouped
            now = time.monotonic()
            self._timelines[seq.request_id].committed(now, seq.stats, proposed, n, refining)
        out = RequestOutput(seq.request_id, token_ids[cached:], logprobs=commit.logprobs[:n])
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
        self.decoders.release(seq)
        self.scheduler.remove(seq)
        del self.seqs[seq.request_id]
        self._grouped.pop(seq.request_id, None)
        self.decoders.suspects.clear(seq.request_id)
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
        out.timings = timings(seq)
        if seq.request_id in self._timelines:
            out.timeline = self._timelines.pop(seq.request_id).finish(seq)
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
        error = EngineError("deadline_exceeded", "the request's deadline passed")
        return [self._finish(s, "deadline", error=error) for s in late]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The loop is dying: every request still in flight gets an error as its last output."""
        error = EngineError("engine_dead", message)
        outs = []
        for seq in list(self.seqs.values()):
            try:
                outs.append(self._finish(seq, "error", error=error))
            except Exception:  # the state may be broken; still answer the client
                outs.append(RequestOutput(seq.request_id, finish_reason="error", error=error))
                self.seqs.pop(seq.request_id, None)
        return outs

    def _fail(self, seq: Sequence | None, error: Exception, what: str) -> None:
        """`seq`'s request fails with `internal_error` (its output goes out with this step's)."""
        if seq is None or seq.request_id not in self.seqs:
            return
        log.error("request %s failed while %s it", seq.request_id, what, exc_info=error)
        message = f"internal error while {what} this request: {type(error).__name__}: {error}"
        error_out = EngineError("internal_error", message[:500])
        self._failed.append(self._finish(seq, "error", error=error_out))
