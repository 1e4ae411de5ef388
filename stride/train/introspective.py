"""Train a MASK-slot adapter (`engine.adapter`) on self-distilled data, the base model frozen.

Serving appends k MASK slots after the last verified row t; slot j (0-based) sits at position
t + 1 + j and should guess the token the base model says at t + 2 + j. Training shows the model
exactly that, many anchors at once: one forward over a sample's real tokens followed by k slots
for each of `anchors` random anchors t in its answer, each slot seeing the real tokens up to t
and the earlier slots of its own anchor (a 4D mask, explicit positions). The base model's own
distributions come from the same forward's real rows (which the adapter never touches): slot j
of anchor t learns, by cross-entropy, the distribution of real row t + 1 + j. Only the MASK
embedding and the low-rank factors have gradients.

Held-out, the same layout with every answer position as an anchor gives each origin's greedy
guesses, and `loop.tokens_per_pass` walks them as serving would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stride.engine.adapter import MaskAdapter
from stride.train.data import Sample
from stride.train.loop import LoopConfig, tokens_per_pass


@dataclass
class IntrospectiveConfig(LoopConfig):
    anchors: int = 64  # anchors (slot sets) trained per sample and batch


@dataclass
class Layout:
    """One batch laid out for a forward: real rows [0, T), then k slots per anchor."""

    ids: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, L]
    allowed: torch.Tensor  # [B, 1, L, L] bool: who sees whom
    slot_rows: torch.Tensor  # flat indices (into B * L) of the slot rows
    targets: torch.Tensor  # [B, A * k]: the real row whose distribution each slot learns
    valid: torch.Tensor  # [B, A * k]: the slot's anchor is real and its target exists
    real: int  # T


def layout(samples: list[Sample], anchors: list[list[int]], k: int, device) -> Layout:
    """Anchors t per sample (each < its length - 1); samples with fewer anchors get padding."""
    b = len(samples)
    t_max = max(len(s.token_ids) for s in samples)
    a = max(max(len(x) for x in anchors), 1)
    length = t_max + a * k
    lengths = torch.tensor([len(s.token_ids) for s in samples])
    ids = torch.zeros(b, length, dtype=torch.long)
    anchor = torch.zeros(b, a, dtype=torch.long)
    has = torch.zeros(b, a, dtype=torch.bool)
    for i, (s, ts) in enumerate(zip(samples, anchors, strict=True)):
        ids[i, : len(s.token_ids)] = torch.tensor(s.token_ids)
        anchor[i, : len(ts)] = torch.tensor(ts, dtype=torch.long)
        has[i, : len(ts)] = True
    j = torch.arange(k).repeat(a)  # each slot row's index in its set
    of = torch.arange(a).repeat_interleave(k)  # each slot row's anchor
    slot_anchor = anchor[:, of]  # [B, A*k]
    positions = torch.cat([torch.arange(t_max).expand(b, -1), slot_anchor + 1 + j], 1)

    cols = torch.arange(t_max)
    real_valid = cols[None, :] < lengths[:, None]  # [B, T]
    allowed = torch.zeros(b, length, length, dtype=torch.bool)
    allowed[:, :t_max, :t_max] = torch.ones(t_max, t_max, dtype=torch.bool).tril() & (
        real_valid[:, None, :]
    )
    allowed[:, torch.arange(length), torch.arange(length)] = True  # padding rows see themselves
    allowed[:, t_max:, :t_max] = cols[None, None, :] <= slot_anchor[:, :, None]
    own = (of[:, None] == of[None, :]) & (j[None, :] <= j[:, None])
    allowed[:, t_max:, t_max:] = own

    targets = slot_anchor + 1 + j
    valid = has[:, of] & (targets < lengths[:, None])
    rows = (torch.arange(b)[:, None] * length + t_max + torch.arange(a * k)[None, :]).flatten()
    return Layout(
        ids.to(device),
        positions.to(device),
        allowed[:, None].to(device),
        rows.to(device),
        targets.clamp(max=t_max - 1).to(device),
        valid.to(device),
        t_max,
    )


def forward(model, adapter: MaskAdapter, lay: Layout) -> torch.Tensor:
    """The final hidden states [B, L, H] of a laid-out batch, the adapter on its slot rows."""
    with adapter.on_rows(lay.slot_rows):
        out = model.model(
            input_ids=lay.ids,
            attention_mask=lay.allowed,
            position_ids=lay.positions,
            use_cache=False,
        )
    return out.last_hidden_state


def answer_anchors(sample: Sample) -> list[int]:
    """Every origin serving meets in the answer: the prompt's last position onwards."""
    return list(range(sample.num_prompt - 1, len(sample.token_ids) - 1))


def slot_losses(
    model, adapter: MaskAdapter, samples: list[Sample], k: int, anchors: int, rng: random.Random
) -> tuple[torch.Tensor, list[float]]:
    """(cross-entropy of the slots against the base distributions, top-1 agreement per slot)."""
    device = adapter.mask_embedding.device
    chosen = []
    for s in samples:
        origins = answer_anchors(s)
        chosen.append(sorted(rng.sample(origins, min(anchors, len(origins)))))
    lay = layout(samples, chosen, k, device)
    hidden = forward(model, adapter, lay)
    b = len(samples)
    slots = hidden[:, lay.real :]  # [B, A*k, H]
    target_h = hidden[torch.arange(b, device=device)[:, None], lay.targets].detach()
    head = model.lm_head
    logq = F.log_softmax(head(slots[lay.valid]).float(), -1)
    with torch.no_grad():
        p = F.softmax(head(target_h[lay.valid]).float(), -1)
    loss = -(p * logq).sum(-1).mean()
    hit = logq.argmax(-1) == p.argmax(-1)
    which = torch.arange(slots.shape[1], device=device).remainder(k)[None].expand(b, -1)
    which = which[lay.valid]
    agree = [hit[which == j].float().mean().item() if (which == j).any() else 0.0
             for j in range(k)]  # fmt: skip
    return loss, agree


@torch.no_grad()
def heldout_tokens_per_pass(model, adapter: MaskAdapter, samples: list[Sample], k: int) -> float:
    """Mean tokens per verification pass of greedy `introspective` decoding with k slots on
    greedy `samples` (the base model's own answers), every origin's guesses from one forward."""
    device = adapter.mask_embedding.device
    passes = committed = 0
    for s in samples:
        origins = answer_anchors(s)
        if not origins:
            continue
        lay = layout([s], [origins], k, device)
        slots = forward(model, adapter, lay)[0, lay.real :]
        guesses = model.lm_head(slots).argmax(-1).view(len(origins), k)
        p, c = tokens_per_pass(s, by_origin(guesses, origins, len(s.token_ids)), k)
        passes, committed = passes + p, committed + c
    return committed / max(passes, 1)


def by_origin(guesses: torch.Tensor, origins: list[int], length: int) -> list[list[int]]:
    """Slot guesses [origins, k] as `tokens_per_pass` reads them: preds[j][t], origin t's
    guess j (0 where t is no origin)."""
    preds = [[0] * length for _ in range(guesses.shape[1])]
    for j, column in enumerate(guesses.T.tolist()):
        for t, g in zip(origins, column, strict=True):
            preds[j][t] = g
    return preds
