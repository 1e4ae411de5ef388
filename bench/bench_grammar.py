"""Grammar engines for structured outputs, compared on Stride's workload: xgrammar, llguidance,
outlines-core.

Run it once per engine, each installed in a scratch virtual environment of its own (with
`transformers` for the tokenizer; xgrammar also needs torch):

    python bench/bench_grammar.py --engine llguidance --json llguidance.json
    python bench/bench_grammar.py --engine xgrammar --json xgrammar.json
    python bench/bench_grammar.py --engine outlines-core --json outlines-core.json

What it measures, on the default model's tokenizer (SmolLM2, 49,152 tokens):
  - tokenizer set-up: what a server pays once at start;
  - compile: per schema of bench/grammar_schemas.py, cold (no cache), up to the first token
    mask (llguidance builds its lexer lazily, so its first mask is part of the price);
  - mask at batch 64: 64 matchers, each walking through the token ids of a valid instance of
    one of the ten SDK-shaped schemas (reset at its end); per step, the time to fill the 64
    rows of the token bitmask (the engine's batched call on `--threads` threads, and one row
    after another on the calling thread), then advance each matcher by its next token;
  - coverage: a schema is covered when it compiles, its valid instance passes token by token
    (each token allowed by the mask before it is consumed, EOS allowed at the end), and its
    invalid instance (well-formed JSON, wrong only by the keyword under test) is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grammar_schemas import SCHEMAS  # noqa: E402

SDK_SHAPED = 10  # the first schemas of SCHEMAS: what the batch-64 walk cycles through


def default_tokenizer_dir() -> str:
    """The default model's converted directory in Stride's cache (made by a first `stride
    serve`), newest first."""
    root = Path(os.environ.get("STRIDE_CACHE", Path.home() / ".cache" / "stride"))
    dirs = sorted(root.glob("SmolLM2-135M-Instruct*/tokenizer.json"), key=os.path.getmtime)
    if not dirs:
        sys.exit(f"no SmolLM2 tokenizer under {root}: run `stride serve` once, or --tokenizer")
    return str(dirs[-1].parent)


class Adapter:
    """One engine behind the calls this benchmark makes."""

    def __init__(self, hf_tokenizer, vocab: int, threads: int) -> None:
        self.vocab, self.threads = vocab, threads
        self.eos = hf_tokenizer.eos_token_id

    def compile(self, schema: dict) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill_one(self, m: Any, bitmask: np.ndarray, row: int) -> None: ...
    def fill_batch(self, ms: list, bitmask: np.ndarray) -> None: ...
    def accept(self, m: Any, token: int) -> bool: ...
    def reset(self, m: Any) -> None: ...


class Llguidance(Adapter):
    def __init__(self, hf_tokenizer, vocab: int, threads: int) -> None:
        super().__init__(hf_tokenizer, vocab, threads)
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll, self.np = llguidance, llguidance.numpy
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(threads)

    def compile(self, schema: dict) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.ll.LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill_one(self, m, bitmask, row) -> None:
        self.np.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms, bitmask) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)],
                                            bitmask)  # fmt: skip

    def accept(self, m, token) -> bool:
        return m.consume_token(token)

    def reset(self, m) -> None:
        m.reset()


class Xgrammar(Adapter):
    def __init__(self, hf_tokenizer, vocab: int, threads: int) -> None:
        super().__init__(hf_tokenizer, vocab, threads)
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill_one(self, m, bitmask, row) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m, token) -> bool:
        return m.accept_token(token)

    def reset(self, m) -> None:
        m.reset()


class OutlinesCore(Adapter):
    def __init__(self, hf_tokenizer, vocab: int, threads: int) -> None:
        super().__init__(hf_tokenizer, vocab, threads)
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(self.eos, _token_bytes(hf_tokenizer))

    def compile(self, schema: dict) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill_one(self, m, bitmask, row) -> None:
        view = bitmask[row]
        m.write_mask_into(view.ctypes.data, view.size, 4)

    def fill_batch(self, ms, bitmask) -> None:  # no batched call: one row after another
        for i, m in enumerate(ms):
            self.fill_one(m, bitmask, i)

    def accept(self, m, token) -> bool:
        try:
            m.advance(token)
        except ValueError:
            return False
        return True

    def reset(self, m) -> None:
        m.reset()


def _token_bytes(hf_tokenizer) -> dict[bytes, list[int]]:
    """Every non-special token as the bytes it stands for (byte-level BPE: the GPT-2 map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    decoder = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    special = set(hf_tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for text, token in hf_tokenizer.get_vocab().items():
        if token in special:
            continue
        out.setdefault(bytes(decoder[c] for c in text), []).append(token)
    return out


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def walk(engine: Adapter, m: Any, tokens: list[int], bitmask: np.ndarray) -> bool:
    """Does the matcher allow every token in turn, then EOS?"""
    for token in tokens:
        bitmask[0] = 0
        engine.fill_one(m, bitmask, 0)
        if not allowed(bitmask, 0, token) or not engine.accept(m, token):
            return False
    bitmask[0] = 0
    engine.fill_one(m, bitmask, 0)
    return allowed(bitmask, 0, engine.eos)


def encode(hf_tokenizer, instance: Any) -> list[int]:
    return hf_tokenizer.encode(json.dumps(instance, separators=(",", ":")),
                               add_special_tokens=False)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=list(ENGINES), required=True)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory")
    parser.add_argument("--vocab", type=int, default=49152, help="the model's logits width")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="mask steps timed at --batch")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())
    start = time.perf_counter()
    engine = ENGINES[args.engine](hf, args.vocab, args.threads)
    results: dict[str, Any] = {
        "engine": args.engine,
        "version": metadata.version(args.engine),
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "vocab": args.vocab,
        "tokenizer_setup_s": round(time.perf_counter() - start, 4),
    }
    bitmask = np.zeros((max(args.batch, 1), (args.vocab + 31) // 32), dtype=np.int32)

    compiled: dict[str, Any] = {}
    per_schema: dict[str, Any] = {}
    for case in SCHEMAS:
        name, row = case["name"], {}
        try:
            start = time.perf_counter()
            c = engine.compile(case["schema"])
            m = engine.matcher(c)
            bitmask[0] = 0
            engine.fill_one(m, bitmask, 0)
            row["compile_ms"] = round(1e3 * (time.perf_counter() - start), 3)
            compiled[name] = c
        except Exception as e:  # noqa: BLE001 (an engine's refusal is a result)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            per_schema[name] = row
            print(f"{name:30s} does not compile: {row['error']}", flush=True)
            continue
        row["valid_accepted"] = walk(engine, m, encode(hf, case["valid"]), bitmask)
        m = engine.matcher(c)
        row["invalid_refused"] = not walk(engine, m, encode(hf, case["invalid"]), bitmask)
        row["covered"] = row["valid_accepted"] and row["invalid_refused"]
        per_schema[name] = row
        print(f"{name:30s} {json.dumps(row)}", flush=True)
    results["schemas"] = per_schema
    compile_ms = [r["compile_ms"] for r in per_schema.values() if "compile_ms" in r]
    results["compile_ms_median"] = round(statistics.median(compile_ms), 3) if compile_ms else None
    results["compile_ms_max"] = max(compile_ms, default=None)
    results["covered"] = sum(bool(r.get("covered")) for r in per_schema.values())
    results["of"] = len(SCHEMAS)

    # ---- the mask at batch B -----------------------------------------------------------------
    walks = [c["name"] for c in SCHEMAS[:SDK_SHAPED] if c["name"] in compiled]
    if walks:
        cases = {c["name"]: c for c in SCHEMAS}
        tokens = {n: encode(hf, cases[n]["valid"]) for n in walks}
        for mode in ("batched", "sequential"):
            names = [walks[i % len(walks)] for i in range(args.batch)]
            ms = [engine.matcher(compiled[n]) for n in names]
            pos = [i % len(tokens[n]) for i, n in enumerate(names)]  # staggered starts
            for m, n, p in zip(ms, names, pos, strict=True):
                for t in tokens[n][:p]:
                    engine.accept(m, t)
            times = []
            for _ in range(args.steps):
                for i, (m, n) in enumerate(zip(ms, names, strict=True)):
                    if pos[i] == len(tokens[n]):  # at its end: start the instance again
                        engine.reset(m)
                        pos[i] = 0
                bitmask[:] = 0
                start = time.perf_counter()
                if mode == "batched":
                    engine.fill_batch(ms, bitmask)
                else:
                    for i, m in enumerate(ms):
                        engine.fill_one(m, bitmask, i)
                times.append(time.perf_counter() - start)
                for i, (m, n) in enumerate(zip(ms, names, strict=True)):
                    token = tokens[n][pos[i]]
                    assert allowed(bitmask, i, token), (n, pos[i])
                    engine.accept(m, token)
                    pos[i] += 1
            times.sort()
            results[f"mask_batch{args.batch}_{mode}_ms"] = {
                "mean": round(1e3 * statistics.fmean(times), 4),
                "p50": round(1e3 * times[len(times) // 2], 4),
                "p99": round(1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], 4),
            }
            print(f"mask at batch {args.batch}, {mode}: "
                  f"{results[f'mask_batch{args.batch}_{mode}_ms']}", flush=True)  # fmt: skip
    summary = {k: v for k, v in results.items() if k != "schemas"}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
