"""The decode step's own kernels on one GPU, each timed inside a CUDA graph as the engine runs them.

For the real shapes of the default model (SmolLM2-135M) and an 8B Llama:
  - the one-row GEMV of `stride.engine.kernels.layer` (RMSNorm / SiLU*up / residual add folded
    in) with the tile shape the engine picks, against a sweep of tile shapes and against cuBLAS
    plus the separate norm and SiLU kernels it replaces; bandwidth = weight bytes / time;
  - paged decode attention with the engine's launch shape against a sweep of (splits, tokens per
    tile, warps), at batch 1 / 16 / 64 and contexts 256 / 1024 / 4096, for the 8B's heads whole
    and as a rank's share at TP=2 and 4 too;
  - the same kernel over the verify rows of EAGLE draft trees (64 or 128 rows per sequence
    after its context, each under its tree mask) at batch 1 and 8, with the same rows as plain
    causal rows beside (what the mask itself costs) and through the tree kernel (each tree's
    rows together, `DecodeMetadata.tree_rows`); `--trees-only` runs just these;
  - with `--rows`, the default model's fused GEMVs at a few rows (a chain's verification, a
    MASK-slot pass), plain and with some rows on other weights, against cuBLAS.
Each number is the mean of 20 back-to-back launches captured in one graph, replayed 10 times;
GEMVs cycle through copies of their weights 4x the L2 size, so that each reads HBM.

    python bench/bench_kernels.py [--json kernels.json] [--trees-only | --gemvs-only]
    python bench/bench_kernels.py --attention-only  # the decode attention sweeps alone
    python bench/bench_kernels.py --rows 1,6,16  # the default model's GEMVs at a few rows
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.engine.kernels import decode_attention as attention  # noqa: E402
from stride.engine.kernels import layer  # noqa: E402
from stride.engine.model import RMSNorm  # noqa: E402

DEV = torch.device("cuda")
# (name, N, K, silu): the four products of a layer, per model
GEMVS = {
    "smollm2-135m": [("qkv", 960, 576, False), ("o", 576, 576, False),
                     ("gate_up", 1536, 576, True), ("down", 576, 1536, False)],
    "llama-8b": [("qkv", 6144, 4096, False), ("o", 4096, 4096, False),
                 ("gate_up", 14336, 4096, True), ("down", 4096, 14336, False)],
    # a rank's share under tensor parallelism (`stride.engine.parallel`)
    "llama-8b-tp2": [("qkv", 3072, 4096, False), ("o", 4096, 2048, False),
                     ("gate_up", 7168, 4096, True), ("down", 4096, 7168, False)],
    "llama-8b-tp4": [("qkv", 1536, 4096, False), ("o", 4096, 1024, False),
                     ("gate_up", 3584, 4096, True), ("down", 4096, 3584, False)],
}  # fmt: skip
HEADS = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128),
         "llama-8b-tp2": (16, 4, 128), "llama-8b-tp4": (8, 2, 128)}  # fmt: skip
TILES = [(2, 1024, 4, 3), (4, 256, 4, 4), (4, 512, 4, 3), (4, 1024, 8, 2), (8, 128, 4, 4),
         (8, 256, 4, 3), (8, 512, 8, 3), (16, 128, 4, 3), (16, 256, 4, 3),
         (32, 128, 4, 3)]  # fmt: skip
L2_BYTES = 50 << 20  # H100 and H200


def graph_us(fn, reps: int = 20) -> float:
    """Mean µs of one call among `reps` back-to-back calls captured in a CUDA graph.

    `fn(i)` is call i: a benchmark cycles it through copies of its operands larger than L2
    together, so that every call reads from HBM as a decode step does.
    """
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / 10 / reps


def gemv_case(
    name: str, n: int, k: int, silu: bool, rows: int = 1
) -> tuple[torch.Tensor, list[torch.Tensor], dict, Callable[[int], torch.Tensor]]:
    """x [rows, K], copies of the product's weights 4x the L2 size, the engine's arguments for
    the product (norm and SiLU before and after it, or the residual add) and the same work as
    cuBLAS with the separate kernels: (x, weights, kwargs, cublas)."""
    torch.manual_seed(0)
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    shape = (n * (2 if silu else 1), k)
    copies = -(-L2_BYTES * 4 // (shape[0] * k * 2))
    ws = [torch.randn(shape, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    norm = RMSNorm(k, 1e-5).to(DEV, torch.bfloat16)
    residual = torch.zeros(rows, n, device=DEV, dtype=torch.bfloat16)
    if name in ("qkv", "gate_up"):  # o and down add into the residual instead
        kwargs = dict(norm=norm, silu_mul=silu)

        def cublas(i):
            y = F.linear(layer.rms_norm(x, norm, None), ws[i % copies])
            return layer.silu_and_mul(y) if silu else y
    else:
        kwargs = dict(add_to=residual)

        def cublas(i):
            return residual.add_(F.linear(x, ws[i % copies]))

    return x, ws, kwargs, cublas


def bench_gemv(name: str, n: int, k: int, silu: bool) -> dict:
    x, ws, kwargs, cublas = gemv_case(name, n, k, silu)
    copies = len(ws)
    gigabytes = ws[0].numel() * ws[0].element_size() / 1e9
    result = {"shipped_us": graph_us(lambda i: layer.gemv(x, ws[i % copies], **kwargs))}
    result["cublas_and_separate_kernels_us"] = graph_us(cublas)
    sweep = {}
    for bn, bk, warps, stages in TILES:
        tile = dict(BN=bn, BK=bk, num_warps=warps, num_stages=stages)
        key = f"BN{bn}/BK{bk}/w{warps}/s{stages}"
        us = graph_us(lambda i, tile=tile: layer.gemv(x, ws[i % copies], **kwargs, tile=tile))
        sweep[key] = round(us, 2)
    best = min(sweep, key=sweep.get)
    result.update(best_tile=best, best_us=sweep[best], sweep_us=sweep)
    result["shipped_TB_s"] = gigabytes / result["shipped_us"] * 1e3
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}


def bench_gemv_rows(name: str, n: int, k: int, silu: bool, rows: int) -> dict:
    """One product at `rows` rows: the fused GEMV, plain and with an `Alt` for every other row
    (a MASK-slot pass), against cuBLAS with the separate kernels; what `fused.FEW_ROWS` and
    `fused.ADAPTED_FEW_ROWS` are set from."""
    x, ws, kwargs, cublas = gemv_case(name, n, k, silu, rows)
    copies = len(ws)
    picks = (torch.arange(rows, device=DEV) % 2).to(torch.int32)

    def alt(i: int) -> layer.Alt:
        return layer.Alt(ws[(i + 1) % copies], picks)

    result = {
        "shipped_us": graph_us(lambda i: layer.gemv(x, ws[i % copies], **kwargs)),
        "alt_us": graph_us(lambda i: layer.gemv(x, ws[i % copies], **kwargs, alt=alt(i))),
        "cublas_and_separate_kernels_us": graph_us(cublas),
    }
    return {k: round(v, 2) for k, v in result.items()}


def bench_attention(
    heads: int, kv_heads: int, dim: int, context: int, batch: int, tree: int = 0
) -> dict:
    """`tree` > 0: each sequence has that many verify rows after its `context` tokens, row r
    seeing the context and its ancestors in a random tree (parents first)."""
    torch.manual_seed(0)
    block = 16
    rows = max(tree, 1)
    per_seq = -(-(context + tree) // block)
    k_cache = torch.randn(batch * per_seq * block + block, kv_heads, dim, device=DEV,
                          dtype=torch.bfloat16)  # fmt: skip
    v_cache = torch.randn_like(k_cache)
    tables = (torch.arange(batch * per_seq, device=DEV, dtype=torch.int32) + 1).view(batch, -1)
    lens = torch.full((batch, rows), context, device=DEV, dtype=torch.int32)
    tree_start = tree_mask = None
    if tree:
        lens += torch.arange(1, tree + 1, device=DEV, dtype=torch.int32)
        parents = [0] + [int(torch.randint(0, r, (1,))) for r in range(1, tree)]
        sees = torch.eye(tree, dtype=torch.bool)
        for r in range(1, tree):
            sees[r] |= sees[parents[r]]
        tree_start = torch.full((batch * tree,), context, device=DEV)
        tree_mask = sees.repeat(batch, 1).to(DEV)
    meta = attention.DecodeMetadata(
        slot_mapping=torch.zeros(batch * rows, dtype=torch.long, device=DEV),
        block_tables=tables.repeat_interleave(rows, 0),
        context_lens=lens.flatten(),
        block_size=block,
        tree_start=tree_start,
        tree_mask=tree_mask,
    )
    q = torch.randn(batch * rows, heads, dim, device=DEV, dtype=torch.bfloat16)
    result = {
        "shipped_us": graph_us(lambda i: attention.decode_attention(q, k_cache, v_cache, meta))
    }
    if tree:
        causal = attention.DecodeMetadata(meta.slot_mapping, meta.block_tables,
                                          meta.context_lens, block)  # fmt: skip
        result["same_rows_no_mask_us"] = graph_us(
            lambda i: attention.decode_attention(q, k_cache, v_cache, causal)
        )
        whole = replace(meta, tree_rows=tree)
        result["tree_kernel_us"] = graph_us(
            lambda i: attention.decode_attention(q, k_cache, v_cache, whole)
        )
    sweep = {}
    for splits, tile, warps in itertools.product((1, 4, 16, 32, 64), (16, 32, 64), (2, 4, 8)):
        launch = (splits, tile, warps)
        us = graph_us(lambda i, x=launch: attention.decode_attention(q, k_cache, v_cache, meta, x))
        sweep[f"splits{splits}/tile{tile}/w{warps}"] = round(us, 2)
    best = min(sweep, key=sweep.get)
    # The launch shape before this benchmark existed: up to 16 splits, 64/32-token tiles, 8 warps.
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    splits = max(1, min(16, 2 * sms // (batch * rows * kv_heads)))
    old = (splits, 64 if dim <= 64 else 32, 8)
    result.update(best_launch=best, best_us=sweep[best], sweep_us=sweep,
                  previous_launch_us=graph_us(lambda i: attention.decode_attention(
                      q, k_cache, v_cache, meta, old)))  # fmt: skip
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--trees-only", action="store_true", help="just the draft-tree rows")
    parser.add_argument("--gemvs-only", action="store_true", help="just the GEMVs")
    parser.add_argument("--attention-only", action="store_true", help="just decode attention")
    parser.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")],
                        help="just the default model's GEMVs at these row counts (e.g. 1,6,16)")
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name()}
    if args.rows:
        for rows in args.rows:
            for name, n, k, silu in GEMVS["smollm2-135m"]:
                r = bench_gemv_rows(name, n, k, silu, rows)
                results[f"smollm2-135m/gemv/{name}/rows{rows}"] = r
                print(f"smollm2-135m gemv {name} [{n}x{k}] x {rows} rows: {r}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    heads, kv_heads, dim = HEADS["smollm2-135m"]
    trees = itertools.product((64, 128), (1, 8), (256, 1024, 4096))
    for tree, batch, context in [] if args.gemvs_only or args.attention_only else trees:
        r = bench_attention(heads, kv_heads, dim, context, batch, tree)
        results[f"smollm2-135m/attention/tree{tree}_batch{batch}_context{context}"] = r
        print(f"smollm2-135m attention, trees of {tree} rows, batch {batch}, context {context}: "
              f"shipped {r['shipped_us']} us (no mask {r['same_rows_no_mask_us']}), best "
              f"{r['best_us']} ({r['best_launch']}), tree kernel {r['tree_kernel_us']} us",
              flush=True)  # fmt: skip
    for model, products in GEMVS.items():
        if args.trees_only or args.attention_only:
            break
        for name, n, k, silu in products:
            r = bench_gemv(name, n, k, silu)
            results[f"{model}/gemv/{name}"] = r
            separate = r["cublas_and_separate_kernels_us"]
            print(f"{model} gemv {name} [{n}x{k}]: shipped {r['shipped_us']} us "
                  f"({r['shipped_TB_s']} TB/s), best {r['best_us']} ({r['best_tile']}), cuBLAS "
                  f"+ separate kernels {separate}", flush=True)  # fmt: skip
    for model, (heads, kv_heads, dim) in HEADS.items():
        if args.trees_only or args.gemvs_only:
            break
        for batch, context in ((1, 256), (1, 1024), (1, 4096), (16, 256), (64, 256), (64, 1024)):
            r = bench_attention(heads, kv_heads, dim, context, batch)
            results[f"{model}/attention/batch{batch}_context{context}"] = r
            print(f"{model} attention batch {batch} context {context}: shipped {r['shipped_us']} "
                  f"us, best {r['best_us']} ({r['best_launch']}), previous launch "
                  f"{r['previous_launch_us']}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
