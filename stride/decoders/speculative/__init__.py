"""Speculative decoding, one idea per module: `decoder` (the `Decoder`), `policy` (adaptive K,
and what it keeps per sequence) and its `costs` model, `verify` (chains and trees), `drafters`
and `eagle` (who drafts), `tree` (draft trees)."""

from stride.decoders.speculative.decoder import Speculative, SpeculativeOptions

__all__ = ["Speculative", "SpeculativeOptions"]
