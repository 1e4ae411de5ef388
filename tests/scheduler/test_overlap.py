"""Launches kept in flight (the executor's overlap: the next step is scheduled, proposed and
launched before the last one is committed, its rows fed on the device) change no output: the
same tokens, text, logprobs and finish reasons as one launch at a time, through stops
mid-burst, aborts, arrivals, max_tokens that are no multiple of the burst, sampled and
speculative rows beside plain ones, and KV pressure. The KV cache's blocks stay accounted for
after every step and end free. On the CPU every launch is synchronous, but with overlap forced
on the order of launches and commits is the GPU's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stride.decoders import sampling
from stride.decoders.registry import DecodersConfig, build_decoders
from stride.decoders.speculative import Speculative
from stride.engine.config import EngineConfig
from stride.engine.cuda_graphs import LENGTH, POSITION, SLOT, TABLE, TOKEN, DecodeGraphs
from stride.engine.engine import Engine
from stride.engine.sequence import Constraint, SamplingParams
from stride.scheduler import executor as executor_module
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import Scheduler, SchedulerConfig
from tests.helpers.cores import record
from tests.helpers.models import make_model_dir

ABORTED = "r1"


def _requests() -> list[GenerateRequest]:
    reqs = []
    for i in range(7):
        params = SamplingParams(
            max_tokens=6 + 5 * i,  # mostly no multiple of the burst length (4)
            temperature=0.0,
            ignore_eos=i % 2 == 0,
            stop=["e"] if i == 3 else [],
            stop_token_ids=[7, 11] if i == 4 else [],
        )
        prompt = [5 + i, 9, 12 + i, 7, 30 + i][: 1 + i % 5]
        if i in (2, 5):  # adaptive speculative whose drafts do not pay: K = 0 between probes
            options = {"draft": "ngram", "adaptive": True}
            reqs.append(GenerateRequest(f"r{i}", prompt, params, "speculative", options))
        elif i == 6:  # a fixed K = 0: decodes as `ar` for good
            options = {"num_speculative_tokens": 0}
            reqs.append(GenerateRequest(f"r{i}", prompt, params, "speculative", options))
        else:
            reqs.append(GenerateRequest(f"r{i}", prompt, params))
    return reqs


def _core(
    tiny_dir, device: str, steps: int, overlap: bool, max_num_seqs: int = 8, kv: int = 16 << 20
) -> EngineCore:
    config = EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                          kv_cache_memory=kv)  # fmt: skip
    engine = Engine(config)
    decoders = build_decoders(engine)
    # Costs from sizes, not clocks: the same plans in every run.
    decoders["speculative"] = Speculative(engine, saturation_tokens=0.5, measure_costs=False)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, fused_decode_steps=steps)
    core = EngineCore(engine, scheduler, decoders)
    core.executor.overlap = overlap
    return core


def _check_blocks(core: EngineCore) -> None:
    """Every block is free or held by exactly one running sequence, which holds its cache and
    the slots that launches in flight write for it (up to its last pending token's)."""
    cache = core.engine.cache
    held = [b for s in core.scheduler.running for b in s.block_table]
    assert len(set(held)) == len(held)
    assert not set(held) & set(cache._free)
    assert len(held) + cache.num_free_blocks == cache.num_usable_blocks
    for seq in core.scheduler.running:
        written = seq.num_tokens - 1 + seq.pending if seq.pending else seq.num_cached
        assert written <= len(seq.block_table) * cache.block_size


@dataclass
class _Launch:
    """One `decode_steps` call: whom it ran, for how many steps, and how it was fed."""

    request_ids: list[str]
    steps: int
    fed: bool  # its first tokens came from a launch not yet committed, on the device
    while_uncommitted: bool  # that launch was in flight
    picked: bool  # its rows are fewer than that launch's (some finished meanwhile)


def _run(
    core: EngineCore,
    reqs: list[GenerateRequest],
    first: int,
    abort_at: int,
    arrive_at: int,
) -> tuple[dict[str, tuple], list[_Launch], bool]:
    """Results per request (`reqs[:first]` at once, `ABORTED` aborted before step `abort_at`,
    the rest arriving before step `arrive_at`); every burst launched; and whether a launch was
    in flight at the abort. The KV cache's blocks are checked after every step."""
    launches: list[_Launch] = []
    executor = core.executor
    decode_steps = core.engine.runner.decode_steps

    def launching(seqs, tokens, steps, *args, **kwargs):
        before = executor._in_flight
        fed = any(s.pending for s in seqs)
        picked = fed and len(seqs) < len(before.rows)
        ids = [s.request_id for s in seqs]
        launches.append(_Launch(ids, steps, fed, before is not None, picked))
        return decode_steps(seqs, tokens, steps, *args, **kwargs)

    core.engine.runner.decode_steps = launching
    for req in reqs[:first]:
        core.add(req)
    results: dict[str, tuple] = {}
    aborted_in_flight = False
    step = 0
    while core.has_work or step <= max(abort_at, arrive_at):
        outs = []
        if step == abort_at:
            aborted_in_flight = executor.in_flight
            outs.append(core.abort(ABORTED))  # leaves between steps, a launch for it in flight
        if step == arrive_at:
            for req in reqs[first:]:
                core.add(req)  # arrive while others decode
        for out in outs + core.step():
            record(results, out)
        _check_blocks(core)
        step += 1
    cache = core.engine.cache
    assert cache.num_free_blocks == cache.num_usable_blocks
    return results, launches, aborted_in_flight


def _same_outputs(single: dict[str, tuple], overlapped: dict[str, tuple]) -> None:
    """Equal outputs, but for the aborted request, which stopped at a different point in each
    run: one output extends the other."""
    short, long = sorted((single.pop(ABORTED), overlapped.pop(ABORTED)), key=lambda r: len(r[0]))
    assert short[2] == long[2] == "abort"
    assert long[0][: len(short[0])] == short[0] and long[1].startswith(short[1])
    assert overlapped == single
    assert all(r[2] is not None and r[3] for r in overlapped.values())  # finished; passes counted


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_overlapped_bursts_change_no_output(tiny_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    single, single_launches, _ = _run(_core(tiny_dir, device, 1, False), _requests(), 4, 2, 5)
    overlapped, launches, aborted_in_flight = _run(
        _core(tiny_dir, device, 4, overlap=True), _requests(), 4, 2, 5
    )
    assert not single_launches
    fed = [launch for launch in launches if launch.fed]
    assert len(fed) >= 4 and all(c.while_uncommitted for c in fed) and aborted_in_flight
    _same_outputs(single, overlapped)
    assert {r[2] for r in overlapped.values()} >= {"length", "stop"}


def _large_batch_requests() -> list[GenerateRequest]:
    """Twelve plain greedy requests that finish one after another (length, EOS, stop strings,
    stop token ids), a speculative one at K = 0, and late arrivals: greedy, speculative, a
    seeded sampled one (drawn on the device, in launches that stay in flight) and one with a
    logit bias (its draw needs the host: nothing stays in flight while it runs)."""

    def greedy(max_tokens: int, **kwargs) -> SamplingParams:
        kwargs.setdefault("ignore_eos", True)
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)

    reqs = [
        GenerateRequest("eos-14", [202, 9], greedy(30, ignore_eos=False)),  # EOS: 14th token
        GenerateRequest("eos-15", [198, 9], greedy(30, ignore_eos=False)),
        GenerateRequest(ABORTED, [6, 9, 12], greedy(30)),
        GenerateRequest("stop-string", [8, 9, 15, 7], greedy(30, stop=["e"])),
        GenerateRequest("stop-token", [9, 9, 16, 7, 34], greedy(30, stop_token_ids=[4, 11])),
        GenerateRequest("k0", [10, 9], greedy(21), "speculative", {"num_speculative_tokens": 0}),
    ]
    reqs += [GenerateRequest(f"len-{n}", [n, 9, 12], greedy(n)) for n in (3, 5, 8, 11, 13, 17)]
    reqs += [
        GenerateRequest("late", [11, 9, 12], greedy(24)),
        GenerateRequest(
            "late-spec", [12, 9], greedy(10), "speculative", {"draft": "ngram", "adaptive": True}
        ),
        GenerateRequest(
            "sampled", [13, 9, 7], SamplingParams(max_tokens=9, temperature=0.8, seed=3)
        ),
        GenerateRequest(
            "host",
            [14, 9, 7],
            SamplingParams(max_tokens=4, temperature=0.8, seed=4, logit_bias={5: 0.0}, logprobs=1),
        ),
    ]
    return reqs


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_one_step_launches_stay_in_flight_at_large_batches(tiny_dir, device, monkeypatch):
    """A batch above MAX_BURST_BATCH runs 1-step launches kept in flight (several steps per
    burst once it has shrunk to MAX_BURST_BATCH): the same outputs as one plain step at a
    time, and the launches go on past every sequence that finishes, leaving its row out."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    monkeypatch.setattr(executor_module, "MAX_BURST_BATCH", 2)
    single, single_launches, _ = _run(
        _core(tiny_dir, device, 1, False, max_num_seqs=16), _large_batch_requests(), 12, 4, 9
    )
    overlapped, launches, aborted_in_flight = _run(
        _core(tiny_dir, device, 4, True, max_num_seqs=16), _large_batch_requests(), 12, 4, 9
    )
    assert not single_launches and aborted_in_flight
    _same_outputs(single, overlapped)
    reasons = {request_id: r[2] for request_id, r in overlapped.items()}
    assert reasons["len-17"] == "length"
    if device == "cpu":  # where the prompts were picked: every kind of stop, staggered
        assert reasons["eos-14"] == reasons["eos-15"] == reasons["stop-string"] == "stop"
        assert len(overlapped["eos-14"][0]) == 14 and overlapped["eos-14"][0][-1] == 2  # EOS
        assert reasons["stop-token"] == "stop" and overlapped["stop-token"][0][-1] in (4, 11)

    fed = [launch for launch in launches if launch.fed]
    assert all(c.while_uncommitted for c in fed)
    large = [c for c in fed if len(c.request_ids) > 2]
    assert large and all(c.steps == 1 for c in large)
    assert any(len(c.request_ids) > 2 and c.picked for c in fed)  # past finished sequences
    assert sum(c.picked for c in fed) >= 4
    assert any(c.steps > 1 for c in fed)  # multi-step bursts in flight once the batch shrank
    assert any("sampled" in c.request_ids for c in fed)  # drawn on the device
    assert not any("host" in launch.request_ids for launch in launches)  # the host draws it
    assert any("late" in c.request_ids for c in fed)  # launches stayed in flight after arrivals


def test_fed_rows_sit_out_under_kv_pressure(tiny_dir, monkeypatch):
    """With too few KV blocks for everyone, a fed row that cannot reserve its next slot sits the
    step out (it is never preempted while a launch writes its blocks), others are preempted and
    recomputed, and the outputs are still those of one plain step at a time."""
    monkeypatch.setattr(executor_module, "MAX_BURST_BATCH", 2)
    params = [
        SamplingParams(max_tokens=30 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(8)
    ]
    runs = []
    for steps, overlap in ((1, False), (4, True)):
        reqs = [GenerateRequest(f"r{i}", [i + 3, 9, 12], p) for i, p in enumerate(params)]
        core = _core(tiny_dir, "cpu", steps, overlap, max_num_seqs=16, kv=12 * 8192)
        assert core.engine.cache.num_usable_blocks == 11  # 8 KiB blocks; 8 x 3 needed
        short: list[str] = []
        reserve = Scheduler._reserve

        def reserving(self, seq, slots, _short=short, _reserve=reserve):
            ok = _reserve(self, seq, slots)
            if not ok and seq.pending:
                _short.append(seq.request_id)
            return ok

        monkeypatch.setattr(Scheduler, "_reserve", reserving)
        results, launches, _ = _run(core, reqs, len(reqs), 30, 0)
        runs.append((results, launches, core.scheduler.num_preemptions, short))
    (single, _, single_preempted, _), (overlapped, launches, preempted, short) = runs
    _same_outputs(single, overlapped)
    assert single_preempted and preempted and short  # a fed row ran out of blocks
    assert sum(launch.fed for launch in launches) >= 4


def test_overlapped_bursts_match_waited_ones(tiny_dir):
    """The same bursts, kept in flight or not: the same tokens and the same number of tokens per
    launch."""
    runs = []
    for overlap in (False, True):
        core = _core(tiny_dir, "cpu", steps=4, overlap=overlap)
        bursts: list[int] = []
        decode_steps = core.engine.runner.decode_steps

        def counting(seqs, tokens, steps, *args, _d=decode_steps, _b=bursts, **kwargs):
            _b.append(steps)
            return _d(seqs, tokens, steps, *args, **kwargs)

        core.engine.runner.decode_steps = counting
        params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)
        for i in range(3):
            core.add(GenerateRequest(f"r{i}", [5 + i, 9, 12], params))
        tokens: dict[str, list[int]] = {}
        while core.has_work:
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        runs.append((tokens, bursts))
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) == 22  # the first token comes from the prefill


def _mixed_requests(spec: dict | None = None, sampled: bool = True) -> list[GenerateRequest]:
    """Ten requests, greedy and sampled, one with logprobs; with `spec`, every other one decodes
    speculatively with those options."""
    reqs = []
    for i in range(10):
        params = SamplingParams(
            max_tokens=3 + 2 * i,
            temperature=0.0 if i % 3 or not sampled else 0.8,
            seed=i,
            ignore_eos=i % 2 == 0,
            stop=["e"] if i == 5 else [],
            logprobs=2 if i == 7 else None,
        )
        prompt = [5 + i, 9, 12 + i, 7, 5 + i, 9][: 2 + i % 5]
        if spec is not None and i % 2 == 0:
            reqs.append(GenerateRequest(f"r{i}", prompt, params, "speculative", dict(spec)))
        else:
            reqs.append(GenerateRequest(f"r{i}", prompt, params))
    return reqs


def _run_mixed(core: EngineCore, overlap: bool, reqs: list[GenerateRequest]) -> dict:
    """Each request's (token ids, text, logprobs, finish reason); logprobs as (token id,
    logprob) pairs, None where the request asked for none."""
    core.executor.overlap = overlap
    for req in reqs[:6]:
        core.add(req)
    results: dict[str, tuple] = {}
    step = 0
    while core.has_work or step < 4:
        if step == 2:
            core.abort("r1")  # leaves while a launch for it may be in flight
        if step == 3:
            for req in reqs[6:]:
                core.add(req)  # arrive while everyone decodes
        for out in core.step():
            tokens, text, lps, _ = results.get(out.request_id, ([], "", [], None))
            new_lps = [None if lp is None else (lp.token_id, lp.logprob) for lp in out.logprobs]
            results[out.request_id] = (tokens + out.token_ids, text + out.text, lps + new_lps,
                                       out.finish_reason)  # fmt: skip
        step += 1
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks
    return results


def _same_mixed(one: dict[str, tuple], other: dict[str, tuple]) -> None:
    """Equal `_run_mixed` outputs, but for the aborted request, which stopped at a different
    point in each run (a launch in flight for it is dropped): one output extends the other.
    Tokens, text and finish reasons are equal exactly; logprobs to float32 rounding, since a
    row's logits are summed in an order that may depend on its batch's size on a
    many-threaded CPU."""
    short, long = sorted((one.pop("r1"), other.pop("r1")), key=lambda r: len(r[0]))
    assert short[3] is None and long[3] is None
    assert long[0][: len(short[0])] == short[0] and long[1].startswith(short[1])
    assert one.keys() == other.keys()
    for request_id, (tokens, text, lps, end) in one.items():
        other_tokens, other_text, other_lps, other_end = other[request_id]
        assert (tokens, text, end) == (other_tokens, other_text, other_end), request_id
        assert _logprob_tokens(lps) == _logprob_tokens(other_lps), request_id
        assert _logprob_values(lps) == pytest.approx(_logprob_values(other_lps), abs=1e-3)


def _logprob_tokens(lps: list) -> list:
    return [None if lp is None else lp[0] for lp in lps]


def _logprob_values(lps: list) -> list[float]:
    return [lp[1] for lp in lps if lp is not None]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_overlap_changes_no_output_beside_sampled_rows(tiny_dir, device):
    """Seeded sampled rows, drawn on the device in launches that stay in flight, give what the
    host draws for them without overlap."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    config = EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                          kv_cache_memory=16 << 20)  # fmt: skip
    runs = [
        _run_mixed(EngineCore(Engine(config), SchedulerConfig(max_num_seqs=8)), overlap,
                   _mixed_requests())  # fmt: skip
        for overlap in (True, False)
    ]
    _same_mixed(*runs)


def _constrained_requests() -> list[GenerateRequest]:
    """Rows under a JSON schema or a regex, greedy and seeded sampled (r7 with a top-k), one
    with logprobs (r8, short: after it refuses a token, launches wait for the host), beside
    free ones; r1 is aborted, r6 to r8 arrive late (`_run_mixed`)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    obj = Constraint("json_schema", json.dumps(schema))
    regex = Constraint("regex", r"(yes|no), [0-9]{3}!")
    kinds = [obj, regex, obj, None, None, obj, obj, regex, obj]
    reqs = []
    for i, constraint in enumerate(kinds):
        params = SamplingParams(
            max_tokens=12 if i == 8 else 40, temperature=0.9 if i in (2, 4, 7) else 0.0, seed=i,
            top_k=5 if i == 7 else 0, ignore_eos=constraint is None,
            logprobs=2 if i == 8 else None, constraint=constraint,
        )  # fmt: skip
        reqs.append(GenerateRequest(f"r{i}", [5 + i, 9, 12 + i, 7][: 2 + i % 3], params))
    return reqs


@pytest.mark.parametrize(("device", "steps"), [("cpu", 1), ("cpu", 4), ("cuda", 1), ("cuda", 4)])
def test_rows_under_a_grammar_stay_in_flight_and_change_no_output(
    tiny_dir, device, steps, monkeypatch
):
    """Rows under a grammar whose tokens can be checked as they commit (greedy, or sampled
    without truncation) are drawn on the device in launches kept in flight; a token the grammar
    refuses voids what the launch in flight made for its sequence, and is drawn again under the
    mask at its commit, from the raw logits its launch kept (`sampling.redrawn`), in bursts and
    in forwards. A row with a top-k is drawn on the host every step. Every output is what one
    launch at a time gives."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    launches = []  # (kept in flight, whose rows it drew on the device)
    while_void = []  # whose rows launched while a launch in flight made void tokens for them
    redrawn = []  # (request id, the kind of launch that kept the logits) of each redraw
    launch, redraw = executor_module.Executor._launch, sampling.redrawn
    kinds = {}  # the kind of launch that made each row's last draw, by request id

    def recording(self, batch):
        while_void.extend(item.seq.request_id for item in batch.plan if item.seq.void)
        made = launch(self, batch)
        if made is not None:
            launches.append((made.continuable, {seq.request_id for seq in made.sampling}))
            kinds.update(dict.fromkeys(made.drawn_from, type(made).__name__))
        return made

    def redrawing(seq, drawn_from, i):
        token = redraw(seq, drawn_from, i)
        if drawn_from is not None and seq.grammar.instead is None:
            redrawn.append((seq.request_id, kinds[seq.request_id]))
        return token

    monkeypatch.setattr(executor_module.Executor, "_launch", recording)
    monkeypatch.setattr(sampling, "redrawn", redrawing)
    config = EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                          kv_cache_memory=16 << 20)  # fmt: skip
    runs = []
    for overlap in (True, False):
        scheduler = SchedulerConfig(max_num_seqs=8, fused_decode_steps=steps if overlap else 1)
        core = EngineCore(Engine(config), scheduler)
        runs.append(_run_mixed(core, overlap, _constrained_requests()))
        in_flight = set().union(*(drawn for kept, drawn in launches if kept))
        assert bool({"r0", "r2", "r5"} & in_flight) == overlap  # constrained, drawn on the device
        assert "r7" not in set().union(*(drawn for _, drawn in launches))  # (its top-k)
        assert bool(while_void) == overlap  # refused tokens with a launch in flight after them
        assert ("BurstLaunch" in {kind for _, kind in redrawn}) == overlap
        launches.clear()
        while_void.clear()
        redrawn.clear()
    _same_mixed(*runs)
    ends = {request_id: r[3] for request_id, r in runs[0].items()}
    assert ends["r0"] == ends["r5"] == "stop"  # the grammar ended them


def test_a_sequence_whose_tokens_in_flight_are_void_may_be_preempted(tiny_dir, monkeypatch):
    """A sequence whose grammar refused a token while a launch in flight continued from it is
    scheduled from its committed tokens meanwhile, so it may be preempted (its blocks freed)
    before that launch is done: its void writes come first in stream order. With KV for six
    blocks, that happens, and every output is still what one launch at a time gives."""
    preempted = []  # (request id, void tokens in flight) at each preemption
    preempt = Scheduler._preempt

    def noted(self, seq, decoders):
        preempted.append((seq.request_id, seq.void))
        return preempt(self, seq, decoders)

    monkeypatch.setattr(Scheduler, "_preempt", noted)
    config = EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32",
                          kv_cache_memory=60_000)  # fmt: skip
    runs = []
    for overlap in (True, False):
        core = EngineCore(Engine(config), SchedulerConfig(max_num_seqs=8))
        assert core.engine.cache.num_usable_blocks == 6
        runs.append(_run_mixed(core, overlap, _constrained_requests()))
        assert any(void for _, void in preempted) == overlap
        preempted.clear()
    _same_mixed(*runs)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("draft") / "other", seed=1)


def _spec_core(model: Path, draft: Path, measure_costs: bool) -> EngineCore:
    engine = Engine(EngineConfig(model=str(model), device="cpu", kv_cache_memory=16 << 20))
    decoders = build_decoders(engine, DecodersConfig(draft_model=str(draft)))
    if not measure_costs:  # K from sizes and acceptance only: the same in every run
        decoders["speculative"] = Speculative(
            engine, str(draft), saturation_tokens=1e9, measure_costs=False
        )
    return EngineCore(engine, SchedulerConfig(max_num_seqs=8), decoders)


@pytest.mark.parametrize("adaptive", ["off", "on", "measured"])
@pytest.mark.parametrize("draft", ["ngram", "early_exit", "model"])
def test_overlap_changes_no_speculative_output(tiny_dir, draft_dir, draft, adaptive):
    """Speculative sequences mixed with plain ones: keeping launches in flight changes no token.

    "measured" times steps, so K (and with it a sampled request's draws) varies from run to
    run: there all requests are greedy, whose output does not depend on K.
    """
    measured = adaptive == "measured"
    results = []
    for overlap in (True, False):
        core = _spec_core(tiny_dir, draft_dir, measure_costs=measured)
        name = core.decoders["speculative"].draft_model.name if draft == "model" else draft
        spec = {"draft": name, "num_speculative_tokens": 3, "adaptive": adaptive != "off"}
        if draft == "early_exit":
            spec["exit_layer"] = 1
        results.append(_run_mixed(core, overlap, _mixed_requests(spec, sampled=not measured)))
    _same_mixed(*results)


class _RecordingGraphs(DecodeGraphs):
    """`DecodeGraphs`' host side on the CPU: each replay records its input rows, and its logits
    make every row's argmax its input token plus one."""

    def __init__(self, block_size: int = 4, max_batch: int = 8, max_blocks: int = 4) -> None:
        self.cache = SimpleNamespace(block_size=block_size)
        self.max_blocks = max_blocks
        self.buckets = [max_batch]
        width = TABLE + max_blocks
        self._host = torch.zeros(max_batch, width, dtype=torch.int32)
        self._host_np = self._host.numpy()
        self._inputs = torch.zeros(max_batch, width, dtype=torch.int32)
        self._steps_host = torch.zeros(4 * max_batch, width, dtype=torch.int32)  # not pinned
        self._steps_inputs = self._steps_host.clone()
        self._copied = SimpleNamespace(synchronize=lambda: None, record=lambda: None)
        self._logits = torch.zeros(max_batch, 100)
        self._graphs = {(max_batch, False, "rows"): self}
        self.replayed: list[torch.Tensor] = []

    def replay(self) -> None:
        self.replayed.append(self._inputs.clone())
        self._logits.zero_()
        self._logits[torch.arange(len(self._inputs)), self._inputs[:, TOKEN].long() + 1] = 1


def test_graph_rows_take_their_tokens_from_the_device():
    """A burst's first tokens may be a device tensor (the last samples of a launch in flight);
    later steps feed their own samples, and each step's positions, lengths and K/V slots move
    one place on through the block tables. One step's fed rows read theirs from a device
    tensor by index, the other rows from the host."""
    graphs = _RecordingGraphs()
    tables = [[5, 6], [7, 8]]
    def argmax(logits: torch.Tensor, step: int) -> torch.Tensor:
        return logits.argmax(-1)

    sampled = graphs.run_steps(torch.tensor([40, 10]), [6, 3], [7, 4], tables, 2, argmax)
    assert sampled.tolist() == [[41, 11], [42, 12]]
    first, second = graphs.replayed
    assert first[:2, TOKEN].tolist() == [40, 10] and second[:2, TOKEN].tolist() == [41, 11]
    assert first[:2, POSITION].tolist() == [6, 3] and second[:2, POSITION].tolist() == [7, 4]
    assert first[:2, LENGTH].tolist() == [7, 4] and second[:2, LENGTH].tolist() == [8, 5]
    # Position 6 of [5, 6] is slot 6*4+2; position 3 of [7, 8] is slot 7*4+3, position 4 8*4+0.
    assert first[:2, SLOT].tolist() == [26, 31] and second[:2, SLOT].tolist() == [27, 32]
    assert (first[2:, LENGTH] == 1).all()  # padding rows attend to one slot of block 0

    host_fed = graphs.run_steps([7, 8], [6, 3], [7, 4], tables, 1, argmax)
    assert host_fed.tolist() == [[8, 9]]
    last_sample = torch.tensor([10, 20, 30, 40])
    logits = graphs.run([7, 0], [6, 3], [7, 4], tables, fed=([(1, 3)], last_sample))
    assert graphs.replayed[-1][:2, TOKEN].tolist() == [7, 40]
    assert logits.argmax(-1).tolist() == [8, 41]


def test_chunked_prefills_beside_launches_in_flight(tiny_dir):
    """Long prompts arrive in chunks of a small token budget while plain rows stay in flight:
    each chunk's K/V stays cached once launched (its next chunk runs in the next step), and the
    last chunk's, which a launch in flight writes, outlives the trims of the steps before."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(f"short{i}", [5 + i, 9], params) for i in range(3)]
    # Prompts of many lengths (and first tokens: no shared prefix blocks), so that some last
    # chunk crosses a block boundary.
    reqs += [
        GenerateRequest(f"long{n}", [n, *range(7, 6 + n)], params) for n in range(17, 33, 3)
    ]
    runs = []
    for steps, overlap in ((1, False), (4, True)):
        config = EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32",
                              kv_cache_memory=16 << 20)  # fmt: skip
        scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8,
                                    fused_decode_steps=steps)  # fmt: skip
        core = EngineCore(Engine(config), scheduler)
        core.executor.overlap = overlap
        results: dict[str, tuple] = {}
        for req in reqs[:3]:
            core.add(req)
        step = 0
        while core.has_work or step < 3:
            if step == 2:
                for req in reqs[3:]:
                    core.add(req)
            for out in core.step():
                record(results, out)
            _check_blocks(core)
            step += 1
        assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks
        runs.append(results)
    assert runs[0] == runs[1]
