"""Training EAGLE heads (`stride draft train`): what is trained is what is served, and the
trainer runs end to end, resumes, and writes a head that decodes exactly."""

from __future__ import annotations

import argparse
import json

import torch

from stride import drafts
from stride.engine.config import EngineConfig
from stride.engine.eagle import load_head
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span
from stride.scheduler.outputs import GenerateRequest
from stride.train import eagle as trainer
from stride.train.cli import configure
from stride.train.cli import main as train_main
from tests.helpers.cores import PROMPTS, greedy, run
from tests.helpers.eagle import TREE, K, eagle_core
from tests.helpers.models import load_hf


def test_training_unrolls_the_head_exactly_as_serving_chains_it(
    eagle_target, eagle_head, eagle_ref
):
    """The trainer's unrolled forward (training-time test) predicts, from every position, the
    drafts the serving drafter makes there: what is trained is what is served."""
    core = eagle_core(eagle_target, eagle_head)
    drafter = core.decoders["speculative"].eagle
    engine = core.engine
    prompt = PROMPTS[2]
    full = prompt + eagle_ref[2]
    hf = load_hf(eagle_target)
    target = trainer.Target(hf, drafter.head.config.aux_layers, drafter.head.draft_ids)
    train_head = load_head(eagle_head, hf).float()
    ids = torch.tensor([full])
    valid = torch.ones_like(ids, dtype=torch.bool)
    aux, _, _ = target(ids, valid)
    with torch.no_grad():
        outs = trainer.unroll(train_head, ids, valid, aux, K)
        preds = [train_head.draft_ids[train_head.logits(g).argmax(-1)][0].tolist() for g in outs]
    for t in (len(prompt) - 1, len(prompt) + 3, len(full) - K - 3):
        # Serving: target features for positions < t + 1, the last token t + 1 as the tail.
        seq = Sequence(f"u{t}", full[: t + 2], SamplingParams(temperature=0.0))
        drafter.admit(seq)
        engine.cache.reserve(seq, t + 2 + K)
        engine.runner.forward([Span(seq, full[: t + 1], 1)])
        seq.num_cached = t + 1
        served = drafter.draft([seq], [K], set())[0].tokens
        assert served == [preds[j][t] for j in range(K)], t
        drafter.release(seq)
        engine.cache.free(seq)


def test_stride_draft_train_runs_end_to_end(eagle_target, tmp_path, eagle_ref):
    out = tmp_path / "trained"
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args([
        "--model", str(eagle_target), "--out", str(out), "--num-prompts", "24",
        "--self-prompts", "4", "--max-tokens", "12", "--draft-vocab", "100",
        "--max-steps", "6", "--batch-tokens", "512", "--depth", "3", "--device", "cpu",
    ])  # fmt: skip
    assert train_main(args) == 0
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 6 and report["samples"] > 0 and report["answer_tokens"] > 0
    assert set(report["chain_acceptance"]) == {"3", "4", "5", "6"}
    assert all(v >= 1.0 for v in report["chain_acceptance"].values())
    assert drafts.is_head(out)
    engine = Engine(EngineConfig(model=str(eagle_target), device="cpu", kv_cache_memory=8 << 20))
    assert load_head(out, engine.model).config.draft_vocab_size == 100
    core = eagle_core(eagle_target, out)
    tokens, _ = run(core, [GenerateRequest("s", PROMPTS[0], greedy(24), "speculative", TREE)])
    assert tokens["s"] == eagle_ref[0]
    # A second run resumes: the answers and the head are read back, training goes on.
    args.max_steps = 8
    assert train_main(args) == 0
    assert json.loads((out / "training.json").read_text())["steps"] == 8


