"""One registry of decoders and variants: the classes behind the catalog's names, and the
strategy labels metrics and the CLI read from it."""

from __future__ import annotations

from stride.decoders import catalog
from stride.decoders.refine import METHODS
from stride.decoders.registry import DECODERS, spec_schema


def test_every_catalogued_decoder_has_a_class_and_every_refine_method_its_options():
    assert all(DECODERS[name].name == name for name in catalog.DECODERS)
    assert tuple(METHODS.models) == catalog.REFINE_METHODS
    assert spec_schema()["oneOf"][0]["enum"][: len(catalog.DECODERS)] == list(catalog.DECODERS)


def test_strategies_offer_only_what_the_server_has():
    assert catalog.strategies(catalog.Offered()) == (
        "ar", "speculative/ngram", "speculative/early_exit", "refine/jacobi", "refine/lookahead"
    )  # fmt: skip
    every = catalog.strategies(
        catalog.Offered(eagle=True, draft_model=True, diffusion=True, introspective=True)
    )
    assert every == (
        "ar",
        *(f"speculative/{d}" for d in catalog.DRAFTS),
        *(f"refine/{m}" for m in catalog.REFINE_METHODS),
    )
    assert catalog.Offered(eagle=True, draft_model=True).default_draft == "eagle"
    assert catalog.strategy("speculative", {}, catalog.Offered(eagle=True)) == "speculative/eagle"
    # without a head, a request naming eagle is refused at admission; its label stays bounded
    assert catalog.strategy("speculative", {"draft": "eagle"}, catalog.Offered()) == (
        "speculative/draft_model"
    )
