"""Draft trees: several continuations verified in one target pass, under a tree attention mask.

A tree hangs under the sequence's last token (its root, the tail the target scores anyway).
Node i holds a draft token and its parent (-1: the root); nodes come parents first, so the
target scores [root, node 0, node 1, ...] as consecutive rows, node i at the position after its
parent's, seeing the sequence, the root, its ancestors and itself. A chain is the tree whose
node i hangs under node i-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int]  # index of each node's parent among the nodes; -1: the root

    @classmethod
    def chain(cls, tokens: list[int]) -> Tree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def subtree(self, nodes: list[int]) -> Tree:
        """The tree of `nodes` (in order, each one's parent among them or the root)."""
        at = {node: j for j, node in enumerate(nodes)}
        parents = [self.parents[i] for i in nodes]
        return Tree([self.tokens[i] for i in nodes], [at[p] if p >= 0 else -1 for p in parents])

    def depths(self) -> list[int]:
        """Depth of each node (1 under the root)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def mask(self) -> torch.Tensor:
        """[1 + n, 1 + n] bool over [root, nodes]: each row sees the root, its ancestors and
        itself."""
        n = len(self)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            if p >= 0:
                m[row] = m[p + 1]
            m[row, row] = True
        return m
