"""Where a draft head wins and loses: its acceptance on the target's answers to a prompt set.

The engine answers the prompts greedily; each head is then measured offline on those answers,
as the trainer measures it (`stride.train.eagle`): top-1 agreement with the target per chained
draft position, mean tokens per pass of greedy chain drafting for K = 1..6, and how many answer
tokens its draft vocabulary covers. No serving path is involved, so the numbers say what the
head knows, apart from how fast a decoder uses it (`bench_eagle.py` measures that).

    python bench/bench_head.py --prompts heldout training --heads new-head   # (+ the shipped one)
    python bench/bench_head.py --prompts bench/data/test_prompts.jsonl --device cuda --json h.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.prompts import BUILTIN_PROMPTS  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.eagle import load_head  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.policy import SchedulerConfig  # noqa: E402
from stride.train import data  # noqa: E402
from stride.train.cli import teacher  # noqa: E402
from stride.train.eagle import Target, chain_acceptance, step_losses  # noqa: E402
from stride.train.loop import autocast  # noqa: E402
from stride.train.prompts import Prompt, builtin_prompts, read_prompts  # noqa: E402

HELDOUT = Path(__file__).parent / "data" / "heldout_prompts.jsonl"
SHIPPED = Path(__file__).resolve().parents[1] / "stride" / "drafts" / "SmolLM2-135M-Instruct"


def prompt_set(name: str) -> list[Prompt]:
    """`heldout` (loadtest's and bench/data's, of kinds the built-in generator does not make),
    `training` (70 from that generator, seed 0), or a JSONL file."""
    if name == "heldout":
        return [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS] + read_prompts(HELDOUT)
    if name == "training":
        return builtin_prompts(70, seed=0)
    return read_prompts(Path(name))


def answer(
    model: str | None, device: str, prompts: list[str], tokens: int
) -> tuple[Engine, dict[str, list[data.Sample]]]:
    """The engine over the target, and its greedy answers to each named prompt set."""
    engine = Engine(EngineConfig(model=model, device=device, dtype="auto"))
    core = EngineCore(engine, SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=8192))
    start = time.perf_counter()
    answers = {
        name: data.generate(core, prompt_set(name), tokens, sampled_share=0.0) for name in prompts
    }
    print(f"answered in {time.perf_counter() - start:.1f} s", flush=True)
    return engine, answers


@torch.no_grad()
def measure(head, target: Target, samples: list[data.Sample], depth: int = 6) -> dict:
    """Top-1 per chained position, chain tokens per pass for K = 1..depth, vocab coverage."""
    device = head.d2t.device
    agree = torch.zeros(depth)
    counts = 0
    with autocast(device):
        for i in range(0, len(samples), 16):
            _, per_step = step_losses(head, target, samples[i : i + 16], depth, 0.0)
            agree[: len(per_step)] += torch.tensor(per_step)
            counts += 1
        chains = {k: round(chain_acceptance(head, target, samples, k), 3) for k in range(1, 7)}
    vocab = set(head.draft_ids.tolist())
    answers = [t for s in samples for t in s.token_ids[s.num_prompt :]]
    return {
        "top1_per_position": [round(a, 3) for a in (agree / max(counts, 1)).tolist()],
        "chain_tokens_per_pass": chains,
        "draft_vocab": len(vocab),
        "draft_vocab_coverage": round(sum(t in vocab for t in answers) / max(len(answers), 1), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M)")
    ap.add_argument("--heads", nargs="+", type=Path, default=[], help="after the shipped one")
    ap.add_argument("--prompts", nargs="+", default=["heldout", "training"],
                    help="heldout, training, or JSONL files")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=128, help="answer length")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    engine, answers = answer(args.model, args.device, args.prompts, args.tokens)
    card = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
    model = teacher(engine)
    result: dict = {"card": card, "model": engine.name, "dtype": str(engine.dtype),
                    "tokens": args.tokens, "command": "python bench/bench_head.py "
                    + " ".join(sys.argv[1:]), "heads": {}}  # fmt: skip
    for path in [SHIPPED, *args.heads]:
        head = load_head(path, model).eval()
        target = Target(model, head.config.aux_layers, head.draft_ids)
        result["heads"][str(path)] = entry = {}
        for name, samples in answers.items():
            entry[name] = measure(head, target, samples)
            entry[name]["answers"] = len(samples)
            print(f"{path} on {name}: {entry[name]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
