"""The logprobs of tokens drawn on the device, kept as one launch's arrays until someone reads them.

A launch at 256 streams draws 256 tokens a step; building a `TokenLogprob` for each (and its two
lists of alternatives) on the step loop's thread made that thread, not the device, set the pace
of the step, and the records are only read in the API process, where they are serialized anyway.
So a launch's logprobs stay three host arrays (`LogprobBlock`), and a sequence's share of them is
one `RowLogprobs`: a read-only list of `TokenLogprob`s made when an item is read. A block crosses
the pipe to the API process once per message, however many rows point at it (pickle's memo).
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import cached_property
from typing import overload

import numpy as np
import torch

from stride.decoders import adjustments, draw_kernels, sampling
from stride.decoders.sampling import DrawSettings, TokenLogprob
from stride.engine.sequence import Sequence


@dataclass(eq=False)
class LogprobBlock:
    """A launch's drawn logprobs on the host: the drawn token's, [steps, rows], and the k most
    likely tokens' ids and values, [steps, rows, k]."""

    chosen: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @cached_property
    def lists(self) -> tuple[list, list, list]:
        """The arrays as nested lists, made once for all of the block's rows (where it is read:
        one `tolist` a block, not three a token)."""
        return self.chosen.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()

    def __getstate__(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.chosen, self.top_ids, self.top_logprobs  # (never the lists)

    def __setstate__(self, state: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        self.chosen, self.top_ids, self.top_logprobs = state


class RowLogprobs(Seq[TokenLogprob]):
    """One sequence's logprobs for `tokens`, drawn at steps `first`, `first + 1`, … of `block`'s
    row `row`, with its `k` alternatives: a list of `TokenLogprob`s, each made when read."""

    __slots__ = ("block", "first", "k", "row", "tokens")

    def __init__(self, block: LogprobBlock, row: int, k: int, tokens: list[int], first: int = 0):
        self.block, self.row, self.k, self.tokens, self.first = block, row, k, tokens, first

    def __len__(self) -> int:
        return len(self.tokens)

    @overload
    def __getitem__(self, i: int) -> TokenLogprob: ...
    @overload
    def __getitem__(self, i: slice) -> RowLogprobs: ...
    def __getitem__(self, i: int | slice) -> TokenLogprob | RowLogprobs:
        if isinstance(i, slice):  # a run of consecutive tokens: their steps follow one another
            start, stop, stride = i.indices(len(self.tokens))
            assert stride == 1, "a row's logprobs are sliced in runs"
            if start == 0 and stop == len(self.tokens):
                return self  # (immutable: the whole run is itself)
            tokens = self.tokens[start:stop]
            return RowLogprobs(self.block, self.row, self.k, tokens, self.first + start)
        j = range(len(self.tokens))[i]  # (IndexError past the end, as a list's)
        chosen, ids, vals = self.block.lists
        step, b, k = self.first + j, self.row, self.k
        return TokenLogprob(self.tokens[j], chosen[step][b], ids[step][b][:k], vals[step][b][:k])

    def __iter__(self) -> Iterator[TokenLogprob]:
        return (self[i] for i in range(len(self.tokens)))

    def __add__(self, other: Seq[TokenLogprob | None]) -> list[TokenLogprob | None]:
        return [*self, *other]

    def __radd__(self, other: Seq[TokenLogprob | None]) -> list[TokenLogprob | None]:
        return [*other, *self]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Seq) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # (as a list's)

    def __reduce__(self) -> tuple[type, tuple]:
        return RowLogprobs, (self.block, self.row, self.k, self.tokens, self.first)


class DrawnLogprobs:
    """The logprobs of the tokens a launch drew on the device, for the rows that ask for them:
    each step's are taken with its draw (`draw`), from the same logits, and copied to the host
    once, behind the launch (like its tokens)."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.wanted = [s.params.logprobs for s in seqs]  # None: the row asks for none
        self.k = max((k for k in self.wanted if k is not None), default=0)
        self._steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._host: list[torch.Tensor] | None = None
        self._copied: torch.cuda.Event | None = None

    @staticmethod
    def of(seqs: list[Sequence]) -> DrawnLogprobs | None:
        return DrawnLogprobs(seqs) if any(s.params.logprobs is not None for s in seqs) else None

    def draw(self, logits: torch.Tensor, s: DrawSettings, step: int) -> torch.Tensor:
        """`device_sample`, and this step's logprobs taken: on the GPU in the same two kernels
        where they can draw these rows. (A row with a logit bias or penalties asks for no
        logprobs, and the rows that ask have neither: theirs are the raw logits' either way.)"""
        route = sampling.kernel_route(logits, s)
        if route is None or self.k > draw_kernels.LOGPROBS_MAX:
            tokens = sampling.device_sample(logits, s, step)
            self.take(logits, tokens)
            return tokens
        drawn = adjustments.apply(logits, s.adjustments)
        tokens, taken = draw_kernels.draw_scored(drawn, s.floats, s.keys[step], *route, self.k)
        adjustments.count(s.adjustments, tokens)
        self._steps.append(taken)
        return tokens

    def take(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Step's logprobs (raw logits, as `sampling.logprobs` takes them): the drawn token's
        and the k most likely, for every row (rows that asked for fewer keep theirs)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        vals, ids = lp.topk(self.k, dim=-1) if self.k else (lp[:, :0], lp[:, :0].long())
        self._steps.append((lp.gather(1, tokens[:, None])[:, 0], vals, ids))

    def copied(self) -> DrawnLogprobs:
        """Queue the copy to the host (after the launch's last step); returns itself."""
        parts = [torch.stack(part) for part in zip(*self._steps, strict=True)]
        if parts[0].is_cuda:
            parts = [p.to("cpu", non_blocking=True) for p in parts]
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._host = parts
        return self

    def per_sequence(self, tokens: list[list[int]]) -> list[Seq[TokenLogprob | None]]:
        """Each row's logprobs step by step, for its drawn `tokens` (waits for the copy)."""
        assert self._host is not None
        if self._copied is not None:
            self._copied.synchronize()
        chosen, vals, ids = (p.numpy() for p in self._host)
        block = LogprobBlock(chosen, ids, vals)
        return [
            [None] * len(made) if k is None else RowLogprobs(block, b, k, made)
            for b, (k, made) in enumerate(zip(self.wanted, tokens, strict=True))
        ]


Logprobs = list[TokenLogprob | None] | RowLogprobs  # a sequence's, one per token (None: not asked)
