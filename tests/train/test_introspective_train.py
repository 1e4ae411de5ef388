"""Training MASK-slot adapters (`python -m stride.train --kind introspective`): what is trained
is what is served, the loss goes down, and the trainer runs end to end, resumes, and writes an
adapter that decodes exactly."""

from __future__ import annotations

import argparse
import json
import random

import torch

from stride.engine.adapter import MASK_TOKEN, MaskAdapter
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span
from stride.scheduler.outputs import GenerateRequest
from stride.train import introspective as trainer
from stride.train import loop
from stride.train.cli import configure
from stride.train.cli import main as train_main
from stride.train.data import Sample
from tests.helpers.adapters import introspective_core, random_adapter
from tests.helpers.cores import PROMPTS, greedy, run
from tests.helpers.models import load_hf

K = 3


def test_training_sees_each_anchor_as_serving_does(tiny_dir):
    """The trainer's layout (every anchor's slots in one forward, a 4D mask) gives at anchor t
    the slot logits the engine computes for [tokens up to t, k MASK slots]."""
    core = introspective_core(tiny_dir)
    engine = core.engine
    adapter = engine.runner.adapter
    full = PROMPTS[2] + [3, 9, 27, 81, 4, 16]
    sample = Sample(full, len(PROMPTS[2]))
    hf = load_hf(tiny_dir)
    adapter.attach(hf)
    origins = trainer.answer_anchors(sample)
    lay = trainer.layout([sample], [origins], K, torch.device("cpu"))
    with torch.no_grad():
        trained = hf.lm_head(trainer.forward(hf, adapter, lay)[0, lay.real :])
    for i, t in enumerate(origins):
        seq = Sequence(f"u{t}", full[: t + 1], SamplingParams())
        tokens = full[: t + 1] + [MASK_TOKEN] * K
        engine.cache.reserve(seq, len(tokens))
        served = engine.runner.forward([Span(seq, tokens, K)])[0]
        engine.cache.free(seq)
        torch.testing.assert_close(trained[i * K : (i + 1) * K], served, atol=1e-4, rtol=1e-4)


def test_the_slot_loss_goes_down(tiny_dir, tiny_hf):
    """A few optimizer steps on the base model's own greedy answers lower the slots' loss."""
    hf = load_hf(tiny_dir).requires_grad_(False)
    core = introspective_core(tiny_dir)
    tokens, _ = run(core, [GenerateRequest(str(i), p, greedy(20)) for i, p in enumerate(PROMPTS)])
    samples = [Sample(p + tokens[str(i)], len(p)) for i, p in enumerate(PROMPTS)]
    adapter = MaskAdapter.new(hf, 4, K).attach(hf)

    def loss() -> float:
        return trainer.slot_losses(hf, adapter, samples, K, 64, random.Random(0))[0].item()

    before = loss()
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    for _ in range(20):
        value, _ = trainer.slot_losses(hf, adapter, samples, K, 8, random.Random(1))
        opt.zero_grad()
        value.backward()
        opt.step()
    assert loss() < 0.8 * before
    tpp = trainer.heldout_tokens_per_pass(hf, adapter, samples, K)
    assert 1.0 <= tpp <= K + 1


def test_heldout_walk_counts_passes_as_serving_does():
    """Perfect guesses commit k + 1 tokens a pass; none commit one."""
    sample = Sample(list(range(10, 30)), 4)  # 16 answer tokens, the first made by the prefill
    perfect = [[t + 2 + j + 10 for t in range(20)] for j in range(K)]
    assert loop.tokens_per_pass(sample, perfect, K) == (4, 15)  # 4 + 4 + 4 + 3
    wrong = [[0] * 20 for _ in range(K)]
    assert loop.tokens_per_pass(sample, wrong, K) == (15, 15)


def test_train_introspective_runs_end_to_end(tiny_dir, tmp_path):
    out = tmp_path / "adapter"
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args([
        "--kind", "introspective", "--model", str(tiny_dir), "--out", str(out),
        "--num-prompts", "24", "--max-tokens", "12", "--rank", "4", "--slots", str(K),
        "--anchors", "8", "--max-steps", "6", "--batch-tokens", "512", "--device", "cpu",
    ])  # fmt: skip
    assert train_main(args) == 0
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 6 and report["samples"] > 0 and report["answer_tokens"] > 0
    assert 1.0 <= report["heldout_tokens_per_pass"] <= K + 1
    card = (out / "MODEL_CARD.md").read_text()
    assert "--kind introspective" in card and str(report["heldout_tokens_per_pass"]) in card
    config = json.loads((out / "config.json").read_text())
    assert config["rank"] == 4 and config["slots"] == K
    core = introspective_core(tiny_dir, adapter=out)
    assert core.engine.runner.adapter.mask_embedding.dtype == torch.float32  # (saved as bf16)
    ar, _ = run(core, [GenerateRequest("a", PROMPTS[0], greedy(24))])
    options = {"method": "introspective"}
    got, _ = run(core, [GenerateRequest("i", PROMPTS[0], greedy(24), "refine", options)])
    assert got["i"] == ar["a"]
    # A second run resumes: the answers and the adapter are read back, training goes on.
    args.max_steps = 8
    assert train_main(args) == 0
    assert json.loads((out / "training.json").read_text())["steps"] == 8


def test_a_random_adapter_trains_from_its_saved_state(tiny_dir, tmp_path):
    """Resuming reads the adapter back in fp32 (from bf16 on disk) for the given model."""
    hf = load_hf(tiny_dir)
    adapter = random_adapter(hf)
    adapter.save(tmp_path)
    loaded = MaskAdapter.load(tmp_path, hf).float()
    torch.testing.assert_close(
        loaded.mask_embedding, adapter.mask_embedding.bfloat16().float(), atol=0, rtol=0
    )
