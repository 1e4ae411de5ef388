"""Speculative decoding against plain greedy AR on the default model (real weights).

For each concurrency (requests in flight at once) and each drafter (ngram, early_exit, a draft
model), with the adaptive policy on and off, every request generates the same greedy
continuation; the script reports output tok/s, the speed-up over AR measured in the same process,
acceptance (accepted / drafted), tokens committed per target pass, and whether the outputs equal
AR's token for token (exact in fp32; bf16 may differ by rounding). AR runs before and after the
others; the speed-up divides by the mean of the two (on a shared CPU the speed drifts).

The draft model is a layer-truncated copy of the target (its first `--draft-layers` layers, norm
and head, saved next to the cached model): the only small model with the same tokenizer that is
at hand offline. Unlike early exit it has its own KV cache and its own forward.

    python bench/bench_speculative.py                              # CPU, fp32, small
    python bench/bench_speculative.py --device cuda --tokens 128 --out bench/RESULTS-speculative.md
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.decoders.registry import DecodersConfig, build_decoders  # noqa: E402
from stride.engine import gguf_file, loader  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402

CODE = """def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result
"""
TEXT = (
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million square "
    "kilometres are covered by the rainforest. The majority of the forest is contained within "
    "Brazil, with 60% of the rainforest, followed by Peru with 13%, and Colombia with 10%."
)
PROMPTS = [  # half grounded in the prompt (where prompt lookup shines), half free text
    f"Rename the variable `chunk` to `window_values` in this code and show the full code:\n{CODE}",
    f"Repeat the following paragraph, then give it a title:\n{TEXT}",
    f"Add type hints and a docstring to this Python function:\n{CODE}",
    f"Which countries are mentioned in this text? Quote the sentence.\n{TEXT}",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for writing readable code.",
    "Tell me a short story about a lighthouse keeper.",
]


def truncated_copy(src: Path, layers: int) -> Path:
    """The target's first `layers` layers, final norm and head, as a model directory."""
    out = src.parent / f"{src.name}-first{layers}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(exist_ok=True)
    weights = {gguf_file.GGUF_LINK, gguf_file.INDEX}
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in weights and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {}
    for name, t in loader.load_weights(src, torch.device("cpu"), torch.float32).items():
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
            state[name] = t.contiguous()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def run(core: EngineCore, prompts, tokens: int, decoder: str, options: dict):
    """All requests at once; returns wall seconds, outputs and the summed decoder stats."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add(GenerateRequest(str(i), p, params, decoder, dict(options)))
    outs: dict[str, list[int]] = {}
    stats = {"draft_tokens": 0, "accepted_tokens": 0, "forward_passes": 0, "committed": 0}
    if core.engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    while core.has_work:
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                s = o.decoder_stats
                stats["draft_tokens"] += s.get("draft_tokens", 0)
                stats["accepted_tokens"] += s.get("accepted_tokens", 0)
                stats["forward_passes"] += s["forward_passes"]
                stats["committed"] += len(outs[o.request_id])
    if core.engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, outs, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (K max)")
    ap.add_argument("--exit-layer", type=int, default=None, help="early exit layers (default N/2)")
    ap.add_argument("--draft-layers", type=int, default=None, help="draft model layers (def N/5)")
    ap.add_argument("--drafters", nargs="+", default=["ngram", "early_exit", "draft"])
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=None, help="append a markdown section here")
    args = ap.parse_args()

    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_memory=int(args.kv_gib * (1 << 30)),
            enable_prefix_caching=False,  # each configuration pays for its own prefills
        )
    )
    layers = engine.model.num_layers
    exit_layer = args.exit_layer or layers // 2
    draft_dir = truncated_copy(loader.resolve(args.model), args.draft_layers or max(1, layers // 5))
    decoders = build_decoders(engine, DecodersConfig(draft_model=str(draft_dir)))
    core = EngineCore(engine, decoders=decoders)
    tok = engine.tokenizer
    encoded = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    encoded = [e["input_ids"] if isinstance(e, dict) or hasattr(e, "keys") else e for e in encoded]

    drafters = {
        "ngram": {"draft": "ngram"},
        "early_exit": {"draft": "early_exit", "exit_layer": exit_layer},
        "draft": {"draft": str(draft_dir)},
    }
    configs = [("ar", "ar", {})]
    for name in args.drafters:
        for adaptive in (True, False):
            opts = dict(drafters[name], num_speculative_tokens=args.k, adaptive=adaptive)
            label = f"{name} {'adaptive' if adaptive else f'K={args.k}'}"
            configs.append((label, "speculative", opts))

    card = (
        torch.cuda.get_device_name(engine.device)
        if engine.device.type == "cuda"
        else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    )
    draft_layers = args.draft_layers or max(1, layers // 5)
    header = (
        f"### {engine.name} on {card}, {engine.dtype}, greedy, {args.tokens} new tokens, "
        f"K={args.k}, early exit at layer {exit_layer}/{layers}, draft model = first "
        f"{draft_layers}/{layers} layers\n\n"
        f"`python bench/bench_speculative.py {' '.join(sys.argv[1:])}`\n\n"
        "| concurrency | decoder | tok/s | vs AR | acceptance | tokens/pass | = AR |\n"
        "|---:|---|---:|---:|---:|---:|---|\n"
    )
    print(header, end="", flush=True)
    lines = []
    for conc in args.concurrency:
        prompts = [encoded[i % len(encoded)] for i in range(conc)]
        # AR runs first and last; "vs AR" divides by their mean (a shared CPU drifts).
        rows, ref = [], None
        for label, decoder, opts in [*configs, ("ar (again)", "ar", {})]:
            run(core, prompts[: min(conc, 4)], 8, decoder, opts)  # warm-up (graphs, caches)
            secs, outs, st = run(core, prompts, args.tokens, decoder, opts)
            ref = ref or outs
            same = sum(outs[k] == ref[k] for k in ref)
            rows.append((label, st["committed"] / secs, st, same))
        ar = [rate for label, rate, _, _ in rows if label.startswith("ar")]
        base = sum(ar) / len(ar)
        for label, rate, st, same in rows:
            acc = st["accepted_tokens"] / st["draft_tokens"] if st["draft_tokens"] else 0.0
            line = (
                f"| {conc} | {label} | {rate:.1f} | {rate / base:.2f}x | "
                f"{acc:.2f} ({st['draft_tokens']} drafted) | "
                f"{st['committed'] / max(st['forward_passes'], 1):.2f} | {same}/{len(ref)} |\n"
            )
            lines.append(line)
            print(line, end="", flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + header + "".join(lines))


if __name__ == "__main__":
    main()
