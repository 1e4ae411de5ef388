"""The names of Stride's decoders and their variants, in one place, importable without torch.

A request's strategy is its decoder and the variant its options choose: `ar`,
`speculative/<draft>`, `refine/<method>`. Metrics label by it, the CLI lists it, and the
decoders validate against the same names (`registry` holds the classes behind them; a test
keeps the two in step). A variant is offered only where the server has what it needs: an
EAGLE head, a draft model, a MASK-slot adapter, a masked diffusion LM (`Offered`).

A request may name a variant alone, as users speak of them (`"eagle"`, `"lookahead"`), or as its
strategy (`"speculative/eagle"`, what metrics and usage show): `shorthand` expands either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

AR, SPECULATIVE, REFINE = "ar", "speculative", "refine"
DECODERS = (AR, SPECULATIVE, REFINE)

NGRAM, EARLY_EXIT, EAGLE, DRAFT_MODEL = "ngram", "early_exit", "eagle", "draft_model"
DRAFTS = (NGRAM, EARLY_EXIT, EAGLE, DRAFT_MODEL)  # any other draft name is the draft model

JACOBI, LOOKAHEAD, INTROSPECTIVE, DIFFUSION = "jacobi", "lookahead", "introspective", "diffusion"
REFINE_METHODS = (JACOBI, LOOKAHEAD, INTROSPECTIVE, DIFFUSION)
OTHER = "other"  # the label of a variant nobody offers (validation refuses it anyway)


@dataclass(frozen=True)
class Offered:
    """What a server has beyond the built-in variants."""

    eagle: bool = False  # an EAGLE head: draft `eagle`, the default draft
    draft_model: bool = False  # a draft model: draft `draft_model` (the default without a head)
    diffusion: bool = False  # a masked diffusion LM: refine method `diffusion`
    introspective: bool = False  # a MASK-slot adapter: refine method `introspective`

    @property
    def default_draft(self) -> str:
        return EAGLE if self.eagle else DRAFT_MODEL if self.draft_model else NGRAM

    def drafts(self) -> tuple[str, ...]:
        wanted = {NGRAM: True, EARLY_EXIT: True, EAGLE: self.eagle, DRAFT_MODEL: self.draft_model}
        return tuple(d for d in DRAFTS if wanted[d])

    def methods(self) -> tuple[str, ...]:
        wanted = {DIFFUSION: self.diffusion, INTROSPECTIVE: self.introspective}
        return tuple(m for m in REFINE_METHODS if wanted.get(m, True))


def strategy(decoder: str, options: Mapping[str, Any] | None, offered: Offered) -> str:
    """The strategy of a request: `ar`, `speculative/{ngram,early_exit,eagle,draft_model}`,
    `refine/{jacobi,lookahead,introspective,diffusion}`. Bounded whatever the options say: a
    draft model is never named by its path, and an unknown method is `<decoder>/other`."""
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


def shorthand(name: str) -> tuple[str, dict[str, Any]] | None:
    """`"eagle"` or `"speculative/eagle"` → ("speculative", {"draft": "eagle"}); `"lookahead"` or
    `"refine/lookahead"` → ("refine", {"method": "lookahead"}); None for any other name."""
    decoder, _, variant = name.rpartition("/")
    if variant in DRAFTS and decoder in ("", SPECULATIVE):
        return SPECULATIVE, {"draft": variant}
    if variant in REFINE_METHODS and decoder in ("", REFINE):
        return REFINE, {"method": variant}
    return None


def shorthands() -> tuple[str, ...]:
    """Every name `shorthand` expands."""
    drafts = (f"{p}{d}" for p in ("", f"{SPECULATIVE}/") for d in DRAFTS)
    methods = (f"{p}{m}" for p in ("", f"{REFINE}/") for m in REFINE_METHODS)
    return (*drafts, *methods)
