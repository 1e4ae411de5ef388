"""Cores over tiny models, run to the end: what decoder and scheduler tests share."""

from __future__ import annotations

from pathlib import Path

import torch
from scipy.stats import chisquare

from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig


def make_core(model_dir: Path | str | None, kv_bytes: int = 16 << 20, **sched) -> EngineCore:
    engine = Engine(
        EngineConfig(
            model=None if model_dir is None else str(model_dir),
            device="cpu",
            kv_cache_memory=kv_bytes,
        )
    )
    return EngineCore(engine, SchedulerConfig(**sched))


PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7],  # repeats: prompt lookup finds something
    [20, 21, 22, 23],
    [100, 101, 102, 103, 104, 105, 106],
    [40, 41, 40, 41, 40],
]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, requests: list[GenerateRequest], late: list[GenerateRequest] = ()):
    """Run to completion (late requests join after two steps); tokens and stats per request."""
    tokens: dict[str, list[int]] = {}
    stats: dict[str, dict] = {}
    core.preempted = set()
    for r in requests:
        core.add(r)
    steps = 0
    while core.has_work:
        if steps == 2:
            for r in late:
                core.add(r)
        core.preempted |= {s.request_id for s in core.seqs.values() if s.num_preemptions}
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                stats[out.request_id] = out.decoder_stats
        steps += 1
    return tokens, stats


def alone_then_together(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams, decoder: str,
    options: dict, alone: int | None = None,
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Each of the first `alone` prompts (all by default) decoded by itself, then all of them
    in one batch: (tokens alone, tokens together), by request id (the prompt's index)."""
    by_itself: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:alone]):
        tokens, _ = run(core, [GenerateRequest(str(i), p, params, decoder, options)])
        by_itself[str(i)] = tokens[str(i)]
    batch = [GenerateRequest(str(i), p, params, decoder, options) for i, p in enumerate(prompts)]
    together, _ = run(core, batch)
    return by_itself, together


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() / probs.double().sum() * observed.sum()
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def joint_pvalue(tokens: dict[str, list[int]], joint: torch.Tensor) -> float:
    """The χ² p-value of outputs' first two tokens against `joint` (`exact_joint`'s table),
    after checking that no output fell outside its support."""
    cells = joint.flatten().nonzero()[:, 0]
    counts = torch.zeros(joint.numel(), dtype=torch.float64)
    for t in tokens.values():
        counts[t[0] * joint.shape[1] + t[1]] += 1
    assert counts.sum() == counts[cells].sum()  # nothing outside the target's support
    return chi2_pvalue(counts[cells], joint.flatten()[cells])


def exact_joint(tiny_hf, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """p(t1, t2) of the target under temperature/top-k, as a [vocab, vocab] table."""
    from stride.decoders import sampling

    def dist(ids: list[int]) -> torch.Tensor:
        logits = tiny_hf(torch.tensor([ids])).logits[0, -1:].float()
        row = sampling.Row(Sequence("x", ids, params))
        return sampling.probabilities(logits, [row])[0]

    with torch.no_grad():
        first = dist(prompt)
        joint = torch.zeros(first.numel(), first.numel(), dtype=torch.float64)
        for t in first.nonzero()[:, 0].tolist():
            joint[t] = first[t].double() * dist(prompt + [t]).double()
    return joint


def record(results: dict[str, tuple], out) -> None:
    """Fold one output into its request's (tokens, text, finish reason, passes counted)."""
    tokens, text, _, _ = results.get(out.request_id, ((), "", None, None))
    stats = out.decoder_stats
    results[out.request_id] = (
        tokens + tuple(out.token_ids),
        text + out.text,
        out.finish_reason,
        stats and stats["forward_passes"] >= len(tokens) + len(out.token_ids),
    )

