"""`stride draft train`: self-distil what a decoder learns for a model, in one command.

    stride draft train --out heads/mine                       # built-in prompts, default model
    stride draft train --model my-llama --prompts traffic.jsonl --out heads/mine --seconds 900
    python -m stride.train --kind introspective --out adapters/mine --seconds 300

The engine answers the prompts (`stride.train.data`), the answers are kept in the output
directory (`data.pt`, so a resumed run does not regenerate them), then what `--kind` names
trains for `--seconds` and is written there with `training.json` (data size, time, held-out
tokens per pass): an EAGLE-3 draft head (`eagle`, the default), or a MASK-slot adapter for the
`introspective` refine method (`introspective`). Running it again on the same directory resumes
from the checkpoint. This module imports nothing heavy, so that `stride --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger("stride.train")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`draft train` under the `stride` command."""
    draft = sub.add_parser("draft", help="train draft heads and MASK-slot adapters")
    actions = draft.add_subparsers(dest="draft_command", required=True)
    configure(
        actions.add_parser(
            "train",
            help="self-distil an EAGLE-3 draft head (or, --kind introspective, a MASK-slot "
            "adapter) for a model",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", choices=("eagle", "introspective"), default="eagle",
                   help="an EAGLE-3 draft head or a MASK-slot adapter (introspective)")  # fmt: skip
    p.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, required=True, help="output directory (resumes)")
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help='JSONL of {"messages": [...]} or {"prompt": "..."}: your traffic',
    )
    p.add_argument("--num-prompts", type=int, default=8000, help="built-in prompts (no --prompts)")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="also this many prompts the model writes itself")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256, help="answer length cap")
    p.add_argument("--sampled-share", type=float, default=0.3, help="share of sampled answers")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--layers", type=int, default=1, help="decoder layers in the head")
    p.add_argument("--depth", type=int, default=5, help="training-time-test steps")
    p.add_argument("--rank", type=int, default=32, help="introspective: adapter rank")
    p.add_argument("--slots", type=int, default=4, help="introspective: MASK slots per set (k)")
    p.add_argument("--anchors", type=int, default=64,
                   help="introspective: slot sets trained per answer and step")  # fmt: skip
    p.add_argument("--seconds", type=float, default=300, help="training time budget")
    p.add_argument("--time-limit", type=float, default=None,
                   help="end training early enough that the whole run, answering prompts "
                   "included, takes at most this many seconds")  # fmt: skip
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-tokens", type=int, default=16384,
                   help="padded rows per step (introspective: slots included)")  # fmt: skip
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    import gc
    import time

    import torch

    from stride.engine.config import EngineConfig
    from stride.engine.engine import Engine
    from stride.scheduler.core import EngineCore
    from stride.scheduler.policy import SchedulerConfig
    from stride.train import data, prompts

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    started = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # The answers' KV cache: a few GiB are plenty for 256 streams of a few hundred tokens, and
    # leave the GPU to training once the engine is gone.
    kv = 6 << 30 if device.type == "cuda" else None
    engine = Engine(EngineConfig(model=args.model, device=str(device), kv_cache_memory=kv))
    data_file = out / "data.pt"
    answered_in = None  # seconds the engine took to answer the prompts (this run)
    if data_file.exists():
        saved = torch.load(data_file, weights_only=False)
        samples = [data.Sample(*s) for s in saved["samples"]]
        log.info("reusing %d answers from %s", len(samples), data_file)
    else:
        core = EngineCore(engine, SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192))
        todo = (
            prompts.read_prompts(args.prompts)
            if args.prompts
            else prompts.builtin_prompts(args.num_prompts, args.seed)
        )
        if args.self_prompts:
            todo += data.self_prompts(core, args.self_prompts, seed=args.seed)
        log.info("answering %d prompts with the target", len(todo))
        answering = time.monotonic()
        samples = data.generate(core, todo, args.max_tokens, args.sampled_share, seed=args.seed)
        answered_in = round(time.monotonic() - answering, 1)
        torch.save(
            {"samples": [(s.token_ids, s.num_prompt, s.greedy) for s in samples]}, data_file
        )
        del core
    eos, name = engine.eos_ids, engine.name
    target_model = teacher(engine).to(device)
    del engine
    gc.unfreeze()  # the engine core froze everything alive into the permanent generation
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    greedy = [s for s in samples if s.greedy]
    held = greedy[: min(64, len(greedy) // 10)]
    kept_out = {id(s) for s in held}
    train_set = [s for s in samples if id(s) not in kept_out]
    seconds = args.seconds
    if args.time_limit is not None:  # keep a minute for the held-out measurement and saving
        seconds = min(seconds, args.time_limit - (time.monotonic() - started) - 60)
    common = dict(
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        seconds=max(seconds, 1.0),
        max_steps=args.max_steps,
        seed=args.seed,
    )
    train = _introspective if args.kind == "introspective" else _eagle
    result = train(args, target_model, samples, train_set, held, common, eos, name)
    answered = sum(len(s.token_ids) - s.num_prompt for s in samples)
    result.update(
        samples=len(samples),
        answer_tokens=answered,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        seconds_total=round(time.monotonic() - started, 1),
    )
    if answered_in is not None:
        result["answer_seconds"] = answered_in
    (out / "training.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.kind == "introspective":
        result["arguments"] = _arguments(args)
        (out / "MODEL_CARD.md").write_text(_adapter_card(name, result))
    log.info("written to %s: %s", out, {k: v for k, v in result.items() if k != "history"})
    return 0


def _eagle(args, target_model, samples, train_set, held, common, eos, name) -> dict:
    """An EAGLE-3 head (`stride.train.eagle`); its draft vocabulary from the answers."""
    from stride.train import eagle

    out: Path = args.out
    if (out / "model.safetensors").exists():
        head = eagle.resume_head(out, target_model)
    else:
        vocab = target_model.config.vocab_size
        size = min(args.draft_vocab, vocab)
        head = eagle.new_head(
            target_model, eagle.choose_draft_vocab(samples, size, vocab, eos), args.layers
        )
    head = head.float()
    target = eagle.Target(target_model, head.config.aux_layers, head.draft_ids)
    config = eagle.TrainConfig(depth=args.depth, **common)
    result = eagle.train(head, target, train_set, config, out, held)
    answers = [t for s in samples for t in s.token_ids[s.num_prompt :]]
    in_vocab = set(head.draft_ids.tolist())
    result.update(
        draft_vocab_coverage=round(sum(t in in_vocab for t in answers) / max(len(answers), 1), 4),
        draft_vocab=head.config.draft_vocab_size,
    )
    return result


def _introspective(args, target_model, samples, train_set, held, common, eos, name) -> dict:
    """A MASK-slot adapter (`stride.train.introspective`), saved in bf16."""
    import random

    import torch

    from stride.engine.adapter import MaskAdapter
    from stride.train import introspective, loop

    out: Path = args.out
    target_model.requires_grad_(False).eval()
    if (out / "model.safetensors").exists():
        adapter = MaskAdapter.load(out, target_model).float()
        log.info("resuming the adapter in %s", out)
    else:
        adapter = MaskAdapter.new(target_model, args.rank, args.slots, base_model=name)
    adapter.attach(target_model).train()
    k = adapter.config.slots
    config = introspective.IntrospectiveConfig(
        anchors=args.anchors, extra_rows=args.anchors * k, **common
    )
    rng = random.Random(args.seed)

    def loss_fn(batch):
        return introspective.slot_losses(target_model, adapter, batch, k, config.anchors, rng)

    params = list(adapter.parameters())
    device = adapter.mask_embedding.device
    result = loop.fit(params, loss_fn, train_set, config, out / "trainer_state.pt", device)
    adapter.save(out)
    if held:
        adapter.eval()
        with loop.autocast(device), torch.no_grad():
            tpp = introspective.heldout_tokens_per_pass(target_model, adapter, held, k)
        result["heldout_tokens_per_pass"] = round(tpp, 3)
    result.update(rank=adapter.config.rank, slots=k, heldout_samples=len(held),
                  parameters=sum(p.numel() for p in params))  # fmt: skip
    return result


def _arguments(args: argparse.Namespace) -> list[str]:
    """The training options of `args` as command-line arguments (what reproduces the run),
    without the other kind's."""
    options = argparse.ArgumentParser()
    configure(options)
    eagle_only = {"draft_vocab", "layers", "depth"}
    other = eagle_only if args.kind == "introspective" else {"rank", "slots", "anchors"}
    out = []
    for action in options._actions:
        value = getattr(args, action.dest, None)
        if action.option_strings and value is not None and action.dest not in other | {"help"}:
            out += [action.option_strings[0], str(value)]
    return out


def _adapter_card(name: str, result: dict) -> str:
    """A MASK-slot adapter's model card: how it was made and what it makes, from this run."""
    command = " ".join(["python -m stride.train", *result["arguments"]])
    answers = (
        f"answered by Stride's engine in {result['answer_seconds']} s"
        if "answer_seconds" in result
        else "read back from an earlier run's data.pt"
    )
    return f"""# MASK-slot adapter for {name}

What `"decoder": {{"type": "refine", "method": "introspective"}}` uses with this model: a learned
MASK embedding and rank-{result["rank"]} adapters on the seven projections of every layer, gated
to MASK rows ({result["parameters"]:,} parameters, bf16), trained for k = {result["slots"]}
slots per set.

## How it was made

```bash
{command}
```

- Data: the model's own answers to {result["samples"]:,} prompts ({result["answer_tokens"]:,}
  answer tokens), {answers}.
- Training: base model frozen; the slots' cross-entropy against the base model's
  distributions of the next {result["slots"]} tokens; {result["steps"]:,} steps,
  {result["seconds"]} s of training, {result["seconds_total"]} s in all, on {result["device"]}.

## What it makes

Greedy tokens per verification pass on {result.get("heldout_samples", 0)} answers held out of
the training data (the trainer's estimate): {result.get("heldout_tokens_per_pass", "n/a")}.
"""


def teacher(engine):
    """The engine's target as a transformers model with the same weights (the frozen teacher
    whose hidden states the head learns from), whatever file the weights came from."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(engine.hf_config, dtype=engine.dtype)
    state = {k: v for k, v in engine.model.state_dict().items() if not k.startswith("rotary.")}
    missing, _ = model.load_state_dict(state, strict=False)
    if any("rotary" not in m and "inv_freq" not in m for m in missing):
        raise ValueError(f"the teacher lacks weights: {missing[:4]}")
    return model.eval()
