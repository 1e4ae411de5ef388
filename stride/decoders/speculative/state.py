"""What speculation keeps per sequence (in `seq.decoder_state`): its drafter, how far its
drafts go, and this step's plan and drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

from stride.decoders.speculative.drafters import Draft, Drafter
from stride.decoders.speculative.tree import Tree


@dataclass
class Runs:
    """How far runs of accepted drafts go: decayed counts, per draft position, of drafts scored
    there (those whose predecessors all passed) and of those accepted there."""

    reached: list[float] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        """One verification: drafts up to the first rejected one were scored."""
        reached, passed = self.reached, self.passed
        for i in range(min(accepted + 1, drafted)):
            if i == len(reached):
                reached.append(0.0)
                passed.append(0.0)
            reached[i] = decay * reached[i] + 1.0
            passed[i] = decay * passed[i] + (i < accepted)

    def rates(self, prior: tuple[float, ...], weight: float) -> tuple[float, ...]:
        """Acceptance per position (as many as `prior` has), shrunk towards `prior`."""
        reached, passed, n = self.reached, self.passed, len(self.reached)
        return tuple(
            (passed[i] + weight * a) / (reached[i] + weight) if i < n else a
            for i, a in enumerate(prior)
        )


@dataclass
class SeqState:
    """Per-sequence speculation state."""

    drafter: Drafter
    runs: Runs = field(default_factory=Runs)  # how far this sequence's drafts go
    reserved: int = 0  # K that extra_tokens reserved for this step
    depth: int = 0  # a tree's depth this step (its K; `reserved` is then its nodes)
    born: int = 0  # the policy's step count when this state was made: the probe phase
    draft: Draft | None = None  # this step's drafts, until they are verified
    tree: Tree | None = None  # this step's draft tree (greedy EAGLE requests with tree_nodes)
