"""Draft trees as tensors of fixed shape, for the speculation loop on the device (`cycles`).

EAGLE-2's dynamic tree, as `EagleDrafter.draft_trees` drafts it on the host, with no Python
loop over sequences or nodes (only over the tree's levels, a static count), so that a cycle can
be one CUDA graph: the root's `topk` most likely children are the first level; each level's
`topk` most likely nodes (by cumulative draft log-probability) are expanded by one head row each
into their `topk` most likely children; the tree keeps the `nodes - 1` most likely candidates.

A child's score is its parent's plus its own log-probability, nudged below the parent's where
rounding would make them equal, so scores fall strictly along every path: the best candidates
by score always include their ancestors, and in descending order of score parents come before
their children, which is the order the tree's rows take.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    """What a cycle's graph is captured for: `nodes` verified rows per sequence (the root, the
    tail the target scores anyway, then nodes - 1 drafts) over `depth` levels, `topk` children
    per expanded node. A chain of K drafts is `TreeShape.chain(K)`: one child per level.
    `sampled`: its rows may sample; a chain then draws its drafts and accepts them by the
    rejection rule, a tree follows its nodes (the head's most likely, as for greedy rows) where
    they equal the target's draws (`verify.verify_drawn`); otherwise drafts and acceptance are
    the argmax. `ranks`: how many of their most likely tokens the sampled rows' draws rank
    (`draws.ranks`: 0 where no row has a top-k or top-p, and no draw sorts)."""

    nodes: int
    depth: int
    topk: int
    sampled: bool = False
    ranks: int = 0

    @classmethod
    def chain(cls, k: int, sampled: bool = False, ranks: int = 0) -> TreeShape:
        return cls(k + 1, k, 1, sampled, ranks)

    @classmethod
    def of(
        cls, drafts: int, depth: int, topk: int, sampled: bool = False, ranks: int = 0
    ) -> TreeShape:
        """The tree of at most `drafts` nodes a request asks for, made to fit what EAGLE-2
        produces: at most `drafts` levels, and no more nodes than candidates."""
        depth = min(depth, drafts)
        candidates = topk + (depth - 1) * topk * topk
        return cls(min(drafts, candidates) + 1, depth, topk, sampled, ranks)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def scratch(self) -> int:
        """The head's expansion rows: `topk` per level but the last, in slots past the root's."""
        return (self.depth - 1) * self.topk

    @property
    def advance(self) -> int:
        """The most tokens a cycle commits (all levels accepted, and the bonus)."""
        return self.depth + 1

    @property
    def span(self) -> int:
        """Slots a cycle writes from its root's on (target: the tree; head: scratch, catch-up)."""
        return max(self.nodes, self.scratch, self.depth + 1)


@dataclass
class DraftedTree:
    """One tree per sequence, rows parents first (row 0 the root)."""

    tokens: torch.Tensor  # [B, N] the root's token (the tail), then the drafts
    parents: torch.Tensor  # [B, N] each row's parent row (the root: itself)
    depths: torch.Tensor  # [B, N] 0 for the root
    sees: torch.Tensor  # [B, N, N] bool: row r's ancestors and itself


# expand(level, tokens [R], hidden [R, H], sees [R, scratch]) -> the head's outputs [R, H] for
# rows that read level `level`'s frontier: R = B * topk, row j of a sequence in scratch slot
# (level - 1) * topk + j past the root's, seeing the prefix and the scratch slots `sees` allows.
Expand = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TreeConstants:
    """What `draft_tree` reads at one batch size and shape and never changes, made once (a
    cycle is a CUDA graph: each op that made them would launch at every replay)."""

    first_paths: torch.Tensor  # [B, k, depth] the first level's paths: their own id, then -1
    no_scratch: torch.Tensor  # [B, k, scratch] False: the first level sees no scratch row
    own: torch.Tensor  # [depth - 1, 1, k, scratch] frontier row j's own scratch slot, per level
    children: torch.Tensor  # [k, k] a frontier row's children's ids, less the level's offset
    columns: torch.Tensor  # [depth] which column of a path is which level
    floor: torch.Tensor  # () -inf: `nextafter` toward it
    lower: torch.Tensor  # [B, N, N] bool lower triangle: the root's and a row's own column
    zero: torch.Tensor  # [B, 1] the root's parent row and depth
    row_ids: torch.Tensor  # [B, N - 1] 1 .. N - 1: the drafts' rows

    @classmethod
    def of(cls, b: int, shape: TreeShape, device: torch.device) -> TreeConstants:
        k, depth, n = shape.topk, shape.depth, shape.nodes
        first = torch.full((b, k, depth), -1, dtype=torch.long, device=device)
        first[:, :, 0] = torch.arange(k, device=device)
        slot = torch.arange(shape.scratch, device=device)
        return cls(
            first_paths=first,
            no_scratch=torch.zeros(b, k, shape.scratch, dtype=torch.bool, device=device),
            own=slot.view(depth - 1, 1, k, 1) == slot,
            children=torch.arange(k * k, device=device).view(k, k),
            columns=torch.arange(depth, device=device),
            floor=torch.full((), float("-inf"), device=device),
            lower=torch.ones(b, n, n, dtype=torch.bool, device=device).tril(),
            zero=torch.zeros(b, 1, dtype=torch.long, device=device),
            row_ids=torch.arange(1, n, device=device).expand(b, n - 1),
        )


def draft_tree(
    shape: TreeShape,
    g: torch.Tensor,
    tail: torch.Tensor,
    expand: Expand,
    logprobs: Callable[[torch.Tensor], torch.Tensor],
    draft_ids: torch.Tensor,
    fixed: TreeConstants,
) -> DraftedTree:
    """EAGLE-2's tree under each sequence's tail, from the head's output `g` [B, H] for it.

    `logprobs(h)`: draft-vocabulary log-probabilities of head outputs; `draft_ids`: the target
    token of each draft id; `fixed`: `TreeConstants.of(len(g), shape, device)`."""
    b, k, depth = len(g), shape.topk, shape.depth
    score, index = top_k(logprobs(g), k)  # the first level: the root's children
    path = fixed.first_paths  # the candidate ids from the first level down to each one
    tokens, scores, paths = [draft_ids[index]], [score], [path]
    frontier = (draft_ids[index], score, path, g[:, None].expand(b, k, g.shape[-1]))
    sees = fixed.no_scratch
    for level in range(1, depth):
        f_tok, f_score, f_path, f_hidden = frontier
        sees = sees | fixed.own[level - 1]  # and its own row
        h = expand(level, f_tok.flatten(), f_hidden.flatten(0, 1), sees.flatten(0, 1))
        lp, index = top_k(logprobs(h), k)
        below = torch.nextafter(f_score, fixed.floor)
        c_score = torch.minimum(f_score[..., None] + lp.view(b, k, k), below[..., None])
        c_ids = fixed.children + (k + (level - 1) * k * k)
        c_path = torch.where(fixed.columns == level, c_ids[..., None], f_path[:, :, None])
        c_tok = draft_ids[index].view(b, k * k)
        c_score, c_path = c_score.view(b, k * k), c_path.view(b, k * k, depth)
        tokens.append(c_tok)
        scores.append(c_score)
        paths.append(c_path)
        if level + 1 < depth:  # the next frontier: the level's best
            score, pick = c_score.topk(k, -1)
            parent = pick // k
            hidden = h.view(b, k, -1).gather(1, parent[..., None].expand(b, k, h.shape[-1]))
            chosen = c_path.gather(1, pick[..., None].expand(b, k, depth))
            frontier = (c_tok.gather(1, pick), score, chosen, hidden)
            sees = sees.gather(1, parent[..., None].expand(b, k, shape.scratch))
    cat = (torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(paths, 1))
    return _select(shape, tail, *cat, fixed)


def top_k(x: torch.Tensor, k: int, chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, -1)` (sorted, the same values and indices where no values tie) in two short
    passes: the top k of every `chunk` columns, then the top k of those. A row of thousands of
    columns is one block's radix select for torch; chunks spread it over many blocks."""
    n = x.shape[-1]
    if n % chunk or n < 4 * chunk or k > chunk:
        return x.topk(k, -1)
    values, index = x.unflatten(-1, (n // chunk, chunk)).topk(k, -1)  # [..., n / chunk, k]
    index = index + torch.arange(0, n, chunk, device=x.device)[:, None]
    values, pick = values.flatten(-2).topk(k, -1)
    return values, index.flatten(-2).gather(-1, pick)


def _select(
    shape: TreeShape,
    tail: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    paths: torch.Tensor,
    fixed: TreeConstants,
) -> DraftedTree:
    """The best `nodes - 1` candidates (tokens, scores [B, C]; paths [B, C, depth]: the
    candidate ids from the first level down to each, -1 below it), parents first."""
    b, n = len(tail), shape.nodes
    _, chosen = scores.topk(n - 1, -1)  # sorted: strictly falling scores put parents first
    path = paths.gather(1, chosen[..., None].expand(b, n - 1, shape.depth))  # [B, N-1, depth]
    depth = (path >= 0).sum(-1)  # 1 for the first level
    # row r sees row c (both drafts) if c's candidate is on r's path at c's depth
    at_depth = path.gather(2, (depth - 1)[:, None, :].expand(b, n - 1, n - 1))
    sees = fixed.lower.clone()
    sees[:, 1:, 1:] = at_depth == chosen[:, None, :]
    parent_id = path.gather(2, (depth - 2).clamp(min=0)[..., None])[..., 0]
    parent_id = torch.where(depth > 1, parent_id, -1)
    row_of = torch.zeros(b, scores.shape[1] + 1, dtype=torch.long, device=tail.device)
    row_of.scatter_(1, chosen + 1, fixed.row_ids)  # a candidate's id + 1 → its row
    return DraftedTree(
        tokens=torch.cat([tail[:, None], tokens.gather(1, chosen)], 1),
        parents=torch.cat([fixed.zero, row_of.gather(1, parent_id + 1)], 1),
        depths=torch.cat([fixed.zero, depth], 1),
        sees=sees,
    )


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: each row's ancestors and itself, from each row's parent row [B, N] (a
    root is its own parent). Pointer doubling: after step t a row holds its ancestors up to
    2^t levels up, so log2(N) steps of whole-tensor gathers, whatever the trees' shapes."""
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    rows = torch.arange(n, device=parents.device)
    sees = eye | (rows == parents[..., None])
    jump = parents
    for _ in range(max(n - 1, 1).bit_length()):
        sees = sees | sees.gather(1, jump[..., None].expand(b, n, n))
        jump = jump.gather(1, jump)
    return sees


def compact(
    caches: list[torch.Tensor], path: torch.Tensor, n: torch.Tensor, slot_of, base: torch.Tensor
) -> None:
    """Move the accepted nodes' keys and values from their tree slots to the slots of the
    positions they take (base + 1 .. base + n), in every layer of each cache [L, slots, ...].

    `path` [B, depth + 1]: the accepted row at each depth (row 0 the root, which stays);
    `slot_of(positions [B, J])`: their slots. Past n a slot is copied onto itself."""
    steps = torch.arange(1, path.shape[1], device=path.device)
    rows = torch.where(steps <= n[:, None], path[:, 1:], steps)
    src = slot_of(base[:, None] + rows).flatten()
    dst = slot_of(base[:, None] + steps).flatten()
    for cache in caches:
        cache.index_copy_(1, dst, cache.index_select(1, src))
