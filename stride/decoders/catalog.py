"""The names of Stride's decoders and their variants, in one place, importable without torch.

A request's strategy is its decoder and the variant its options choose: `ar`,
`speculative/<draft>`, `refine/<method>`. Metrics label by it, the CLI lists it, and the
decoders validate against the same names (`registry` holds the classes behind them; a test
keeps the two in step). A variant is offered only where the server has what it needs: an
EAGLE head, a draft model, a masked diffusion LM (`Offered`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

AR, SPECULATIVE, REFINE = "ar", "speculative", "refine"
DECODERS = (AR, SPECULATIVE, REFINE)

NGRAM, EARLY_EXIT, EAGLE, DRAFT_MODEL = "ngram", "early_exit", "eagle", "draft_model"
DRAFTS = (NGRAM, EARLY_EXIT, EAGLE, DRAFT_MODEL)  # any other draft name is the draft model

JACOBI, LOOKAHEAD, DIFFUSION = "jacobi", "lookahead", "diffusion"
REFINE_METHODS = (JACOBI, LOOKAHEAD, DIFFUSION)
OTHER = "other"  # the label of a variant nobody offers (validation refuses it anyway)


@dataclass(frozen=True)
class Offered:
    """What a server has beyond the built-in variants."""

    eagle: bool = False  # an EAGLE head: draft `eagle`, the default draft
    draft_model: bool = False  # a draft model: draft `draft_model` (the default without a head)
    diffusion: bool = False  # a masked diffusion LM: refine method `diffusion`

    @property
    def default_draft(self) -> str:
        return EAGLE if self.eagle else DRAFT_MODEL if self.draft_model else NGRAM

    def drafts(self) -> tuple[str, ...]:
        wanted = {NGRAM: True, EARLY_EXIT: True, EAGLE: self.eagle, DRAFT_MODEL: self.draft_model}
        return tuple(d for d in DRAFTS if wanted[d])

    def methods(self) -> tuple[str, ...]:
        return tuple(m for m in REFINE_METHODS if m != DIFFUSION or self.diffusion)


def strategy(decoder: str, options: Mapping[str, Any] | None, offered: Offered) -> str:
    """The strategy of a request: `ar`, `speculative/{ngram,early_exit,eagle,draft_model}`,
    `refine/{jacobi,lookahead,diffusion}`. Bounded whatever the options say: a draft model is
    never named by its path, and an unknown method is `<decoder>/other`."""
    options = options or {}
    if decoder == SPECULATIVE:
        draft = options.get("draft", offered.default_draft)
        known = (NGRAM, EARLY_EXIT) + ((EAGLE,) if offered.eagle else ())
        return f"{SPECULATIVE}/{draft if draft in known else DRAFT_MODEL}"
    if decoder == REFINE:
        method = options.get("method", JACOBI)
        return f"{REFINE}/{method if method in REFINE_METHODS else OTHER}"
    return decoder


def strategies(offered: Offered) -> tuple[str, ...]:
    """Every strategy a server offers out of the box."""
    return (
        AR,
        *(f"{SPECULATIVE}/{d}" for d in offered.drafts()),
        *(f"{REFINE}/{m}" for m in offered.methods()),
    )
