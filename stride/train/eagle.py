"""Train an EAGLE-3 draft head on self-distilled data, with EAGLE-3's training-time test.

Per batch the frozen target (a transformers model of the same weights) gives, for every
position, the fused low/middle/high hidden states (the head's feature) and its next-token
distribution. The head then runs as it will when serving, `depth` times over the whole batch:
step 0 reads the target's features; step j reads its own outputs of step j-1 (row t at
position t+j, token t+1+j) and attends to the real rows up to t plus its own chain at t. Each
step's loss is the cross-entropy of the head's draft-vocabulary distribution against the
target's (renormalised on the draft vocabulary), weighted 0.8^j, plus a small regression of
the head's normed output onto the target's final hidden state at the position it predicts
from (EAGLE's feature loss, which keeps the chained inputs close to real features).

The same unrolled forward, without gradients, measures what matters: the mean accepted length
of greedy chain drafting on held-out answers (`chain_acceptance`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from stride.engine.eagle import EagleConfig, EagleHead, load_head, save_head
from stride.engine.model import rotate
from stride.train.data import Sample
from stride.train.loop import LoopConfig, autocast, fit, pad, tokens_per_pass

STEP_WEIGHT = 0.8  # loss weight decay per TTT step, as in EAGLE-3


@dataclass
class TrainConfig(LoopConfig):
    depth: int = 5  # TTT steps: chained drafts trained per position
    regress: float = 0.1  # weight of the feature regression
    holdout: int = 64  # greedy samples kept out for measuring acceptance


def choose_draft_vocab(
    samples: list[Sample], size: int, vocab: int, keep: set[int]
) -> torch.Tensor:
    """The `size` target tokens most often in the answers (plus `keep`), sorted: EAGLE-3's d2t."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(s.token_ids[s.num_prompt :])
    ids = list(keep)
    for token, _ in counts.most_common():
        if len(ids) >= size:
            break
        if token not in keep:
            ids.append(token)
    for token in range(vocab):  # too little data: fill with the lowest unused ids
        if len(ids) >= size:
            break
        if token not in counts and token not in keep:
            ids.append(token)
    return torch.tensor(sorted(ids[:size]), dtype=torch.long)


class Target:
    """The frozen target: features and next-token distributions of a padded batch."""

    def __init__(self, model, aux_layers: tuple[int, ...], draft_ids: torch.Tensor) -> None:
        self.model = model.eval().requires_grad_(False)
        self.aux_layers = aux_layers
        self.draft_weight = model.lm_head.weight[draft_ids.to(model.lm_head.weight.device)]

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, valid: torch.Tensor):
        """(aux [B, T, 3H], final hidden [B, T, H], draft-vocab log-probs [B, T, Vd])."""
        out = self.model.model(
            input_ids=ids, attention_mask=valid.long(), output_hidden_states=True
        )
        hs = out.hidden_states  # [embeddings, after layer 0, ..., final normed]
        aux = torch.cat([hs[i + 1] for i in self.aux_layers], -1)
        final = out.last_hidden_state
        logp = F.log_softmax(F.linear(final, self.draft_weight).float(), -1)
        return aux, final, logp


def unroll(
    head: EagleHead, ids: torch.Tensor, valid: torch.Tensor, aux: torch.Tensor, depth: int
) -> list[torch.Tensor]:
    """The head's outputs g_j [B, T, H] for j < depth, chained as when serving (module docstring).

    Row t of step j has read token t+1+j (0 past the end) at position t+j.
    """
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    allowed = causal[None, None] & valid[:, None, None, :]  # [B, 1, T, T]
    hidden = head.project(aux)
    caches: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in head.layers]
    outs = []
    for j in range(depth):
        tokens = torch.zeros_like(ids)
        tokens[:, : max(t - 1 - j, 0)] = ids[:, 1 + j :]
        x, embeds = head.inputs(tokens, hidden)
        cos, sin = head.rope(x, positions + j)
        for i, layer in enumerate(head.layers):
            attn_in, residual = layer.attention_input(x, embeds if i == 0 else None)
            q, k, v = layer.qkv(attn_in)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            caches[i].append((k, v))
            x = layer.finish(_ttt_attention(q, caches[i], allowed), residual)
        hidden = x
        outs.append(x)
    return outs


def _ttt_attention(q, cache, allowed) -> torch.Tensor:
    """q [B, T, H, D] over step 0's keys (causal) and row t's own keys of later steps."""
    heads, kv_heads = q.shape[2], cache[0][0].shape[2]
    rep = heads // kv_heads
    scale = q.shape[-1] ** -0.5
    qt = q.transpose(1, 2)  # [B, H, T, D]
    k0, v0 = (x.repeat_interleave(rep, 2).transpose(1, 2) for x in cache[0])
    scores = [(qt @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~allowed, -math.inf)]
    extra_v = []
    for k, v in cache[1:]:
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        scores.append((q * k).sum(-1).float().mul(scale).transpose(1, 2)[..., None])
        extra_v.append(v.transpose(1, 2))
    p = torch.softmax(torch.cat(scores, -1), -1).to(q.dtype)
    t = k0.shape[2]
    out = p[..., :t] @ v0
    for e, v in enumerate(extra_v):
        out = out + p[..., t + e, None] * v
    return out.transpose(1, 2)


def step_losses(head: EagleHead, target: Target, samples: list[Sample], depth: int, regress: float):
    """Per-step (loss, top-1 agreement with the target) of one batch; the loss is weighted."""
    device = head.d2t.device
    ids, valid, answer = pad(samples, device)
    aux, final, logp_target = target(ids, valid)
    outs = unroll(head, ids, valid, aux.to(head.fc.weight.dtype), depth)
    total = torch.zeros((), device=device)
    agree = []
    for j, g in enumerate(outs):
        # Row t predicts token t+2+j from the target's distribution at t+1+j.
        n = ids.shape[1] - 2 - j
        if n <= 0:
            break
        rows, mask = g[:, :n], answer[:, 2 + j : 2 + j + n]
        target_lp = logp_target[:, 1 + j : 1 + j + n]
        logp = F.log_softmax(head.logits(rows), -1)
        count = mask.sum().clamp(min=1)
        loss = (-(target_lp.exp() * logp).sum(-1) * mask).sum() / count
        if regress and head.config.eagle3:
            err = F.smooth_l1_loss(
                head.norm(rows).float(), final[:, 1 + j : 1 + j + n].float(), reduction="none"
            )
            loss = loss + regress * (err.mean(-1) * mask).sum() / count
        total = total + STEP_WEIGHT**j * loss
        hit = (logp.argmax(-1) == target_lp.argmax(-1)) & mask
        agree.append((hit.sum() / count).item())
    return total, agree


@torch.no_grad()
def chain_acceptance(head: EagleHead, target: Target, samples: list[Sample], k: int) -> float:
    """Mean tokens per verification pass of greedy chain drafting with k drafts.

    Origin t is the last position with target features (`loop.tokens_per_pass`); the unrolled
    forward gives every origin's drafts.
    """
    device = head.d2t.device
    draft_ids = head.draft_ids
    passes = committed = 0
    for i in range(0, len(samples), 16):
        group = samples[i : i + 16]
        ids, valid, _ = pad(group, device)
        aux, _, _ = target(ids, valid)
        outs = unroll(head, ids, valid, aux.to(head.fc.weight.dtype), k)
        preds = torch.stack([draft_ids[head.logits(g).argmax(-1)] for g in outs])  # [k, B, T]
        preds = preds.cpu().tolist()
        for b, s in enumerate(group):
            p, c = tokens_per_pass(s, [row[b] for row in preds], k)
            passes, committed = passes + p, committed + c
    return committed / max(passes, 1)


def train(
    head: EagleHead,
    target: Target,
    samples: list[Sample],
    config: TrainConfig,
    out: Path,
    eval_samples: list[Sample] | None = None,
) -> dict:
    """Train `head` in place; checkpoints (head + optimizer) go to `out`, and resume from it."""
    device = head.d2t.device
    params = [p for p in head.parameters() if p.requires_grad]

    def loss_fn(batch: list[Sample]) -> tuple[torch.Tensor, list[float]]:
        return step_losses(head, target, batch, config.depth, config.regress)

    result = fit(params, loss_fn, samples, config, out / "trainer_state.pt", device)
    save_head(head, out)
    if eval_samples:
        head.eval()
        with autocast(device):
            result["chain_acceptance"] = {
                k: round(chain_acceptance(head, target, eval_samples, k), 3) for k in (3, 4, 5, 6)
            }
        head.train()
    return result


def new_head(target_model, draft_ids: torch.Tensor, num_layers: int = 1) -> EagleHead:
    """A fresh EAGLE-3 head for `target_model` (a transformers causal LM) with draft vocabulary
    `draft_ids`; its layer starts random, as EAGLE-3's does."""
    config = EagleConfig.for_target(target_model.config, len(draft_ids), num_layers)
    head = EagleHead(config, target_model)
    weight = target_model.lm_head.weight
    head.d2t = draft_ids.to(weight.device) - torch.arange(len(draft_ids), device=weight.device)
    std = getattr(target_model.config, "initializer_range", 0.02)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
        elif "norm" in name:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.zeros_(p)
    return head.to(weight.device)


def resume_head(out: Path, target_model) -> EagleHead:
    return load_head(out, target_model).float().train()
