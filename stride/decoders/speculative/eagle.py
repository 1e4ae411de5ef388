"""The EAGLE drafter: a trained head drafts from the target's own hidden states.

Per sequence the head keeps rows for positions [0, done): what it computed from real target
features. The engine hands those features out with every pass (`Sequence.features`, one tensor
per pass that scored the sequence); when drafting, the head first catches up on the positions
scored since (row t reads the feature at t and token t+1) in one batched forward, whose last
row, reading the sequence's last token, drafts the first token after it. Chains then feed each
draft back with the head's own output; trees (EAGLE-2's dynamic trees) expand
the most likely nodes level by level and keep the best `budget` of them.

Drafted rows are scratch: they sit in slots past the target's cached ones, which the next
catch-up overwrites with real rows, so nothing rolls back but the features of rejected drafts.

A prompt prefix found in the prefix cache was never scored for this sequence, so the head has no
features for it: it starts at the first position scored, and its attention over the prefix
reads whatever head rows those shared blocks hold (another sequence's, or stale ones). That
costs drafts some accuracy, never correctness: the target verifies every draft.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stride.decoders.catalog import EAGLE
from stride.decoders.speculative.cycles import CycleResult, EagleCycles
from stride.decoders.speculative.device_tree import TreeShape
from stride.decoders.speculative.drafters import Draft, Drafter, run_drafts
from stride.decoders.speculative.tree import Tree
from stride.engine.eagle import HeadRunner, load_head
from stride.engine.engine import Engine
from stride.engine.sequence import Sequence
from stride.engine.spans import Span


@dataclass
class _Cursor:
    done: int = 0  # the head holds real rows for positions [0, done)
    drafted: int = 0  # drafts of the pass in flight (their features are dropped if rejected)
    root: torch.Tensor | None = None  # the output of the head's row at done - 1


@dataclass(order=True)
class _Candidate:
    neg_score: float  # -(cumulative log-probability): heapq pops the most likely first
    index: int = field(compare=False)
    token: int = field(compare=False)
    parent: int = field(compare=False)  # index of the parent candidate; -1: the root
    depth: int = field(compare=False)


class EagleDrafter(Drafter):
    name = EAGLE

    def __init__(self, engine: Engine, head_path: Path) -> None:
        self.engine = engine
        self.head = load_head(head_path, engine.model, engine.whole_vocab())
        self.runner = HeadRunner(self.head, engine.cache)
        engine.runner.capture_features(self.head.config.aux_layers)
        self.vocab = engine.hf_config.vocab_size
        self.path = head_path
        own = sum(p.numel() for p in self.head.parameters())
        per_step = own + self.head.head_weight().numel()
        self.cost = per_step / engine.num_params
        self.cursors: dict[str, _Cursor] = {}  # by request id: how far the head has read
        # The device loop runs the target's forward on rank 0 alone: not for a split target.
        self.cycles = EagleCycles(engine.runner, self.runner) if engine.workers is None else None

    def admit(self, seq: Sequence) -> None:
        seq.features = []

    def available(self, seq: Sequence, k: int) -> int:
        """Drafts need the target's features up to the token before the last one: features
        not yet caught up on, or a head caught up on the device. (A prompt the prefix cache
        holds but for its last token has neither before its first pass.)"""
        if seq.num_tokens - seq.num_cached != 1:
            return 0
        if seq.features:
            return k
        return k if self.caught_up(seq) else 0

    def caught_up(self, seq: Sequence) -> bool:
        """Has the head read all of `seq` (on the device, in a burst), so that a draft needs no
        catch-up over tokens decoded plainly since its last one?"""
        cur = self.cursors.get(seq.request_id)
        return cur is not None and cur.root is not None and cur.done == seq.num_cached

    # ---- drafting ---------------------------------------------------------------------------

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Real rows for every position scored since the last draft; returns each sequence's
        last row's output [B, H] (the one that read its last token)."""
        spans, feats, todo = [], [], []
        roots: list[torch.Tensor | None] = []
        for seq in seqs:
            cur = self.cursors.setdefault(seq.request_id, _Cursor())
            cur.drafted = 0
            n = seq.num_cached - cur.done
            if n == 0 and cur.root is not None:  # caught up on the device (`burst`)
                roots.append(cur.root)
                continue
            rows = torch.cat(seq.features) if seq.features else None
            if rows is None or len(rows) < n:  # a prompt prefix found in the prefix cache
                n = 0 if rows is None else len(rows)
            if n == 0:
                raise RuntimeError(f"EAGLE has no target features for {seq.request_id}")
            start = seq.num_cached - n
            feats.append(rows[-n:])
            seq.features.clear()
            cur.done = seq.num_cached
            tokens = seq.token_ids[start + 1 : seq.num_cached + 1]
            spans.append(Span(seq, tokens, 0, offset=start - seq.num_cached))
            todo.append(len(roots))
            roots.append(None)
        if spans:
            g = self.runner.forward(spans, self.head.project(torch.cat(feats)))
            last = torch.cumsum(torch.tensor([len(c.token_ids) for c in spans]), 0) - 1
            for i, row in zip(todo, g[last.to(g.device)], strict=True):
                roots[i] = row
        for seq, root in zip(seqs, roots, strict=True):
            self.cursors[seq.request_id].root = root
        return torch.stack(roots)  # type: ignore[arg-type]

    def burst(self, seqs: list[Sequence], shape: TreeShape, cycles: int) -> CycleResult:
        """`cycles` cycles of chains or trees of `shape` on the device (`EagleCycles`);
        each sequence needs KV slots for `num_cached + cycles.reach(shape, cycles)` tokens."""
        roots = self._catch_up(seqs)
        return self.cycles.run(seqs, roots, shape, cycles)

    def burst_done(self, seq: Sequence, committed: int, root: torch.Tensor) -> None:
        """A burst committed `committed` tokens of `seq` (not yet appended) and left the
        head's output for its new last real row."""
        cur = self.cursors[seq.request_id]
        cur.done, cur.root, cur.drafted = seq.num_cached + committed, root, 0

    def _full(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits → target-vocabulary logits (-inf off the draft vocabulary)."""
        if draft_logits.shape[-1] == self.vocab:
            return draft_logits
        full = draft_logits.new_full((len(draft_logits), self.vocab), float("-inf"))
        full[:, self.head.draft_ids] = draft_logits
        return full

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence], ks: list[int], eos_ids: set[int]) -> list[Draft]:
        """Chains: draft i+1 reads draft i and the head's output for it, all sequences batched."""
        live = [i for i, k in enumerate(ks) if k]
        if not live:
            return [Draft([]) for _ in seqs]
        roots = self._catch_up([seqs[i] for i in live])
        last = {i: roots[j] for j, i in enumerate(live)}
        for i in live:
            self.cursors[seqs[i].request_id].drafted = ks[i]

        def forward(pos: int, rows: list[int], feed: list[list[int]]) -> torch.Tensor:
            if pos:  # chain row `pos` sits at position num_cached - 1 + pos
                pairs = zip(rows, feed, strict=True)
                spans = [Span(seqs[i], f, 0, offset=pos - 1) for i, f in pairs]
                g = self.runner.forward(spans, torch.stack([last[i] for i in rows]))
                for j, i in enumerate(rows):
                    last[i] = g[j]
            else:
                g = torch.stack([last[i] for i in rows])
            return self._full(self.head.logits(g))

        return run_drafts(seqs, ks, [[] for _ in seqs], forward, eos_ids, self.vocab)

    @torch.inference_mode()
    def draft_trees(
        self, seqs: list[Sequence], depths: list[int], budgets: list[int], topk: int
    ) -> list[Tree]:
        """Trees of at most `budgets[i]` nodes and `depths[i]` levels (EAGLE-2), of the head's
        most likely tokens (for sampled requests too: `verify.verify_drawn`).

        Level by level, the `topk` most likely nodes of the last level (by cumulative draft
        log-probability) are expanded into their `topk` most likely children, all sequences'
        expansions in one head forward; the tree keeps the `budget` most likely candidates,
        which include their ancestors (a child is never more likely than its parent).
        Expansion rows take scratch slots after the cached ones: level d's rows (reading
        level d-1's nodes) fill slots [(d-2)*topk, (d-1)*topk) past num_cached, and each sees
        the rows of its ancestors and itself there.
        """
        roots = self._catch_up(seqs)
        logp = torch.log_softmax(self.head.logits(roots), -1)
        ids = self.head.draft_ids
        values, index = logp.topk(topk, -1)
        tokens = ids[index].tolist()
        values = values.tolist()
        cands: list[list[_Candidate]] = []
        frontier: list[list[int]] = []
        producer: list[dict[int, torch.Tensor]] = []  # candidate → the g row that drafted it
        row_of: list[dict[int, int]] = []  # expanded candidate → its scratch row
        for b in range(len(seqs)):
            pairs = enumerate(zip(tokens[b], values[b], strict=True))
            cands.append([_Candidate(-v, r, t, -1, 1) for r, (t, v) in pairs])
            frontier.append(list(range(topk)))
            producer.append(dict.fromkeys(range(topk), roots[b]))
            row_of.append({})
        for depth in range(2, max(depths) + 1):
            active = [b for b in range(len(seqs)) if depths[b] >= depth and frontier[b]]
            if not active:
                break
            spans, hidden = [], []
            for b in active:
                seq, nodes = seqs[b], frontier[b]
                first = (depth - 2) * topk
                width = first + len(nodes)
                mask = torch.zeros(len(nodes), width, dtype=torch.bool)
                for r, c in enumerate(nodes):
                    row_of[b][c] = first + r
                    mask[r, first + r] = True
                    parent = cands[b][c].parent
                    while parent >= 0:
                        mask[r, row_of[b][parent]] = True
                        parent = cands[b][parent].parent
                positions = [seq.num_cached + depth - 2] * len(nodes)
                toks = [cands[b][c].token for c in nodes]
                spans.append(Span(seq, toks, 0, positions, mask, offset=first))
                hidden += [producer[b][c] for c in nodes]
            g = self.runner.forward(spans, torch.stack(hidden))
            child_logp = torch.log_softmax(self.head.logits(g), -1)
            values, index = child_logp.topk(topk, -1)
            tokens, values = ids[index].tolist(), values.tolist()
            row = 0
            for b in active:
                new = []
                for c in frontier[b]:
                    base = cands[b][c].neg_score
                    for t, v in zip(tokens[row], values[row], strict=True):
                        n = len(cands[b])
                        cands[b].append(_Candidate(base - v, n, t, c, depth))
                        producer[b][n] = g[row]
                        new.append(n)
                    row += 1
                frontier[b] = [c.index for c in heapq.nsmallest(topk, (cands[b][n] for n in new))]
        trees = [self._select(cands[b], budgets[b]) for b in range(len(seqs))]
        for seq, tree in zip(seqs, trees, strict=True):
            self.cursors[seq.request_id].drafted = len(tree)
        return trees

    @staticmethod
    def _select(cands: list[_Candidate], budget: int) -> Tree:
        """The `budget` most likely candidates, as a tree (parents first)."""
        best = heapq.nsmallest(budget, cands)
        keep = {c.index for c in best}
        for c in best:  # equal scores could leave out a parent: keep the tree whole
            p = c.parent
            while p >= 0 and p not in keep:
                keep.add(p)
                p = cands[p].parent
        order = sorted(keep, key=lambda i: (cands[i].depth, cands[i].neg_score, i))
        at = {c: j for j, c in enumerate(order)}
        return Tree(
            [cands[i].token for i in order],
            [at[cands[i].parent] if cands[i].parent >= 0 else -1 for i in order],
        )

    # ---- after verification -----------------------------------------------------------------

    def accepted(self, seq: Sequence, num_accepted: int, path: list[int] | None = None) -> None:
        """Keep the features of the root and the accepted drafts (`path`: their indices among
        the scored drafts; default the first `num_accepted`)."""
        cur = self.cursors.get(seq.request_id)
        if cur is None or not cur.drafted or not seq.features:
            return
        scored = seq.features[-1]  # [root, drafts...] of the verification pass
        if path is None:
            seq.features[-1] = scored[: 1 + num_accepted]
        else:
            rows = torch.tensor([0] + [1 + i for i in path], device=scored.device)
            seq.features[-1] = scored[rows]
        cur.drafted = 0

    def release(self, seq: Sequence) -> None:
        self.cursors.pop(seq.request_id, None)
        if seq.features is not None:
            seq.features = []


def keep_recent(seq: Sequence, rows: int = 1024, pieces: int = 64) -> None:
    """Bound the features a sequence holds while it decodes without drafting: once they are
    more than `pieces` tensors (a step hands out one), keep their last `rows` as one. A later
    catch-up reads those; the head's older context stays as it was. (Checked every step, so
    it costs a length check there, a concatenation every `pieces` steps.)"""
    features = seq.features
    if features and len(features) > pieces:
        features[:] = [torch.cat(features)[-rows:]]
