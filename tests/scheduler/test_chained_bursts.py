"""Chained greedy bursts (`Executor.follow`: the next burst launched before the last one is
committed, its first tokens taken on the device) change no output: the same tokens, text and
finish reasons as one step at a time, through stops mid-burst, aborts, arrivals mid-chain,
max_tokens that are no multiple of the burst, and speculative rows at K = 0; at batches above
MAX_BURST_BATCH too (1-step bursts), the chain going on past the sequences that finish. The KV
cache's blocks stay accounted for after every step and end free. On the CPU each burst runs
eagerly and synchronously, but the order of launches and commits is the GPU's."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from stride.decoders import sampling
from stride.decoders.registry import build_decoders
from stride.decoders.speculative import Speculative
from stride.engine.config import EngineConfig
from stride.engine.cuda_graphs import LENGTH, POSITION, SLOT, TABLE, TOKEN, DecodeGraphs
from stride.engine.engine import Engine
from stride.engine.kv_cache import OutOfBlocks
from stride.engine.sequence import SamplingParams
from stride.scheduler import executor as executor_module
from stride.scheduler.core import EngineCore
from stride.scheduler.executor import GreedyBurst
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.cores import record

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
    tiny_dir, device: str, steps: int, chain: bool, max_num_seqs: int = 8, kv: int = 16 << 20
) -> EngineCore:
    config = EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                          kv_cache_memory=kv)  # fmt: skip
    engine = Engine(config)
    decoders = build_decoders(engine)
    # Costs from sizes, not clocks: the same plans in every run.
    decoders["speculative"] = Speculative(engine, saturation_tokens=0.5, measure_costs=False)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, fused_decode_steps=steps)
    core = EngineCore(engine, scheduler, decoders)
    core.executor.chain = chain
    return core


def _check_blocks(core: EngineCore) -> None:
    """Every block is free or held by exactly one running sequence, which holds its cache."""
    cache = core.engine.cache
    held = [b for s in core.scheduler.running for b in s.block_table]
    assert len(set(held)) == len(held)
    assert not set(held) & set(cache._free)
    assert len(held) + cache.num_free_blocks == cache.num_usable_blocks
    for seq in core.scheduler.running:
        assert seq.num_cached <= len(seq.block_table) * cache.block_size


@dataclass
class _Launch:
    """One `decode_steps` call: whom it ran, for how many steps, and how it was fed."""

    request_ids: list[str]
    steps: int
    chained: bool  # fed an uncommitted burst's last tokens on the device
    while_uncommitted: bool  # exactly one burst (the one it continues) was in flight
    picked: bool  # its first tokens are a subset of that burst's rows


def _run(
    core: EngineCore,
    reqs: list[GenerateRequest],
    first: int,
    abort_at: int,
    arrive_at: int,
) -> tuple[dict[str, tuple], list[_Launch], int]:
    """Results per request (`reqs[:first]` at once, `ABORTED` aborted before step `abort_at`,
    the rest arriving before step `arrive_at`); every burst launched; and how many bursts were
    in flight at the abort. The KV cache's blocks are checked after every step."""
    in_flight = 0
    launches: list[_Launch] = []
    decode_steps, commit = core.engine.runner.decode_steps, core.commit

    def launching(seqs, tokens, steps, *args, **kwargs):
        nonlocal in_flight
        chained = isinstance(tokens, torch.Tensor)
        picked = chained and len(seqs) < len(tokens)
        ids = [s.request_id for s in seqs]
        launches.append(_Launch(ids, steps, chained, chained and in_flight == 1, picked))
        in_flight += 1
        return decode_steps(seqs, tokens, steps, *args, **kwargs)

    def committing(inflight, *args, **kwargs):
        nonlocal in_flight
        in_flight -= isinstance(inflight, GreedyBurst)
        return commit(inflight, *args, **kwargs)

    core.engine.runner.decode_steps, core.commit = launching, committing
    for req in reqs[:first]:
        core.add(req)
    results: dict[str, tuple] = {}
    step = 0
    while core.has_work or step <= max(abort_at, arrive_at):
        outs = []
        if step == abort_at:
            aborted_in_flight = in_flight
            outs.append(core.abort(ABORTED))  # leaves between steps, a burst for it in flight
        if step == arrive_at:
            for req in reqs[first:]:
                core.add(req)  # arrive while a chain runs
        for out in outs + core.step():
            record(results, out)
        _check_blocks(core)
        step += 1
    cache = core.engine.cache
    assert cache.num_free_blocks == cache.num_usable_blocks
    return results, launches, aborted_in_flight


def _same_outputs(single: dict[str, tuple], chained: dict[str, tuple]) -> None:
    """Equal outputs, but for the aborted request, which stopped at a different point in each
    run: one output extends the other."""
    short, long = sorted((single.pop(ABORTED), chained.pop(ABORTED)), key=lambda r: len(r[0]))
    assert short[2] == long[2] == "abort"
    assert long[0][: len(short[0])] == short[0] and long[1].startswith(short[1])
    assert chained == single
    assert all(r[2] is not None and r[3] for r in chained.values())  # finished; passes counted


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_chained_bursts_change_no_output(tiny_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    single, single_launches, _ = _run(_core(tiny_dir, device, 1, True), _requests(), 4, 2, 5)
    chained, launches, aborted_in_flight = _run(
        _core(tiny_dir, device, 4, chain=True), _requests(), 4, 2, 5
    )
    assert not single_launches
    chains = [launch for launch in launches if launch.chained]
    assert len(chains) >= 4 and all(c.while_uncommitted for c in chains) and aborted_in_flight == 1
    _same_outputs(single, chained)
    assert {r[2] for r in chained.values()} >= {"length", "stop"}


def _large_batch_requests() -> list[GenerateRequest]:
    """Twelve plain greedy requests that finish one after another (length, EOS, stop strings,
    stop token ids), a speculative one at K = 0, and late arrivals: greedy, speculative, and a
    sampled one (its draw needs the host: no bursts while it runs)."""

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
            "sampled", [13, 9, 7], SamplingParams(max_tokens=4, temperature=0.8, seed=3)
        ),
    ]
    return reqs


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_chained_one_step_bursts_at_large_batches(tiny_dir, device, monkeypatch):
    """A batch above MAX_BURST_BATCH runs chained 1-step bursts (several steps per burst once it
    has shrunk to MAX_BURST_BATCH): the same outputs as one plain step at a time, and the chain
    goes on past every sequence that finishes, leaving its row out."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    monkeypatch.setattr(executor_module, "MAX_BURST_BATCH", 2)
    single, single_launches, _ = _run(
        _core(tiny_dir, device, 1, chain=True, max_num_seqs=16), _large_batch_requests(), 12, 4, 9
    )
    chained, launches, aborted_in_flight = _run(
        _core(tiny_dir, device, 4, chain=True, max_num_seqs=16), _large_batch_requests(), 12, 4, 9
    )
    assert not single_launches and aborted_in_flight == 1
    _same_outputs(single, chained)
    reasons = {request_id: r[2] for request_id, r in chained.items()}
    assert reasons["len-17"] == "length"
    if device == "cpu":  # where the prompts were picked: every kind of stop, staggered
        assert reasons["eos-14"] == reasons["eos-15"] == reasons["stop-string"] == "stop"
        assert len(chained["eos-14"][0]) == 14 and chained["eos-14"][0][-1] == 2  # EOS
        assert reasons["stop-token"] == "stop" and chained["stop-token"][0][-1] in (4, 11)

    chains = [launch for launch in launches if launch.chained]
    assert all(c.while_uncommitted for c in chains)
    large = [c for c in chains if len(c.request_ids) > 2]
    assert large and all(c.steps == 1 for c in large)
    assert any(len(c.request_ids) > 2 and c.picked for c in chains)  # past finished sequences
    assert sum(c.picked for c in chains) >= 4
    assert any(c.steps > 1 for c in chains)  # a chain of multi-step bursts once the batch shrank
    assert not any("sampled" in launch.request_ids for launch in launches)  # the host draws it
    assert any("late" in c.request_ids for c in chains)  # the chain resumed after the arrivals


def _short_continuations(core: EngineCore) -> list[int]:
    """Collects the reservations that a continuation (`Executor.follow`) found no blocks for."""
    short: list[int] = []
    follow, cache = core.executor.follow, core.engine.cache
    reserve = cache.reserve

    def reserving(seq, num_slots):
        try:
            reserve(seq, num_slots)
        except OutOfBlocks:
            short.append(num_slots)
            raise

    def chaining(*args):
        cache.reserve = reserving
        try:
            return follow(*args)
        finally:
            cache.reserve = reserve

    core.executor.follow = chaining
    return short


def test_chained_bursts_under_kv_pressure(tiny_dir, monkeypatch):
    """With too few KV blocks for everyone, a continuation that cannot reserve its blocks ends
    the chain (what it reserved goes back), sequences are preempted and recomputed, and the
    outputs are still those of one plain step at a time."""
    monkeypatch.setattr(executor_module, "MAX_BURST_BATCH", 2)
    params = [
        SamplingParams(max_tokens=30 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(8)
    ]
    runs = []
    for steps in (1, 4):
        reqs = [GenerateRequest(f"r{i}", [i + 3, 9, 12], p) for i, p in enumerate(params)]
        core = _core(tiny_dir, "cpu", steps, chain=True, max_num_seqs=16, kv=12 * 8192)
        assert core.engine.cache.num_usable_blocks == 11  # 8 KiB blocks; 8 x 3 needed
        short = _short_continuations(core)
        results, launches, _ = _run(core, reqs, len(reqs), 30, 0)
        runs.append((results, launches, core.scheduler.num_preemptions, short))
    (single, _, single_preempted, _), (chained, launches, preempted, short) = runs
    _same_outputs(single, chained)
    assert single_preempted and preempted and short  # a continuation ran out of blocks
    assert sum(launch.chained for launch in launches) >= 4


def test_chained_bursts_match_unchained_ones(tiny_dir):
    """The same bursts, chained or not: the same tokens and the same number of tokens per
    launch (a chain ends where unchained fused steps would stop fusing)."""
    runs = []
    for chain in (False, True):
        core = _core(tiny_dir, "cpu", steps=4, chain=chain)
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
        self._graphs = {(max_batch, False): self}
        self.replayed: list[torch.Tensor] = []

    def replay(self) -> None:
        self.replayed.append(self._inputs.clone())
        self._logits.zero_()
        self._logits[torch.arange(len(self._inputs)), self._inputs[:, TOKEN].long() + 1] = 1


def test_run_steps_feeds_picked_rows_of_device_tokens():
    """A chained burst's first tokens are rows of the last burst's sample, picked on the device
    by the indices packed in the token column; later steps feed their own samples, and each
    step's positions, lengths and K/V slots move one place on through the block tables."""
    graphs = _RecordingGraphs()
    last_sample = torch.tensor([10, 20, 30, 40])
    tables = [[5, 6], [7, 8]]
    argmax = sampling.device_argmax
    sampled = graphs.run_steps(last_sample, [6, 3], [7, 4], tables, 2, argmax, rows=[3, 0])
    assert sampled.tolist() == [[41, 11], [42, 12]]
    first, second = graphs.replayed
    assert first[:2, TOKEN].tolist() == [40, 10] and second[:2, TOKEN].tolist() == [41, 11]
    assert first[:2, POSITION].tolist() == [6, 3] and second[:2, POSITION].tolist() == [7, 4]
    assert first[:2, LENGTH].tolist() == [7, 4] and second[:2, LENGTH].tolist() == [8, 5]
    # Position 6 of [5, 6] is slot 6*4+2; position 3 of [7, 8] is slot 7*4+3, position 4 8*4+0.
    assert first[:2, SLOT].tolist() == [26, 31] and second[:2, SLOT].tolist() == [27, 32]
    assert (first[2:, LENGTH] == 1).all()  # padding rows attend to one slot of block 0

    host_fed = graphs.run_steps([7, 8], [6, 3], [7, 4], tables, 1, argmax)
    in_order = graphs.run_steps(last_sample[:2], [6, 3], [7, 4], tables, 1, argmax)
    assert host_fed.tolist() == [[8, 9]] and in_order.tolist() == [[11, 21]]
