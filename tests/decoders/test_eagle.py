"""EAGLE draft heads: exact greedy equality, the exact sampling distribution, what the head
accepts, the published layouts (training: tests/train)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from stride import drafts
from stride.decoders.speculative import cycles as cycles_module
from stride.decoders.speculative import decoder as decoder_module
from stride.decoders.speculative import draws
from stride.decoders.speculative.bursts import Ahead
from stride.decoders.speculative.cycles import EagleCycles
from stride.decoders.speculative.device_tree import TreeShape
from stride.decoders.speculative.drafters import Draft
from stride.decoders.speculative.eagle import EagleDrafter
from stride.decoders.speculative.tree import Tree
from stride.decoders.speculative.verify import verify_greedy
from stride.engine.config import EngineConfig
from stride.engine.eagle import EagleConfig, load_head
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import PROMPTS, exact_joint, greedy, joint_pvalue, run
from tests.helpers.eagle import CHAIN, TREE, K, eagle_core, free, random_head, record_bursts
from tests.helpers.models import load_hf

# ---- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [CHAIN, TREE, dict(CHAIN, adaptive=True)],
                         ids=["chain", "tree", "adaptive"])  # fmt: skip
def test_greedy_equals_plain_decoding_alone(eagle_target, eagle_head, eagle_ref, options):
    core = eagle_core(eagle_target, eagle_head)
    for i, prompt in enumerate(PROMPTS):
        request = GenerateRequest("s", prompt, greedy(24), "speculative", options)
        tokens, _ = run(core, [request])
        assert tokens["s"] == eagle_ref[i]
    assert free(core)
    assert not core.decoders["speculative"].eagle.cursors


def test_greedy_mixed_batch_with_ar_other_drafters_and_prefill(eagle_target, eagle_head, eagle_ref):
    core = eagle_core(eagle_target, eagle_head, max_num_batched_tokens=48)
    kinds = [
        ("ar", {}),
        ("speculative", CHAIN),
        ("speculative", TREE),
        ("speculative", dict(draft="ngram", num_speculative_tokens=3, adaptive=False)),
        ("speculative", dict(CHAIN, num_speculative_tokens=2)),
    ]
    requests = [
        GenerateRequest(f"{i}-{j}", PROMPTS[i], greedy(24), dec, opts)
        for j, (dec, opts) in enumerate(kinds)
        for i in (0, 1, 3)
    ]
    late = [GenerateRequest("long", list(range(30, 90)), greedy(24), "speculative", TREE)]
    tokens, _ = run(core, requests, late)
    for r in requests:
        assert tokens[r.request_id] == eagle_ref[int(r.request_id.split("-")[0])], r
    assert tokens["long"] == eagle_ref[len(PROMPTS)]
    assert free(core)


def test_greedy_under_preemption(eagle_target, eagle_head, eagle_ref):
    """Preempted sequences start their features over; outputs do not change."""
    core = eagle_core(eagle_target, eagle_head, kv_bytes=7 * 16384)  # 6 usable blocks of 16 tokens
    requests = [
        GenerateRequest(str(i), p, greedy(24), "speculative", TREE if i % 2 else CHAIN)
        for i, p in enumerate(PROMPTS)
    ]
    tokens, _ = run(core, requests)
    assert core.preempted
    for i in range(len(PROMPTS)):
        assert tokens[str(i)] == eagle_ref[i]
    assert free(core)


def test_a_draft_vocabulary_maps_back_to_the_target(eagle_target, tmp_path, eagle_ref):
    head = random_head(eagle_target, tmp_path / "small", draft_vocab=100)
    assert json.loads((head / "config.json").read_text())["draft_vocab_size"] == 100
    core = eagle_core(eagle_target, head)
    drafter = core.decoders["speculative"].eagle
    assert drafter.head.head_weight().shape[0] == 100
    for i, prompt in enumerate(PROMPTS[:2]):
        tokens, _ = run(core, [GenerateRequest("s", prompt, greedy(24), "speculative", TREE)])
        assert tokens["s"] == eagle_ref[i]


class Oracle(EagleDrafter):
    """Drafts the target's own greedy continuation (kept in `truth`), through EAGLE's
    bookkeeping: what a perfect head would draft."""

    truth: dict[str, list[int]]

    def draft(self, seqs, ks, eos_ids):
        self._catch_up([s for s, k in zip(seqs, ks, strict=True) if k])
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            start = seq.num_cached + 1
            tokens = self.truth[seq.request_id][start : start + k]
            if k:
                self.cursors[seq.request_id].drafted = len(tokens)
            out.append(Draft(tokens))
        return out

    def draft_trees(self, seqs, depths, budgets, topk):
        chains = self.draft(seqs, depths, set())
        return [Tree.chain(d.tokens) for d in chains]


@pytest.mark.parametrize("options", [CHAIN, TREE], ids=["chain", "tree"])
def test_an_oracle_head_gives_k_plus_one_tokens_per_pass(
    eagle_target, eagle_head, eagle_ref, options
):
    core = eagle_core(eagle_target, eagle_head)
    spec = core.decoders["speculative"]
    oracle = Oracle.__new__(Oracle)
    oracle.__dict__.update(spec.eagle.__dict__)
    spec.eagle = oracle
    n = 1 + 4 * (K + 1)
    prompt = PROMPTS[1]
    oracle.truth = {"o": prompt + eagle_ref[1]}
    tokens, stats = run(core, [GenerateRequest("o", prompt, greedy(n), "speculative", options)])
    assert tokens["o"] == eagle_ref[1][:n]
    # The prefill makes one token (a head drafts from the target's features, which the prefill
    # makes); then every pass accepts all K drafts and adds one token of its own.
    s = stats["o"]
    assert s["drafts"] == 4 and s["accepted_per_position"] == [4] * K
    assert (s["accepted_tokens"] + s["drafts"]) / s["drafts"] == K + 1


def test_a_random_head_still_decodes_exactly(eagle_target, tmp_path, eagle_ref):
    head = random_head(eagle_target, tmp_path / "random", seed=7)
    core = eagle_core(eagle_target, head)
    tokens, stats = run(core, [GenerateRequest("r", PROMPTS[2], greedy(24), "speculative", CHAIN)])
    assert tokens["r"] == eagle_ref[2]
    assert stats["r"]["tokens_per_pass"] >= 1.0


# ---- sampling ---------------------------------------------------------------------------------


def _sampled_counts(eagle_target, eagle_head, tree_nodes: int) -> tuple[dict, dict, object]:
    """1,200 seeded requests of three tokens: the prefill samples the first, verifying the
    head's drafts the second."""
    prompt, n = PROMPTS[2], 1200
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=4, ignore_eos=True)
    options = dict(CHAIN, num_speculative_tokens=2, tree_nodes=tree_nodes)
    core = eagle_core(eagle_target, eagle_head, max_waiting=n)
    requests = [
        GenerateRequest(str(i), prompt, replace(params, seed=i), "speculative", options)
        for i in range(n)
    ]
    tokens, stats = run(core, requests)
    assert sum(s.get("draft_tokens", 0) for s in stats.values()) > 0
    hf = load_hf(eagle_target)
    return tokens, exact_joint(hf, prompt, params), hf


@pytest.mark.parametrize("tree_nodes", [0, 12], ids=["chain", "tree"])
def test_sampled_output_follows_the_target_distribution(eagle_target, eagle_head, tree_nodes):
    """Sampled requests draft chains from the head's distribution (the rejection rule) or trees
    of its most likely tokens (followed where they equal the target's draws: `verify_drawn`);
    either keeps the target's distribution (and a test of the same counts rejects a wrong
    distribution)."""
    tokens, joint, hf = _sampled_counts(eagle_target, eagle_head, tree_nodes)
    assert joint_pvalue(tokens, joint) > 1e-3
    wrong = exact_joint(hf, PROMPTS[2], SamplingParams(temperature=0.8, top_k=4))
    assert joint_pvalue(tokens, wrong) < 1e-3


def test_a_sampled_tree_followed_by_the_argmax_fails_the_distribution_test(
    eagle_target, eagle_head, monkeypatch
):
    """The test above can fail for a wrong rule: trees of sampled requests whose nodes are
    followed where they equal the target's argmax (the greedy rule)."""
    monkeypatch.setattr(
        decoder_module, "verify_drawn", lambda adjusted, rows, trees: verify_greedy(adjusted, trees)
    )
    tokens, joint, _ = _sampled_counts(eagle_target, eagle_head, 12)
    assert joint_pvalue(tokens, joint) < 1e-3


@pytest.mark.parametrize("truncation", [{"top_k": 20}, {"top_p": 0.9}], ids=["top_k", "top_p"])
def test_a_seeded_sampled_tree_makes_the_tokens_of_plain_decoding(
    eagle_target, eagle_head, truncation
):
    """Every token a sampled tree commits is the target's draw at its position, with the noise
    a plain step draws with there: a seed gives `ar`'s tokens (fp32)."""
    core = eagle_core(eagle_target, eagle_head)
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, **truncation)
    for i, prompt in enumerate(PROMPTS[:3]):
        seeded = replace(params, seed=11 + i)
        plain, _ = run(core, [GenerateRequest("a", prompt, seeded)])
        tokens, stats = run(core, [GenerateRequest("s", prompt, seeded, "speculative", TREE)])
        assert tokens["s"] == plain["a"]
        assert stats["s"]["draft_tokens"] > 0
    assert free(core)


# ---- published layouts -------------------------------------------------------------------------


def test_a_specforge_eagle3_checkpoint_loads_and_decodes_exactly(eagle_target, tmp_path, eagle_ref):
    """SpecForge's layout: midlayer.*, fc over three layers, its own draft-vocabulary lm_head,
    d2t/t2d, the target's embedding copied in (ignored: the target's is used)."""
    hf = load_hf(eagle_target)
    h, vocab, layers = hf.config.hidden_size, hf.config.vocab_size, hf.config.num_hidden_layers
    heads, kv, d, inter = 4, 2, h // 4, hf.config.intermediate_size
    draft_ids = torch.arange(0, vocab, 3)  # every third token
    g = torch.Generator().manual_seed(3)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    state = {
        "fc.weight": w(h, 3 * h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": torch.ones(h),
        "lm_head.weight": w(len(draft_ids), h),
        "d2t": draft_ids - torch.arange(len(draft_ids)),
        "t2d": torch.isin(torch.arange(vocab), draft_ids),
        "embed_tokens.weight": w(vocab, h),
    }
    path = tmp_path / "specforge"
    path.mkdir()
    save_file(state, path / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "draft_vocab_size": len(draft_ids),
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
    }
    (path / "config.json").write_text(json.dumps(config))
    assert drafts.is_head(path)
    engine = Engine(EngineConfig(model=str(eagle_target), device="cpu", kv_cache_memory=8 << 20))
    head = load_head(path, engine.model)
    assert head.config.aux_layers == EagleConfig.for_target(hf.config, 1).aux_layers
    assert torch.equal(head.draft_ids, draft_ids)
    assert torch.equal(head.fc.weight, state["fc.weight"])
    assert torch.equal(head.head_weight(), state["lm_head.weight"])
    q_proj = head.layers[0].self_attn.q_proj.weight
    assert torch.equal(q_proj, state["midlayer.self_attn.q_proj.weight"])
    core = eagle_core(eagle_target, path)
    for i, prompt in enumerate(PROMPTS[:2]):
        tokens, _ = run(core, [GenerateRequest("s", prompt, greedy(24), "speculative", TREE)])
        assert tokens["s"] == eagle_ref[i]
    assert layers == 4


def test_an_eagle1_checkpoint_loads_and_decodes_exactly(eagle_target, tmp_path, eagle_ref):
    """The EAGLE authors' EAGLE-1/2 layout: a Llama config of one layer, fc (with bias) over
    [embedding; final hidden state], layers.0 without an input norm, the target's head."""
    hf = load_hf(eagle_target)
    h, inter = hf.config.hidden_size, hf.config.intermediate_size
    heads, kv, d = 4, 2, h // 4
    g = torch.Generator().manual_seed(4)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    state = {
        "fc.weight": w(h, 2 * h),
        "fc.bias": w(h),
        "layers.0.self_attn.q_proj.weight": w(heads * d, h),
        "layers.0.self_attn.k_proj.weight": w(kv * d, h),
        "layers.0.self_attn.v_proj.weight": w(kv * d, h),
        "layers.0.self_attn.o_proj.weight": w(h, heads * d),
        "layers.0.mlp.gate_proj.weight": w(inter, h),
        "layers.0.mlp.up_proj.weight": w(inter, h),
        "layers.0.mlp.down_proj.weight": w(h, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    path = tmp_path / "eagle1"
    path.mkdir()
    save_file(state, path / "model.safetensors")
    config = dict(json.loads((eagle_target / "config.json").read_text()), num_hidden_layers=1,
                  architectures=["LlamaForCausalLM"])  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    assert drafts.is_head(path) and not drafts.is_head(eagle_target)
    engine = Engine(EngineConfig(model=str(eagle_target), device="cpu", kv_cache_memory=8 << 20))
    head = load_head(path, engine.model)
    assert head.config.aux_layers == (hf.config.num_hidden_layers,)  # the final normed state
    assert torch.equal(head.fc.bias, state["fc.bias"])
    # --draft-model names a head: the server uses it as one.
    engine_core = eagle_core(eagle_target, None)
    assert engine_core.decoders["speculative"].eagle is None
    assert drafts.pick(None, str(path), "x") == (str(path), None)
    core = eagle_core(eagle_target, path)
    for i, prompt in enumerate(PROMPTS[:2]):
        tokens, _ = run(core, [GenerateRequest("s", prompt, greedy(24), "speculative", CHAIN)])
        assert tokens["s"] == eagle_ref[i]


def test_the_shipped_head_is_the_default_models_default_draft():
    path = drafts.shipped_head("SmolLM2-135M-Instruct")
    assert path is not None and drafts.is_head(path)
    assert drafts.shipped_head("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == path
    assert drafts.shipped_head("Qwen2.5-0.5B") is None
    assert (path / "model.safetensors").stat().st_size <= 12 << 20
    assert drafts.pick(None, None, "SmolLM2-135M-Instruct") == (str(path), None)
    assert (path / "MODEL_CARD.md").is_file()


# ---- bursts: cycles on the device ---------------------------------------------------------------


@pytest.mark.parametrize("k", [1, K])
def test_device_cycles_decode_exactly_and_accept_what_chains_accept(
    eagle_target, eagle_head, eagle_ref, k
):
    """Greedy chains in bursts of cycles (draft, verify, accept, catch up with no host in
    between; eagerly here, CUDA graphs on a GPU): the same tokens as AR, and the same accepted
    drafts as one cycle per step."""
    options = dict(CHAIN, num_speculative_tokens=k)
    stepwise = eagle_core(eagle_target, eagle_head)
    bursts = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    requests = [GenerateRequest(str(i), p, greedy(24), "speculative", options)
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    ref_tokens, ref_stats = run(stepwise, [replace(r) for r in requests])
    ran = record_bursts(bursts)
    tokens, stats = run(bursts, requests)
    assert ran and max(n for *_, n in ran) > 1  # several cycles per host sync
    for i in range(len(PROMPTS)):
        assert tokens[str(i)] == eagle_ref[i]
        assert stats[str(i)]["accepted_tokens"] == ref_stats[str(i)]["accepted_tokens"]
    assert free(bursts)
    # (mixed with AR or waiting requests, a step runs as usual)
    late = [GenerateRequest("ar", PROMPTS[0], greedy(24))]
    tokens, _ = run(bursts, [replace(r, request_id=f"b{r.request_id}") for r in requests], late)
    assert tokens["ar"] == eagle_ref[0]
    assert all(tokens[f"b{i}"] == eagle_ref[i] for i in range(len(PROMPTS)))


def test_a_batch_keeps_its_loop_to_each_requests_last_tokens(eagle_target, eagle_head, eagle_ref):
    """Requests of a fixed K that end at different steps, each at some point fewer tokens from
    its end than a cycle makes: every step after the prefills still runs in the device loop
    (the cycles make tokens past a request's end, which its commit drops), never a step that
    drafts on the host, and each output is AR's, cut at its length, its drafting stats only
    its own cycles'."""
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    ran = record_bursts(core)
    eagle, on_host = core.decoders["speculative"].eagle, []
    draft = eagle.draft

    def counted(seqs, ks, eos_ids):
        on_host.append(ks)
        return draft(seqs, ks, eos_ids)

    eagle.draft = counted
    lengths = [13, 17, 24, 9]
    requests = [GenerateRequest(str(i), p, greedy(n), "speculative", CHAIN)
                for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))]  # fmt: skip
    tokens, stats = run(core, requests)
    assert ran and not on_host
    for i, n in enumerate(lengths):
        assert tokens[str(i)] == eagle_ref[i][:n]
        # its drafting stats count the cycles that made its tokens after the prefill's (each
        # makes one or more), not those its batch ran after its end
        made = stats[str(i)]["accepted_tokens"] + stats[str(i)]["drafts"]
        assert stats[str(i)]["drafts"] <= n - 1 <= made < n + K
    assert free(core)


def test_a_prompt_the_prefix_cache_holds_but_its_last_token_drafts_after_its_first_pass(
    eagle_target, eagle_head
):
    """Found in the prefix cache but for its last token, a prompt has no features before its
    first pass: the head drafts from the second step on, and the output is AR's."""
    core = eagle_core(eagle_target, eagle_head)
    prompt = list(range(40, 72))  # two full blocks
    first, _ = run(core, [GenerateRequest("a", prompt, greedy(12), "speculative", CHAIN)])
    again = prompt + [first["a"][0]]  # the cached blocks, then one more token
    tokens, stats = run(core, [GenerateRequest("b", again, greedy(12), "speculative", CHAIN)])
    ref, _ = run(eagle_core(eagle_target, None), [GenerateRequest("r", again, greedy(12))])
    assert tokens["b"] == ref["r"]
    assert stats["b"]["drafts"] > 0


def _seeded_beside_greedy(sampled: SamplingParams, options: dict) -> list[GenerateRequest]:
    """Three requests sampled under `sampled`, seeded 0..2, then a greedy one: all `options`."""
    return [
        GenerateRequest(str(i), p, replace(sampled, seed=i), "speculative", options)
        for i, p in enumerate(PROMPTS[:3])
    ] + [GenerateRequest("g", PROMPTS[3], greedy(24), "speculative", options)]


def _alone_then_in_a_batch(eagle_target, eagle_head, requests: list[GenerateRequest]):
    """The device loop (run eagerly) over the first request alone, then all of them at once
    (ids prefixed "b"): (core, the bursts it ran, tokens alone, tokens together, stats)."""
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    ran = record_bursts(core)
    alone, _ = run(core, [replace(r) for r in requests[:1]])
    together, stats = run(core, [replace(r, request_id=f"b{r.request_id}") for r in requests])
    return core, ran, alone, together, stats


TRUNCATIONS = {  # each of `draws.ranks`' three ways to draw
    "top_p": {"top_p": 0.95, "top_k": 20, "min_p": 0.02},
    "top_k": {"top_k": 20, "min_p": 0.02},
    "none": {"min_p": 0.02},
}


@pytest.mark.parametrize("truncation", TRUNCATIONS.values(), ids=TRUNCATIONS)
def test_sampled_chains_in_the_loop_draw_what_the_host_draws_seed_for_seed(
    eagle_target, eagle_head, eagle_ref, truncation
):
    """Sampled rows run the device loop's sampled chain (drafts drawn from the head, accepted by
    the rejection rule, every uniform keyed by the request's seed and the token's position, as
    on the host; the tokens ranked only as far as the rows' truncation needs): the tokens of
    each seeded request equal the host path's, alone and in a batch with greedy rows, whose
    tokens stay AR's."""
    sampled = SamplingParams(max_tokens=24, temperature=0.9, ignore_eos=True, **truncation)
    requests = _seeded_beside_greedy(sampled, CHAIN)
    stepwise = eagle_core(eagle_target, eagle_head)
    ref, _ = run(stepwise, [replace(r) for r in requests[:3]])
    core, ran, alone, together, stats = _alone_then_in_a_batch(eagle_target, eagle_head, requests)
    assert {shape for _, shape, _ in ran} == {TreeShape.chain(K, True, draws.ranks([sampled]))}
    assert alone["0"] == ref["0"]
    assert all(together[f"b{i}"] == ref[str(i)] for i in range(3))
    assert together["bg"] == eagle_ref[3]
    assert sum(stats[f"b{i}"]["accepted_tokens"] for i in range(3)) > 0
    assert free(core)


@pytest.mark.parametrize("truncation", TRUNCATIONS.values(), ids=TRUNCATIONS)
def test_sampled_trees_in_the_loop_make_the_tokens_of_plain_decoding(
    eagle_target, eagle_head, eagle_ref, truncation
):
    """Sampled rows of a tree run the device loop's sampled tree (its nodes followed where they
    equal the target's draws, each keyed by the request's seed and the token's position): the
    tokens of each seeded request equal `ar`'s, alone and in a batch with a greedy row, whose
    tokens stay AR's."""
    sampled = SamplingParams(max_tokens=24, temperature=0.9, ignore_eos=True, **truncation)
    requests = _seeded_beside_greedy(sampled, TREE)
    plain, _ = run(eagle_core(eagle_target, None), [replace(r, decoder="ar", decoder_options={})
                                                    for r in requests[:3]])  # fmt: skip
    core, ran, alone, together, stats = _alone_then_in_a_batch(eagle_target, eagle_head, requests)
    shape = TreeShape.of(TREE["tree_nodes"], K, TREE["tree_topk"], True, draws.ranks([sampled]))
    assert {s for _, s, _ in ran} == {shape}
    assert alone["0"] == plain["0"]
    assert all(together[f"b{i}"] == plain[str(i)] for i in range(3))
    assert together["bg"] == eagle_ref[3]
    assert sum(stats[f"b{i}"]["accepted_tokens"] for i in range(3)) > 0
    assert free(core)


def test_cycles_run_eagerly_keep_no_autograd_history(eagle_target, eagle_head):
    """Off the GPU the loop's cycles run eagerly: they record no autograd graph (the head's
    parameters require grad, as a trainer's do), or the loop's buffers would keep every cycle's
    tensors alive, memory growing with each burst."""
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    ran = record_bursts(core)
    run(core, [GenerateRequest("a", PROMPTS[0], greedy(16), "speculative", CHAIN)])
    cycles = core.decoders["speculative"].eagle.cycles
    assert ran
    state = (cycles.g, cycles.tokens, cycles.heads.k, core.engine.runner.cache.k)
    assert all(t.grad_fn is None for t in state)


def test_bursts_launched_at_the_commit_before_decode_exactly(
    eagle_target, eagle_head, eagle_ref, monkeypatch
):
    """A burst's commit launches the batch's next burst from the device state (on a GPU, so
    that the host's work runs meanwhile; forced on here), for the sequences that do not end
    there: the next step runs it (a request that arrives meanwhile waits for it), or drops it
    where it would run another (an abort), and the tokens are what they are without it, greedy
    and seeded sampled, under preemption too, the KV blocks all given back."""
    adopted: list[bool] = []
    after_an_end: list[bool] = []  # adopted, with the row of a sequence that ended
    continues = Ahead.continues

    def noted(self, *args):
        adopted.append(continues(self, *args))
        after_an_end.append(adopted[-1] and None in self.rows)
        return adopted[-1]

    monkeypatch.setattr(Ahead, "continues", noted)

    def core(ahead: bool = True, **kw):
        made = eagle_core(eagle_target, eagle_head, fused_decode_steps=4, **kw)
        made.decoders["speculative"].eagle.cycles.ahead = ahead
        return made

    lengths = [13, 17, 24, 9]  # (ending at different steps: bursts after an end are dropped)
    requests = [GenerateRequest(str(i), p, greedy(n), "speculative", CHAIN)
                for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))]  # fmt: skip
    late = [GenerateRequest("late", PROMPTS[1], greedy(20), "speculative", CHAIN)]
    ahead = core()
    tokens, _ = run(ahead, requests, late)
    assert adopted and all(adopted)  # (the late request waits for the burst in flight)
    assert any(after_an_end)  # (the others go on where one ended)
    assert all(tokens[str(i)] == eagle_ref[i][:n] for i, n in enumerate(lengths))
    assert tokens["late"] == eagle_ref[1][:20]
    assert free(ahead)

    # the longest context ends first: its row, left behind on block 0, stays within the tables
    lengths = [4, 60, 60, 60]
    prompts = [list(range(30, 150))] + PROMPTS[:3]
    long = [GenerateRequest(str(i), p, greedy(n), "speculative", CHAIN)
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]  # fmt: skip
    tokens, _ = run(core(), long)
    assert tokens == run(core(ahead=False), [replace(r) for r in long])[0]

    cramped = core(kv_bytes=7 * 16384)  # 6 usable blocks of 16 tokens: preemptions
    tokens, _ = run(cramped, [replace(r, params=greedy(24)) for r in requests])
    assert cramped.preempted
    assert all(tokens[str(i)] == eagle_ref[i] for i in range(len(PROMPTS)))
    assert free(cramped)

    adopted.clear()  # an abort while a burst is launched ahead: it is dropped, not adopted
    aborting = core()
    for r in requests:
        aborting.add(replace(r, params=greedy(24)))
    made: dict[str, list[int]] = {}
    while aborting.has_work:
        if adopted and "0" in aborting.seqs:
            aborting.abort("0")
        for out in aborting.step():
            made.setdefault(out.request_id, []).extend(out.token_ids)
    assert False in adopted
    assert all(made[str(i)] == eagle_ref[i] for i in range(1, len(PROMPTS)))
    assert free(aborting)

    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    requests = [GenerateRequest(str(i), p, replace(sampled, seed=i), "speculative", CHAIN)
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    adopted.clear()
    tokens, _ = run(core(), requests)
    assert any(adopted)
    assert tokens == run(core(ahead=False), [replace(r) for r in requests])[0]


@pytest.mark.parametrize("rule", ["exact", "accept what the target allows"])
def test_sampled_chains_in_the_loop_follow_the_target_distribution(
    eagle_target, eagle_head, monkeypatch, rule
):
    """The loop's rejection rule keeps the target's joint distribution of two tokens (χ²); the
    same test rejects the loop's output under a wrong rule (every draft the target allows is
    accepted). So that drafts are often accepted (a random head's rarely are), the head's
    distribution is replaced by a guess at the target's likely second tokens."""
    prompt, n = PROMPTS[2], 1200
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=4, ignore_eos=True)
    joint = exact_joint(load_hf(eagle_target), prompt, params)
    likely = joint.sum(0).argsort(descending=True)[:6]
    guess = torch.full((joint.shape[1],), -30.0)
    guess[likely] = torch.linspace(2.0, 0.0, len(likely))
    guessed = lambda self, h: guess[self.draft_ids].expand(len(h), -1)  # noqa: E731
    monkeypatch.setattr(EagleCycles, "_logits", guessed)
    if rule != "exact":
        exact = cycles_module.verify
        wrong = lambda p, q, d, k, u: exact(p, q, d, k, torch.zeros_like(u))  # noqa: E731
        monkeypatch.setattr(cycles_module, "verify", wrong)
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=2)
    ran, tokens, accepted = record_bursts(core), {}, 0
    options = dict(CHAIN, num_speculative_tokens=2)
    for first in range(0, n, 8):  # (batches of 8, the loop's largest, nobody waiting: bursts)
        batch = [GenerateRequest(str(i), prompt, replace(params, seed=i), "speculative", options)
                 for i in range(first, first + 8)]  # fmt: skip
        out, stats = run(core, batch)
        tokens |= out
        accepted += sum(s["accepted_tokens"] for s in stats.values())
    assert sum(b == 8 for b, *_ in ran) >= n // 8  # (every request's second token from a cycle)
    assert accepted > n // 4
    pvalue = joint_pvalue(tokens, joint)
    assert pvalue > 1e-3 if rule == "exact" else pvalue < 1e-3
