"""Where a device cycle's rows sit (`cycles`): the slots it writes from the tail's on
(`Rows`), what every cycle of one batch size and shape reads and never changes (`Fixed`, made
before its graph is captured), and how far past a sequence's cache a burst may write (`reach`),
which the KV slots reserved for it must cover."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stride.decoders.speculative.device_tree import TreeConstants, TreeShape


@dataclass
class Rows:
    """The slots a cycle writes, from the tail's on: context index `at` = base + s [B, span],
    the cache slot of each and the context length a row there attends to."""

    at: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor


@dataclass
class Fixed:
    """What every cycle at one batch size and shape reads and never changes, made once before
    its graph is captured (inside a graph, each op that made them would launch at every replay)."""

    steps: torch.Tensor  # [span] 0, 1, 2, ...
    causal: torch.Tensor  # [B * (depth + 1), depth + 1] bool: catch-up rows' mask, a chain's
    chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a chain's parents, depths, sees
    scratch_levels: torch.Tensor  # [scratch] a tree's scratch row s is at position base + s // k
    tree: TreeConstants | None

    @classmethod
    def of(cls, b: int, shape: TreeShape, device: torch.device) -> Fixed:
        steps = torch.arange(shape.span, device=device)
        k1 = shape.depth + 1
        lower = torch.ones(k1, k1, dtype=torch.bool, device=device).tril()
        chain = ((steps[:k1] - 1).clamp(min=0).expand(b, k1), steps[:k1].expand(b, k1),
                 lower.expand(b, k1, k1))  # fmt: skip
        tree = None if shape.is_chain else TreeConstants.of(b, shape, device)
        return cls(steps, lower.repeat(b, 1), chain, steps[: shape.scratch] // shape.topk, tree)

    @staticmethod
    def per_row(x: torch.Tensor, r: int) -> torch.Tensor:
        """Each sequence's row of `x` [B, ...] repeated for its `r` rows: [B * r, ...]."""
        return x[:, None].expand(x.shape[0], r, *x.shape[1:]).flatten(0, 1)


def reach(shape: TreeShape, cycles: int) -> int:
    """Slots past `num_cached` that `cycles` cycles of `shape` may write."""
    return cycles * shape.advance + shape.span
