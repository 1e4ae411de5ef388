"""Speculative decoding, one idea per module: `decoder` (the `Decoder`), `policy` (adaptive K,
and what it keeps per sequence), `loop_policy` (the cost model, and the device loop's shape),
`verify` (chains and trees), `drafters` and `eagle` (who drafts), `tree` (draft trees),
`options` (what a request may ask for)."""

from stride.decoders.speculative.decoder import Speculative
from stride.decoders.speculative.options import SpeculativeOptions

__all__ = ["Speculative", "SpeculativeOptions"]
