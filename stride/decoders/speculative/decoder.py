"""Speculative decoding: a cheap drafter guesses K tokens, the target checks them in one pass.

Request options (`{"type": "speculative", ...}`):
    draft: "ngram" | "early_exit" | "eagle" (with an EAGLE head) | the server's draft model name
        (default: the EAGLE head if the server has one, else its draft model, else "ngram")
    num_speculative_tokens: the most drafts per step, K (default: the server's setting)
    adaptive: let the policy pick K per step (default true); false always drafts K. On a GPU an
        adaptive eagle request drafts only in the device loop, which picks per batch among a
        chain of K, a tree and plain decoding (`loop_policy`; where rows sample, a sampled chain
        and plain decoding); a batch with rows the loop cannot run (logprobs, penalties, bias,
        a grammar: `bursts.runnable`) decodes plainly. A greedy or tree fixed-K one the loop can
        run drafts in its bursts only: a step that is none (an arrival's prefill) is plain
    exit_layer: early_exit only, how many target layers draft (default: half of them)
    ngram_max: ngram only, the longest suffix looked up (default 3)
    tree_nodes, tree_topk: eagle only, draft a tree instead of a chain (0: a chain; unset: a
        chain, or in the device loop `loop_policy.DEFAULT_TREE`, for sampled batches a chain)

Step by step: `extra_tokens` asks the policy (`policy.AdaptivePolicy`) for the sequence's K (the
scheduler reserves KV for it) and notes the answer in the step's `StepPlans`; `propose` hands
those to the policy with the step (`proposed`) and drafts for all speculative sequences of the
step in batched drafter forwards (`drafters`, `eagle`); the target scores the tail's last token
and the K drafts inside the step's shared ragged forward; `commit` verifies (`verify`). Accepted
drafts keep their target KV (`kv_keep`, or `kv_from` for a tree's path), the drafter rolls its
own state back. Where the policy says K = 0 for everyone (a quiet step, decided once per step by
`committed`), every hook does what `ar` does.

Whether drafting pays at all is measured as refinement measures it (`payoff`): adaptive requests
run in epochs, either drafting (K chosen by the policy above, or in the device loop by the loop
policy) or plainly, as `ar` does; the mode that made more tokens per second of wall time runs,
the other is tried ever less often. The policies price drafts from their models of step costs
and acceptance; the epochs check their choices against the clock, host work included, so that
where they do not pay (a GPU's plain steps run as bursts kept in flight, which a drafting step
cannot) the requests cost what `ar` costs. Requests the device loop drafts have epochs of their
own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from stride import drafts
from stride.decoders import grammar, sampling
from stride.decoders.base import (
    PLAIN,
    UNLIMITED,
    Burst,
    Commit,
    Decoder,
    DecoderError,
    DecodersConfig,
    Proposal,
    Scored,
    StepContext,
    commit_plain,
    parse_options,
)
from stride.decoders.catalog import EAGLE, EARLY_EXIT, NGRAM, SPECULATIVE
from stride.decoders.payoff import Payoff
from stride.decoders.speculative.bursts import Ahead, batch_menu, bursts_only, runnable, start_burst
from stride.decoders.speculative.cycles import BUCKETS
from stride.decoders.speculative.drafters import (
    Draft,
    Drafter,
    DraftModelDrafter,
    EarlyExitDrafter,
    NgramDrafter,
)
from stride.decoders.speculative.eagle import EagleDrafter, keep_recent
from stride.decoders.speculative.loop_policy import LoopPolicy
from stride.decoders.speculative.options import SpeculativeOptions
from stride.decoders.speculative.policy import MAX_K, AdaptivePolicy, SeqState, StepPlans
from stride.decoders.speculative.tree import Tree
from stride.decoders.speculative.verify import paths, verify_drawn, verify_greedy, verify_sampled
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence


class Speculative(Decoder):
    name = SPECULATIVE
    options_model = SpeculativeOptions

    def __init__(
        self,
        engine: Engine,
        draft_model: str | None = None,
        num_speculative_tokens: int = 4,
        saturation_tokens: float | None = None,
        measure_costs: bool = True,
        draft_head: str | None = None,
    ) -> None:
        self.engine = engine
        self.default_k = num_speculative_tokens
        saturation = saturation_tokens or (256.0 if engine.device.type == "cuda" else 16.0)
        self.policy = AdaptivePolicy(saturation, measure_costs)
        # Does drafting pay, by the clock (`payoff`, drafting as its refining mode)? Epochs of
        # their own for the requests the device loop drafts (key True) and for the others; none
        # where costs come from sizes. The first epoch drafts (the policies have warm-ups).
        self.payoffs: dict[bool, Payoff] = {}
        if measure_costs:
            self.payoffs = {loop: Payoff(most=1 + MAX_K, refining=True) for loop in (False, True)}
        self.plans = StepPlans()  # the next step's, as its sequences reserve (`extra_tokens`)
        self.quiet = self.policy.quiet_at(self.policy.seen.batch)  # the next step (`committed`)
        self.draft_model = DraftModelDrafter(engine, draft_model) if draft_model else None
        self.eagle = EagleDrafter(engine, Path(draft_head)) if draft_head else None
        # Adaptive EAGLE requests draft in the device loop only, where it runs as CUDA graphs.
        cycles = self.eagle.cycles if self.eagle else None
        self.device_loop = cycles is not None and cycles.graphs
        self.loop = LoopPolicy(BUCKETS[-1], cycles.max_cycles if cycles else 0)
        self.ahead: Ahead | None = None  # the loop's burst launched at the last one's commit
        self.drafters: dict[tuple, Drafter] = {}  # ngram and early-exit drafters by settings

    @classmethod
    def from_config(cls, engine: Engine, config: DecodersConfig) -> Speculative:
        head, model = drafts.pick(config.draft_head, config.draft_model, engine.name)
        return cls(engine, model, config.num_speculative_tokens, draft_head=head)

    # ---- admission ------------------------------------------------------------------------

    @property
    def drafter_names(self) -> list[str]:
        names = [NGRAM, EARLY_EXIT]
        names += [self.draft_model.name] if self.draft_model else []
        return names + ([EAGLE] if self.eagle else [])

    def validate(self, params: SamplingParams, options: dict[str, Any]) -> dict[str, Any]:
        opts = parse_options(SpeculativeOptions, options, "decoder 'speculative'")
        draft = opts.draft
        if draft is None:
            draft = self.draft_model.name if self.draft_model else NGRAM
            draft = EAGLE if self.eagle else draft
        if draft not in self.drafter_names:
            raise DecoderError(
                f"unknown draft {draft!r}; valid drafters: {', '.join(self.drafter_names)}"
            )
        k = self.default_k if opts.num_speculative_tokens is None else opts.num_speculative_tokens
        out: dict[str, Any] = {
            "draft": draft,
            "num_speculative_tokens": k,
            "adaptive": opts.adaptive,
        }
        layers = self.engine.model.num_layers
        if draft == EARLY_EXIT:
            exit_layer = max(1, layers // 2) if opts.exit_layer is None else opts.exit_layer
            if not exit_layer <= layers:
                raise DecoderError(f"exit_layer must be an integer in [1, {layers}]")
            out["exit_layer"] = exit_layer
        elif opts.exit_layer is not None:
            raise DecoderError("exit_layer applies to draft 'early_exit' only")
        if draft == NGRAM:
            out["ngram_max"] = 3 if opts.ngram_max is None else opts.ngram_max
        elif opts.ngram_max is not None:
            raise DecoderError("ngram_max applies to draft 'ngram' only")
        if draft == EAGLE:
            out["tree_nodes"] = opts.tree_nodes
            out["tree_topk"] = 8 if opts.tree_topk is None else opts.tree_topk
        elif opts.tree_nodes is not None or opts.tree_topk is not None:
            raise DecoderError("tree_nodes and tree_topk apply to draft 'eagle' only")
        return out

    def _drafter(self, options: dict[str, Any]) -> Drafter:
        draft = options["draft"]
        if draft == EAGLE:
            assert self.eagle is not None
            return self.eagle
        if draft == NGRAM:
            key: tuple = (NGRAM, options["ngram_max"])
        elif draft == EARLY_EXIT:
            key = (EARLY_EXIT, options["exit_layer"])
        else:
            assert self.draft_model is not None
            return self.draft_model
        if key not in self.drafters:
            self.drafters[key] = (
                NgramDrafter(max_n=key[1])
                if draft == NGRAM
                else EarlyExitDrafter(self.engine, key[1])
            )
        return self.drafters[key]

    def admit(self, seq: Sequence) -> None:
        self._drafter(seq.decoder_options).admit(seq)

    def state(self, seq: Sequence) -> SeqState:
        """`seq`'s speculation state (made on its first step, and again after a preemption)."""
        if seq.decoder_state is None:
            seq.decoder_state = SeqState(
                self._drafter(seq.decoder_options), born=self.policy.seen.steps
            )
        return seq.decoder_state

    # ---- propose and commit ---------------------------------------------------------------

    def in_loop(self, seq: Sequence) -> bool:
        """Does `seq` draft only in the device loop (`loop_policy`)?"""
        options = seq.decoder_options
        return (
            self.device_loop
            and options["draft"] == EAGLE
            and options["adaptive"]
            and options["num_speculative_tokens"] > 0
        )

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        policy, state = self.policy, seq.decoder_state
        if self.in_loop(seq) or self.plain_epoch(seq):  # (the loop reserves its own slots)
            self.state(seq).reserved = 0
            return 0
        if self.quiet and state is not None and seq.decoder_options["adaptive"]:
            state.reserved = 0  # the O(1) path of a quiet step
            return 0
        state = self.state(seq)
        plan = policy.plan(seq, state, policy.seen.batch)
        self.plans.add(plan, seq.decoder_options["adaptive"])
        k = min(plan.k, cap)
        state.reserved = state.drafter.available(seq, k) if k else 0
        nodes = seq.decoder_options.get("tree_nodes", 0)
        if state.reserved and nodes:  # a tree of depth k: its nodes are scored
            state.depth = state.reserved
            state.reserved = min(max(nodes, k), cap)
        self.plans.reserved = self.plans.reserved or state.reserved > 0
        return state.reserved

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        policy, plans = self.policy, self.plans
        self.plans = StepPlans()
        if not plans.reserved:  # nothing to draft: a plain step, as `ar` makes it
            policy.proposed(len(seqs), plans, self.quiet, None)
            return [self._plain(seqs)] * len(seqs)
        states = [self.state(s) for s in seqs]
        if ctx.bursts and self.device_loop and len(seqs) <= self.loop.max_batch:
            for seq, st in zip(seqs, states, strict=True):  # (a step that is no burst: plain)
                st.reserved = 0 if bursts_only(seq) else st.reserved
        ks, pays = policy.plan_step(seqs, states)
        policy.proposed(len(seqs), plans, self.quiet, pays)
        by_drafter: dict[int, list[int]] = {}
        for i, st in enumerate(states):
            by_drafter.setdefault(id(st.drafter), []).append(i)
        made: list[Draft] = [Draft([]) for _ in seqs]
        for idx in by_drafter.values():
            drafter = states[idx[0]].drafter
            positions = max(ks[i] for i in idx)
            if not positions:
                continue
            start = time.perf_counter()
            group = self._draft(drafter, [seqs[i] for i in idx], [states[i] for i in idx],
                                [ks[i] for i in idx], ctx)  # fmt: skip
            policy.drafter_timed(drafter, time.perf_counter() - start, positions, len(idx))
            for i, d in zip(idx, group, strict=True):
                made[i] = d
        for i, (seq, st) in enumerate(zip(seqs, states, strict=True)):
            if seq.grammar is not None and made[i].tokens:
                made[i] = _within_grammar(seq, st, made[i])
            st.draft = made[i]
        if not any(d.tokens for d in made):
            return [self._plain(seqs)] * len(seqs)
        return [_proposal(s, st, d) for s, st, d in zip(seqs, states, made, strict=True)]

    def _plain(self, seqs: list[Sequence]) -> Proposal:
        """A step of `seqs` that drafts nothing, with the plain steps that follow it for sure:
        any number at a fixed K = 0, else those of the quiet period (the next plan may probe),
        none if some sequence drafts a fixed K > 0 (its next step may draft)."""
        adaptive = False
        for seq in seqs:
            options = seq.decoder_options
            if options["num_speculative_tokens"]:
                if not options["adaptive"]:
                    return PLAIN
                adaptive = True
        if not adaptive:
            return Proposal(plain_steps=UNLIMITED)
        loop = all(self.in_loop(s) for s in seqs)
        shapes = None
        if loop and all(map(runnable, seqs)):  # (a batch larger than the loop takes: no menu)
            shapes = batch_menu(seqs) if len(seqs) <= self.loop.max_batch else ()
        if loop and shapes is None:  # no loop for this batch: nothing drafts for it
            return Proposal(plain_steps=UNLIMITED)
        payoff = self.payoffs.get(loop)
        if payoff is not None and not payoff.refining:  # as `ar` until drafting is tried again
            return Proposal(plain_steps=payoff.plain_steps())
        if shapes is not None:
            steps = self.loop.plain_steps(len(seqs), shapes, self.policy.seen.steps)
        else:
            steps = self.policy.quiet_steps(len(seqs))
        return Proposal(plain_steps=steps if payoff is None else min(steps, payoff.plain_steps()))

    def plain_epoch(self, seq: Sequence) -> bool:
        """Is `seq` an adaptive request in an epoch without drafts (`payoffs`)?"""
        payoff = self.payoffs.get(self.in_loop(seq))
        return payoff is not None and not payoff.refining and seq.decoder_options["adaptive"]

    def measure(self, seqs: list[Sequence], commits: list[Commit], launch_s: float | None) -> None:
        """The adaptive requests' tokens, for their epochs (`payoffs`): a launch counts for the
        epoch it commits in."""
        passes = max((c.forward_passes for c in commits), default=1)
        for loop, payoff in self.payoffs.items():
            made = [
                len(c.tokens) for s, c in zip(seqs, commits, strict=True)
                if c.tokens and s.decoder_options["adaptive"] and self.in_loop(s) == loop
            ]  # fmt: skip
            if made:
                payoff.record(len(made), sum(made), launch_s, payoff.refining, passes)

    def _draft(
        self,
        drafter: Drafter,
        seqs: list[Sequence],
        states: list[SeqState],
        ks: list[int],
        ctx: StepContext,
    ) -> list[Draft]:
        """One drafter's drafts for its sequences: chains, and EAGLE trees where asked for."""
        trees = [
            i for i, (s, k) in enumerate(zip(seqs, ks, strict=True))
            if k and s.decoder_options.get("tree_nodes")
        ]  # fmt: skip
        for st in states:
            st.tree = None
        if not trees:
            return drafter.draft(seqs, ks, ctx.eos_ids)
        assert isinstance(drafter, EagleDrafter)
        chains = [0 if i in trees else k for i, k in enumerate(ks)]
        drafts = [Draft([]) for _ in seqs]
        if any(chains):
            drafts = drafter.draft(seqs, chains, ctx.eos_ids)
        sub = [seqs[i] for i in trees]
        depths = [ks[i] for i in trees]
        budgets = [states[i].reserved for i in trees]
        # Each level's expansion rows take `topk` scratch slots past the reserved ones' start.
        room = min(b // max(d - 1, 1) for b, d in zip(budgets, depths, strict=True))
        topk = max(1, min(room, *(s.decoder_options["tree_topk"] for s in sub)))
        for i, tree in zip(trees, drafter.draft_trees(sub, depths, budgets, topk), strict=True):
            states[i].tree = tree
            drafts[i] = Draft(tree.tokens)
        return drafts

    def commit(
        self, seqs: list[Sequence], proposals: list[Proposal], scored: Scored, ctx: StepContext
    ) -> list[Commit]:
        policy = self.policy
        if all(p.plain for p in proposals):  # nothing to verify: what plain decoding does
            commits = commit_plain(seqs, scored, ctx)
            for seq in seqs:  # (graphed plain steps hand out features too)
                if self.in_loop(seq):
                    keep_recent(seq)
            passes = max(c.forward_passes for c in commits)
            policy.measured(len(seqs), len(seqs), False, ctx, passes)
            policy.stepped(passes)
            self.committed()
            self.measure(seqs, commits, ctx.timing)
            return commits
        logits = scored.logits
        assert logits is not None
        policy.stepped(1)
        states = [self.state(s) for s in seqs]
        drafted = [st.draft or Draft([]) for st in states]
        trees = [st.tree or Tree.chain(d.tokens) for st, d in zip(states, drafted, strict=True)]
        # Each row's pending tokens: the drafts on the path from the root to it.
        rows = [
            sampling.Row(s, pending)
            for s, tree in zip(seqs, trees, strict=True)
            for pending in paths(tree)
        ]
        raw = torch.cat(logits)
        adjusted = sampling.adjust(raw, rows, ctx.eos_ids)
        if all(s.params.greedy for s in seqs):
            accepted_paths, last = verify_greedy(adjusted, trees)
        elif any(st.tree is not None for st in states):  # (greedy rows: their argmax drawn)
            accepted_paths, last = verify_drawn(adjusted, rows, trees)
        else:
            accepted, last = verify_sampled(adjusted, rows, seqs, drafted)
            accepted_paths = [list(range(n)) for n in accepted]

        commits = []
        offset = 0
        for seq, st, tree, path, token in zip(
            seqs, states, trees, accepted_paths, last, strict=True
        ):
            n_acc = len(path)
            tokens = [tree.tokens[i] for i in path] + [token]
            picked = [offset] + [offset + 1 + i for i in path]
            lps = sampling.logprobs(raw[picked], tokens, [rows[r] for r in picked])
            offset += len(tree) + 1
            self.record(seq, st, len(tree) if st.tree is None else max(tree.depths()), n_acc)
            chain = st.tree is None
            st.drafter.accepted(seq, n_acc, None if chain else path)
            st.draft, st.tree = None, None
            commits.append(Commit(tokens, lps, kv_keep=n_acc, kv_from=None if chain else path))
        policy.measured(len(seqs), sum(1 + len(p.tokens) for p in proposals), True, ctx)
        self.committed()
        self.measure(seqs, commits, ctx.timing)
        return commits

    def committed(self) -> None:
        """A step was committed: decide once whether the next one is quiet (`quiet_at` the
        batch size its sequences reserve at), so that its `extra_tokens` need not ask."""
        self.quiet = self.policy.quiet_at(self.policy.seen.batch)

    def record(self, seq: Sequence, state: SeqState, drafted: int, accepted: int) -> None:
        """A verification's counts, in the request's stats and in the policy's estimates."""
        stats = seq.stats
        stats.drafts += 1 if drafted else 0
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        if len(stats.accepted_per_position) < drafted:
            stats.accepted_per_position.extend([0] * (drafted - len(stats.accepted_per_position)))
        for i in range(accepted):
            stats.accepted_per_position[i] += 1
        self.policy.record(state, drafted, accepted)

    def release(self, seq: Sequence, ctx: StepContext) -> None:
        if seq.decoder_state is not None:
            seq.decoder_state.drafter.release(seq)
        seq.decoder_state = None

    # ---- fast paths (see `Decoder`) -------------------------------------------------------

    def burst(self, seqs: list[Sequence], passes: int, ctx: StepContext) -> Burst | None:
        """EAGLE's greedy chains and trees, several cycles per host sync (`bursts`)."""
        return start_burst(self, seqs, passes, ctx)


def _within_grammar(seq: Sequence, state: SeqState, draft: Draft) -> Draft:
    """The draft without the tokens the sequence's grammar forbids: a chain cut at the first,
    a tree without the nodes under one (they would be scored for nothing)."""
    tree = state.tree
    if tree is None:
        n = seq.grammar.valid_prefix(draft.tokens)
        if n == len(draft.tokens):
            return draft
        return Draft(draft.tokens[:n], None if draft.q is None else draft.q[:n])
    nodes = grammar.allowed_nodes(seq.grammar, tree.tokens, tree.parents)
    if len(nodes) < len(tree):
        state.tree = tree.subtree(nodes) if nodes else None
    return Draft(list(state.tree.tokens) if state.tree else [])


def _proposal(seq: Sequence, state: SeqState, draft: Draft) -> Proposal:
    """What the target scores: a chain's drafts, or a tree's nodes at their depths under a mask."""
    if not draft.tokens:
        return PLAIN
    tree = state.tree
    if tree is None:
        return Proposal(list(draft.tokens))
    start = seq.num_cached  # the root's position
    positions = [start + d for d in tree.depths()]
    return Proposal(list(tree.tokens), positions, tree.mask())
