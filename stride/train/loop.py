"""The training loop every learned decoder part shares (EAGLE heads, MASK-slot adapters).

What differs between them is the loss of a batch of self-distilled samples; the rest is here:
length-bucketed batches under a padded-token budget, AdamW with warmup and a cosine decay over
the time budget (or the step budget), bf16 autocast on a GPU, gradient clipping, progress, and
a checkpoint of the optimizer beside the trained weights so that a second run resumes. The
held-out measure both report is here too: tokens per verification pass of greedy decoding whose
proposals come from each position's predictions (`tokens_per_pass`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from stride.train.data import Sample

log = logging.getLogger(__name__)

# A batch's loss and what to log about it (e.g. top-1 agreement per draft position).
LossFn = Callable[[list[Sample]], tuple[torch.Tensor, list[float]]]


@dataclass
class LoopConfig:
    lr: float = 5e-4
    warmup: int = 100
    batch_tokens: int = 16384  # padded tokens per optimizer step
    seconds: float = 300.0  # training time budget
    max_steps: int | None = None
    seed: int = 0
    extra_rows: int = 0  # rows each sample adds to its tokens in a batch (see `batches`)


def batches(
    samples: list[Sample], batch_tokens: int, rng: random.Random, extra: int = 0
) -> list[list[Sample]]:
    """Samples of similar length together, at most `batch_tokens` padded rows per batch, each
    sample's tokens plus `extra` rows (a MASK-slot adapter's slots)."""
    order = sorted(samples, key=lambda s: len(s.token_ids))
    out, current, longest = [], [], 0
    for s in order:
        longest_if = max(longest, len(s.token_ids) + extra)
        if current and longest_if * (len(current) + 1) > batch_tokens:
            out.append(current)
            current, longest_if = [], len(s.token_ids) + extra
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


def autocast(device: torch.device):
    """bf16 autocast on a GPU (fp32 master weights); nothing on a CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", torch.bfloat16)
    return contextlib.nullcontext()


def fit(
    params: list[torch.nn.Parameter],
    loss_fn: LossFn,
    samples: list[Sample],
    config: LoopConfig,
    state_file: Path,
    device: torch.device,
) -> dict:
    """Train `params` on `samples` by `loss_fn` until the time or step budget is spent; the
    optimizer's state goes to `state_file` (and resumes from it). Returns steps, seconds and
    the logged history."""
    rng = random.Random(config.seed)
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=True)
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        log.info("resumed from %s at step %d", state_file.parent, step)
    start = time.monotonic()
    history: list[dict] = []
    bar = tqdm(desc="training", unit="step", initial=step, disable=None)
    done = False
    while not done:
        for batch in batches(samples, config.batch_tokens, rng, config.extra_rows):
            if config.max_steps:
                progress = min(step / config.max_steps, 1.0)
            else:
                progress = min((time.monotonic() - start) / config.seconds, 1.0)
            lr = config.lr * min(1.0, (step + 1) / config.warmup)
            lr *= 0.5 * (1 + math.cos(math.pi * progress))
            for group in opt.param_groups:
                group["lr"] = lr
            with autocast(device):
                loss, agree = loss_fn(batch)
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
                    log.info("step %d, %.0f s: loss %.3f, top-1 per position %s", step,
                             time.monotonic() - start, loss.item(), top1)  # fmt: skip
            elapsed = time.monotonic() - start
            if elapsed >= config.seconds or (config.max_steps and step >= config.max_steps):
                done = True
                break
    bar.close()
    torch.save({"optimizer": opt.state_dict(), "step": step}, state_file)
    return {"steps": step, "seconds": round(time.monotonic() - start, 1), "history": history}


def tokens_per_pass(sample: Sample, preds: list[list[int]], k: int) -> tuple[int, int]:
    """(passes, tokens committed) of greedy decoding of a greedy `sample`'s answer whose
    proposals at origin t are `preds[j][t]` for j < k, the guesses for token t + 2 + j.

    Origin t is the last position whose token the target has scored, token t + 1 is known (the
    pass before made it); a pass accepts the leading proposals equal to tokens t + 2.., commits
    them plus one token, and the next origin is t + 1 + accepted. The prefill is not counted.
    """
    tokens, n = sample.token_ids, len(sample.token_ids)
    passes = committed = 0
    t = sample.num_prompt - 1  # the prefill made token t + 1
    while t + 2 < n:
        accepted = 0
        while accepted < k and t + 2 + accepted < n:
            if preds[accepted][t] != tokens[t + 2 + accepted]:
                break
            accepted += 1
        passes += 1
        committed += min(accepted + 1, n - (t + 2))
        t += 1 + accepted
    return passes, committed
