"""What a `speculative` request may ask for (`{"type": "speculative", ...}`; the options are
described in `decoder`): types and ranges only. Which drafters exist and how many layers there
are is the server's, checked when a request is admitted (`Speculative.validate`)."""

from __future__ import annotations

from pydantic import Field

from stride.decoders.base import Options
from stride.decoders.speculative.policy import MAX_K

MAX_NGRAM = 8
MAX_TREE_NODES = 128
MAX_TREE_TOPK = 16


class SpeculativeOptions(Options):
    """Types and ranges (see the module docstring)."""

    draft: str | None = Field(
        None, description="ngram, early_exit, eagle (with an EAGLE head) or the --draft-model"
    )
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_K)
    adaptive: bool = True
    exit_layer: int | None = Field(None, ge=1, description="early_exit: layers that draft")
    ngram_max: int | None = Field(None, ge=1, le=MAX_NGRAM, description="ngram: longest suffix")
    tree_nodes: int | None = Field(
        None, ge=0, le=MAX_TREE_NODES,
        description="eagle: draft a tree of this many nodes (0: a chain)",
    )  # fmt: skip
    tree_topk: int | None = Field(
        None, ge=1, le=MAX_TREE_TOPK, description="eagle: children expanded per tree node"
    )
