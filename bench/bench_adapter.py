"""Where a MASK-slot adapter wins and loses: its guesses on the target's answers to a prompt set.

The engine answers the prompts greedily; the adapter is then measured offline on those answers,
as its trainer measures it (`stride.train.introspective`: one forward per answer with k slots
after every origin): top-1 agreement with the target per slot, tokens per pass of greedy
`introspective` decoding with 1..k slots, and the first slot's agreement by how sure the target
itself is of the token (its own top-1 probability there) and of the token before it, which the
slots never see (the pass's own next token: a slot guesses two tokens past what it reads).
No serving path is involved
(`bench_refine.py` measures that), so the numbers say what the adapter knows.

    python bench/bench_adapter.py --adapter DIR --prompts heldout training
    python bench/bench_adapter.py --adapter DIR --prompts bench/data/test_prompts.jsonl --json o
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_head import answer  # noqa: E402

from stride.engine.adapter import MaskAdapter  # noqa: E402
from stride.train import data  # noqa: E402
from stride.train.cli import teacher  # noqa: E402
from stride.train.introspective import answer_anchors, by_origin, forward, layout  # noqa: E402
from stride.train.loop import tokens_per_pass  # noqa: E402

BINS = (0.5, 0.7, 0.9, 0.99)  # the target's top-1 probability: < 0.5, 0.5-0.7, ..., > 0.99


@torch.no_grad()
def measure(model, adapter: MaskAdapter, samples: list[data.Sample], k: int) -> dict:
    """Top-1 per slot, tokens per pass with 1..k slots, and slot 0's agreement per bin of the
    target's confidence, over every origin of every answer."""
    device = adapter.mask_embedding.device
    hits = torch.zeros(k)
    seen = torch.zeros(k)
    # slot 0's hits and positions per bin of the target's confidence, in the token it guesses
    # and in the one before it (the pass's own next token, which the slots do not see)
    bin_hits = torch.zeros(2, len(BINS) + 1)
    bin_seen = torch.zeros(2, len(BINS) + 1)
    passes = [0] * (k + 1)
    committed = [0] * (k + 1)
    for s in samples:
        origins = answer_anchors(s)
        if not origins:
            continue
        lay = layout([s], [origins], k, device)
        hidden = forward(model, adapter, lay)[0]
        guesses = model.lm_head(hidden[lay.real :]).argmax(-1).view(len(origins), k)
        real = torch.softmax(model.lm_head(hidden[: lay.real]).float(), -1)
        sure, choice = real.max(-1)  # the target's token after each real row, and its probability
        tokens = torch.tensor(s.token_ids, device=device)
        for j in range(k):  # slot j of origin t guesses token t + 2 + j: real row t + 1 + j's
            at = torch.tensor(origins, device=device) + 1 + j
            ok = at < len(tokens) - 1
            hit = (guesses[:, j] == choice[at.clamp(max=len(tokens) - 1)]) & ok
            hits[j] += hit.sum().item()
            seen[j] += ok.sum().item()
            if j == 0:
                edges = torch.tensor(BINS, device=device)
                for b, rows in enumerate((at[ok], at[ok] - 1)):
                    bins = torch.bucketize(sure[rows], edges)
                    bin_seen[b] += torch.bincount(bins, minlength=len(BINS) + 1).cpu().float()
                    bin_hits[b] += torch.bincount(bins[hit[ok]], minlength=len(BINS) + 1).cpu()
        preds = by_origin(guesses, origins, len(s.token_ids))
        for slots in range(1, k + 1):
            p, c = tokens_per_pass(s, preds, slots)
            passes[slots] += p
            committed[slots] += c
    share = bin_seen / bin_seen.sum(1, keepdim=True).clamp(min=1)
    agree = bin_hits / bin_seen.clamp(min=1)
    return {
        "top1_per_slot": [round(a, 3) for a in (hits / seen.clamp(min=1)).tolist()],
        "tokens_per_pass": {j: round(committed[j] / max(passes[j], 1), 3) for j in range(1, k + 1)},
        **{
            key: {
                label: {"share": round(a, 3), "slot0_top1": round(h, 3)}
                for label, a, h in zip(_labels(), share[b].tolist(), agree[b].tolist(), strict=True)
            }
            for b, key in enumerate(("by_target_confidence", "by_confidence_in_the_token_before"))
        },
    }


def _labels() -> list[str]:
    edges = ("0", *map(str, BINS), "1")
    return [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:], strict=False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", type=Path, required=True, help="a MASK-slot adapter directory")
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M)")
    ap.add_argument("--prompts", nargs="+", default=["heldout", "training"],
                    help="heldout, training, or JSONL files")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=128, help="answer length")
    ap.add_argument("--slots", type=int, default=4, help="slots after each origin (k)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    engine, answers = answer(args.model, args.device, args.prompts, args.tokens)
    model = teacher(engine)
    adapter = MaskAdapter.load(args.adapter, model).attach(model).eval()
    card = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
    command = "python bench/bench_adapter.py " + " ".join(sys.argv[1:])
    result: dict = {"card": card, "model": engine.name, "dtype": str(engine.dtype),
                    "tokens": args.tokens, "adapter": str(args.adapter), "command": command,
                    "prompts": {}}  # fmt: skip
    for name, samples in answers.items():
        entry = result["prompts"][name] = measure(model, adapter, samples, args.slots)
        entry["answers"] = len(samples)
        print(f"{args.adapter} on {name}: {json.dumps(entry)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
