"""A burst's draws replayed as CUDA graphs.

In a burst the decode forward is one graph replay, and the host queues the next step while the
device runs this one, so a step costs the host only what it queues. A sampled row's draw
(`sampling.device_sample`) is two Triton kernels and their buffers (`draw_kernels`), or twenty
to sixty small tensor ops where those do not apply: queued after every replay, they cost a
small batch host time the forward does not. Captured once per (logits buffer, rows, which ops
the settings need), a draw is three: the step's keys copied in, the settings copied in when
they changed (once per launch), one replay.

The logits a burst draws from are a view of the decode graphs' output buffer, the same memory
every step, which is what lets a graph read them: the caller uses these graphs only for such
logits (`ModelRunner.decodes_in_graphs`). Elsewhere (the CPU, a forward's logits, a batch past
`MAX_ROWS`) the draw runs as plain ops, with the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from stride.decoders import sampling
from stride.decoders.sampling import DrawSettings

MAX_ROWS = 8  # graphs for bursts' batches, where the host's share of a step is largest


@dataclass
class _Draw:
    graph: torch.cuda.CUDAGraph
    floats: torch.Tensor  # [B, 5] the settings the graph reads
    keys: torch.Tensor  # [1, B, 1] the keys of the step it draws
    out: torch.Tensor  # [B] the tokens it writes
    loaded: DrawSettings | None = None  # whose settings `floats` holds


class DrawGraphs:
    """`device_sample` for a burst's steps, captured per (logits buffer, rows, ops needed)."""

    def __init__(self) -> None:
        self._draws: dict[tuple, _Draw] = {}
        self._pool = None

    def __call__(self, logits: torch.Tensor, s: DrawSettings, step: int) -> torch.Tensor:
        captured = not (s.all_greedy or len(logits) > MAX_ROWS or s.adjustments is not None)
        if logits.device.type != "cuda" or not captured:  # (nor biases and penalties)
            return sampling.device_sample(logits, s, step)
        ops = (sampling.kernel_route(logits, s), s.any_greedy, s.k_max, s.any_top_p, s.any_top_k,
               s.any_min_p)  # fmt: skip
        key = (logits.data_ptr(), *logits.shape, *ops)
        draw = self._draws.get(key)
        if draw is None:
            draw = self._draws[key] = self._capture(logits, s)
        if draw.loaded is not s:
            draw.floats.copy_(s.floats)
            draw.loaded = s
        draw.keys[0].copy_(s.keys[step])
        draw.graph.replay()
        return draw.out

    def _capture(self, logits: torch.Tensor, s: DrawSettings) -> _Draw:
        floats, keys = s.floats.clone(), s.keys[:1].clone()
        static = replace(s, **sampling.columns(floats), keys=keys)
        out = torch.empty(len(logits), dtype=torch.long, device=logits.device)
        out.copy_(sampling.device_sample(logits, static))  # (kernels compiled, caches filled)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static = replace(s, **sampling.columns(floats), keys=keys)  # (greedy: in the graph)
            out.copy_(sampling.device_sample(logits, static))
        self._pool = graph.pool()
        return _Draw(graph, floats, keys, out)
