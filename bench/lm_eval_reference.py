"""Check an lm-eval run against Stride: every choice's score equals transformers' fp32.

lm-eval's `local-completions` scores a multiple-choice task by the loglikelihood of each choice
(`echo` + `logprobs` on /v1/completions: the prompt's logprobs). With `--log_samples` it writes
each choice's score; this script recomputes them with transformers in float32 on the same model
(its GGUF file dequantized by transformers, not by Stride), tokenized as lm-eval tokenizes a
(context, continuation) pair, and fails if any differs by more than `--tolerance`.

    python bench/lm_eval_reference.py --samples OUT/MODEL/samples_TASK_*.jsonl [--model M]

docs/clients.md has the whole run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stride.engine import loader
from stride.engine.gguf_file import transformers_kwargs


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` for causal models: trailing spaces move to the continuation,
    the whole text is encoded and split at the context's length (no special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=Path, required=True, help="lm-eval's samples_*.jsonl")
    ap.add_argument("--model", default=None, help="what the server served (default: its default)")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()

    path = loader.resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path, **transformers_kwargs(path))
    model = AutoModelForCausalLM.from_pretrained(
        path, **transformers_kwargs(path), dtype=torch.float32
    )
    worst, count, greedy_agree = 0.0, 0, 0
    for line in args.samples.read_text().splitlines():
        sample = json.loads(line)
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        for (context, continuation), resp in zip(pairs, sample["resps"], strict=True):
            got, got_greedy = float(resp[0][0]), resp[0][1] == "True"
            ctx, cont = encode_pair(tokenizer, context, continuation)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            rows = lp[len(ctx) - 1 : len(ctx) + len(cont) - 1]
            targets = torch.tensor(cont)
            want = rows.gather(1, targets[:, None]).sum().item()
            greedy = bool((rows.argmax(-1) == targets).all())
            worst = max(worst, abs(got - want))
            greedy_agree += got_greedy == greedy
            count += 1
            print(f"doc {sample['doc_id']} {continuation!r:>14}: stride {got:.6f} "
                  f"transformers {want:.6f} (diff {abs(got - want):.1e})")  # fmt: skip
    print(f"{count} choices, largest difference {worst:.2e} (tolerance {args.tolerance:g}); "
          f"is_greedy agrees for {greedy_agree}/{count}")  # fmt: skip
    return 0 if count and worst <= args.tolerance and greedy_agree == count else 1


if __name__ == "__main__":
    sys.exit(main())
