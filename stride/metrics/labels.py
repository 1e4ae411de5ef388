"""The values Stride's metric labels take: bounded sets, so that series stay few.

`user` comes only from a configured allowlist (anything else is `other`, no user is `none`);
`decoder` is a request's strategy (`catalog.strategy`: `ar`, `speculative/ngram`,
`refine/jacobi`, ...) on request metrics, and the registry name of the decoder of every sequence
a step scored (`ar`, `speculative`, `refine`; `mixed` when several) on the step's roofline.
Reasons and kinds are closed tuples, so that each of their series can exist from the start.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from stride.decoders import catalog

USERS_ENV = "STRIDE_METRICS_USERS"
OTHER_USER = "other"
NO_USER = "none"
REJECT_REASONS = ("queue_full", "deadline", "auth", "validation", "unavailable", "internal")
FINISH_REASONS = ("stop", "length", "abort", "deadline", "error")
STEP_DECODER_MIXED = "mixed"  # a step's sequences used several decoders
SCORED_KINDS = ("decode", "prefill", "draft")  # rows of a forward pass, by what they are


def strategy(
    decoder: str,
    options: Mapping[str, Any] | None = None,
    draft_model: bool = False,
    eagle: bool = False,
) -> str:
    """The `decoder` label of a request (`catalog.strategy`). `eagle`, `draft_model`: whether
    the server has an EAGLE head or a draft model, which makes it the default draft of
    speculative requests (the head first)."""
    return catalog.strategy(decoder, options, catalog.Offered(eagle, draft_model))


def strategies(
    draft_model: bool = False,
    diffusion: bool = False,
    eagle: bool = False,
    introspective: bool = False,
) -> tuple[str, ...]:
    """Every `decoder` label a server offers out of the box (`catalog.strategies`)."""
    return catalog.strategies(catalog.Offered(eagle, draft_model, diffusion, introspective))


def parse_users(value: str | Iterable[str] | None) -> frozenset[str]:
    """`"a,b"` (the flag / STRIDE_METRICS_USERS) or names → the user label allowlist."""
    if value is None:
        value = os.environ.get(USERS_ENV, "")
    names = value.split(",") if isinstance(value, str) else value
    return frozenset(n.strip() for n in names if n and n.strip())


def user_label(user: str | None, allowed: frozenset[str]) -> str:
    """The `user` label of a request's user: itself if `allowed` lists it, else `other`."""
    if not user:
        return NO_USER
    return user if user in allowed else OTHER_USER
