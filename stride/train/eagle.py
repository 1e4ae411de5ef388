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

import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from stride.engine.eagle import EagleConfig, EagleHead, load_head, save_head
from stride.engine.model import rotate
from stride.train.data import Sample

log = logging.getLogger(__name__)

STEP_WEIGHT = 0.8  # loss weight decay per TTT step, as in EAGLE-3


@dataclass
class TrainConfig:
    depth: int = 5  # TTT steps: chained drafts trained per position
    lr: float = 5e-4
    warmup: int = 100
    batch_tokens: int = 16384  # padded tokens per optimizer step
    seconds: float = 300.0  # training time budget
    max_steps: int | None = None
    regress: float = 0.1  # weight of the feature regression
    holdout: int = 64  # greedy samples kept out for measuring acceptance
    seed: int = 0


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


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[Sample]]:
    """Samples of similar length together, at most `batch_tokens` padded tokens per batch."""
    order = sorted(samples, key=lambda s: len(s.token_ids))
    out, current, longest = [], [], 0
    for s in order:
        longest_if = max(longest, len(s.token_ids))
        if current and longest_if * (len(current) + 1) > batch_tokens:
            out.append(current)
            current, longest_if = [], len(s.token_ids)
        current.append(s)
        longest = longest_if
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def pad(samples: list[Sample], device: torch.device):
    """(ids [B, T], valid [B, T], answer [B, T]: the position holds an answer token)."""
    t = max(len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), t, dtype=torch.long)
    valid = torch.zeros(len(samples), t, dtype=torch.bool)
    answer = torch.zeros(len(samples), t, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        valid[i, :n] = True
        answer[i, s.num_prompt : n] = True
    return ids.to(device), valid.to(device), answer.to(device)


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

    For greedy answers, drafting from origin t (the last position with target features; token
    t+1 known) accepts the leading drafts that equal tokens t+2.. and commits them plus one
    token; the next origin is t+1+accepted. The unrolled forward gives every origin's drafts.
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
            n = len(s.token_ids)
            t = s.num_prompt - 1  # the prefill made token t+1
            while t + 2 < n:
                accepted = 0
                while accepted < k and t + 2 + accepted < n:
                    if preds[accepted][b][t] != s.token_ids[t + 2 + accepted]:
                        break
                    accepted += 1
                passes += 1
                committed += min(accepted + 1, n - (t + 2))
                t += 1 + accepted
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
    rng = random.Random(config.seed)
    held = eval_samples if eval_samples is not None else []
    train_set = samples
    device = head.d2t.device
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state_file = out / "trainer_state.pt"
    step = 0
    if state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=True)
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        log.info("resumed from %s at step %d", out, step)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _Null()
    start = time.monotonic()
    history: list[dict] = []
    bar = tqdm(desc="training", unit="step", initial=step, disable=None)
    done = False
    while not done:
        for batch in batches(train_set, config.batch_tokens, rng):
            lr = config.lr * min(1.0, (step + 1) / config.warmup)
            if config.max_steps:
                lr *= 0.5 * (1 + math.cos(math.pi * min(step / config.max_steps, 1.0)))
            else:
                lr *= 0.5 * (1 + math.cos(math.pi * min((time.monotonic() - start) /
                                                        config.seconds, 1.0)))  # fmt: skip
            for group in opt.param_groups:
                group["lr"] = lr
            with autocast:
                loss, agree = step_losses(head, target, batch, config.depth, config.regress)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            step += 1
            bar.update(1)
            if step % 50 == 0:
                top1 = "/".join(f"{a:.2f}" for a in agree)
                bar.set_postfix(loss=f"{loss.item():.3f}", top1=top1)
                history.append({"step": step, "loss": loss.item(), "top1": agree})
                if step % 250 == 0:
                    log.info("step %d, %.0f s: loss %.3f, top-1 per depth %s", step,
                             time.monotonic() - start, loss.item(), top1)  # fmt: skip
            elapsed = time.monotonic() - start
            if elapsed >= config.seconds or (config.max_steps and step >= config.max_steps):
                done = True
                break
    bar.close()
    save_head(head, out)
    torch.save({"optimizer": opt.state_dict(), "step": step}, state_file)
    result = {"steps": step, "seconds": round(time.monotonic() - start, 1), "history": history}
    if held:
        head.eval()
        with autocast:
            result["chain_acceptance"] = {
                k: round(chain_acceptance(head, target, held, k), 3) for k in (3, 4, 5, 6)
            }
        head.train()
    return result


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
