"""Verification: which drafts the target accepts, and the token that follows them.

The exact rule of Leviathan et al. / Chen et al.: with p the target's distribution and q the
drafter's at a position (both after the request's logit adjustments, temperature,
top-k/top-p/min-p, computed by `sampling`), draft d is accepted with probability min(1, p(d)/q(d));
the first rejection is replaced by a draw from norm(max(0, p − q)), and when all drafts pass a
bonus token is drawn from the next p. The output distribution is the target's, token by token.
Greedy requests have one-hot p, so this reduces to "accept while the draft equals the target's
argmax", which also verifies a draft tree (`accept_greedy`: the longest path of nodes that each
equal the target's choice after their parent, as tensors: the host's steps and the device loop
use the same function); deterministic drafters (n-gram) have one-hot q. A sampled request's
tree, whose nodes are the drafter's most likely tokens (one-hot q each), follows the nodes
equal to the target's own draws (`verify_drawn`): the rule for several one-hot candidates.
"""

from __future__ import annotations

from array import array

import numpy as np
import torch

from stride.decoders import counter, sampling
from stride.decoders.speculative.device_tree import ancestors
from stride.decoders.speculative.drafters import Draft
from stride.decoders.speculative.tree import Tree
from stride.engine.sequence import Sequence


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative rejection rule for a batch of sequences.

    p: [B, K+1, V] target distributions (row i follows i drafts); q: [B, K, V] draft
    distributions; drafts: [B, K] draft tokens; num_drafts: [B] how many of the K are real;
    u: [B, K] uniform draws. Returns the number of accepted drafts per sequence and the
    distribution [B, V] to draw the one token after them from (the residual or the bonus).
    """
    b, k = drafts.shape
    pos = torch.arange(k, device=p.device)
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = q.gather(2, drafts[..., None])[..., 0]
    ok = (u * q_d < p_d) & (pos[None] < num_drafts[:, None])  # u < p/q without dividing
    accepted = ok.long().cumprod(1).sum(1)
    rows = torch.arange(b, device=p.device)
    target = p[rows, accepted]
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, accepted]
    real = (accepted < num_drafts)[:, None]  # a rejected draft: its q is subtracted
    residual = torch.where(real, (target - q_next).clamp(min=0), target)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target)
    return accepted, residual


def accept_greedy(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sees: torch.Tensor,
    depths: torch.Tensor,
    best: torch.Tensor,
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of draft trees as tensors (chains are trees): the longest path of rows
    each equal to the target's choice after its parent, then the target's choice after it.

    Per sequence, rows [root, drafts] with tokens, parent row (the root: itself), ancestors
    (`sees` [B, N, N]: a row's ancestors and itself) and depth; `best` [B, N] the target's
    token after each row; `depth`: the deepest level. Siblings hold distinct tokens, so the
    accepted rows form one path. Returns the accepted drafts n [B], the path's row at each
    depth [B, depth + 1] (0 past n) and the token after the path [B]. No host sync."""
    match = tokens == best.gather(1, parents)
    match[:, 0] = True  # the root is the sequence's own token
    ok = ~(sees & ~match[:, None, :]).any(-1)  # the row and all its ancestors match
    last = torch.where(ok, depths, -1).argmax(1, keepdim=True)
    n = depths.gather(1, last)[:, 0]
    on_path = sees.gather(1, last[..., None].expand(-1, 1, sees.shape[2]))[:, 0]  # [B, N]
    levels = torch.arange(depth + 1, device=tokens.device)
    at = on_path[:, :, None] & (depths[:, :, None] == levels)  # [B, N, depth + 1]
    rows = torch.arange(tokens.shape[1], device=tokens.device)
    path = (at * rows[:, None]).sum(1)
    return n, path, best.gather(1, last)[:, 0]


def verify_greedy(adjusted: torch.Tensor, trees: list[Tree]) -> tuple[list[list[int]], list[int]]:
    """Greedy: follow the nodes equal to the target's argmax; then take the argmax.

    `adjusted`: each tree's rows [root, nodes] one after another. Returns each tree's accepted
    path (node indices) and the token after it."""
    return follow(adjusted.argmax(-1).cpu(), trees)


def verify_drawn(
    adjusted: torch.Tensor, rows: list[sampling.Row], trees: list[Tree]
) -> tuple[list[list[int]], list[int]]:
    """Sampled requests' trees: the target draws the token after every row, with the noise a
    plain step draws with at that row's position (`sampling.draw`), and the nodes equal to
    those draws are followed; the draw after the last one is the next token. Each committed
    token is the target's draw at its position, whatever the drafts: the output distribution
    is the target's, and a seeded request makes the tokens it makes without drafts. (For a
    tree, whose nodes are the drafter's most likely tokens rather than draws from it, this is
    the multi-candidate rejection rule: a node is accepted with the target's probability of it
    once its elder siblings were refused.)"""
    return follow(_longs(sampling.draw(sampling.probabilities(adjusted, rows), rows)), trees)


def follow(choices: torch.Tensor, trees: list[Tree]) -> tuple[list[list[int]], list[int]]:
    """Each tree's path of nodes equal to the target's choice after their parent, and the
    target's choice after it. `choices`: the target's token after each row of the trees' rows
    [root, nodes] one after another (`accept_greedy`, on trees padded to one size: padding
    rows hang under the root at depth 1 and never match)."""
    b, width = len(trees), 1 + max(len(t) for t in trees)
    tokens: list[int] = []
    parents: list[int] = []  # each row's parent, -1 for the root (and padding): +1 below
    index: list[int] = []  # each row's row in `adjusted`
    offset = 0
    for tree in trees:
        n = 1 + len(tree)
        pad = [-1] * (width - n)
        tokens += [-1, *tree.tokens, *pad]
        parents += [-1, *tree.parents, *pad]
        index += [*range(offset, offset + n)] + [offset] * (width - n)
        offset += n
    parents_t = (_longs(parents) + 1).view(b, width)
    sees = ancestors(parents_t)
    depths = sees.sum(-1) - 1
    best = choices[_longs(index)].view(b, width)
    tokens_t = _longs(tokens).view(b, width)
    depth = int(depths.max())
    accepted, path, last = accept_greedy(tokens_t, parents_t, sees, depths, best, depth)
    rows = zip(path.tolist(), accepted.tolist(), strict=True)
    return [[r - 1 for r in p[1 : n + 1]] for p, n in rows], last.tolist()


def _longs(values: list[int]) -> torch.Tensor:
    """An int64 tensor of a list of ints, through a C array (several times faster than
    `torch.tensor` on a list, which this host path would pay per step)."""
    return torch.frombuffer(array("q", values), dtype=torch.long)


def verify_sampled(
    adjusted: torch.Tensor, rows: list[sampling.Row], seqs: list[Sequence], drafts: list[Draft]
) -> tuple[list[int], list[int]]:
    """Sampled requests' chains: how many drafts each accepts, and the token after them.

    The uniforms of the rule and the draw after it come from the counter-based generator
    (`counter`), keyed by each sequence's seed and the drafts' positions, in streams of their
    own (not the drafter's): a seeded output does not depend on the batch it ran in."""
    probs = sampling.probabilities(adjusted, rows)
    b, vocab, dev = len(seqs), probs.shape[-1], probs.device
    counts = [len(d.tokens) for d in drafts]
    k = max(max(counts), 1)
    p = probs.new_zeros(b, k + 1, vocab)
    q = probs.new_zeros(b, k, vocab)
    tokens = torch.zeros(b, k, dtype=torch.long, device=dev)
    offset = 0
    for i, (draft, n) in enumerate(zip(drafts, counts, strict=True)):
        p[i, : n + 1] = probs[offset : offset + n + 1]
        offset += n + 1
        if n:
            drafted = torch.tensor(draft.tokens, device=dev)
            tokens[i, :n] = drafted
            if draft.q is None:  # deterministic drafter: one-hot q
                q[i, torch.arange(n, device=dev), drafted] = 1.0
            else:
                q[i, :n] = draft.q.to(q.dtype)
    places = np.array([len(s.token_ids) for s in seqs])[:, None] + np.arange(k)[None, :]
    keys = counter.keys([s.seed for s in seqs], places.T, counter.ACCEPT).T  # [b, k]
    u = counter.unit(torch.from_numpy(keys).to(dev, non_blocking=True))
    num = torch.tensor(counts, device=dev)
    accepted, dist = verify(p, q, tokens, num, u)
    n_accepted = accepted.tolist()
    ends = [sampling.Row(s, d.tokens[:n]) for s, d, n in zip(seqs, drafts, n_accepted, strict=True)]
    return n_accepted, sampling.draw(dist, ends)


def paths(tree: Tree) -> list[list[int]]:
    """For the root and each node: the draft tokens from the root down to it."""
    out: list[list[int]] = [[]]
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        out.append(out[parent + 1] + [token])
    return out
