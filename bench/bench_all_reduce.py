"""Tensor parallelism's peer sum alone (`stride.engine.collectives.PeerSum`), against NCCL.

For 2 (and 4, where there are 4 GPUs) ranks, one process each, and rows of 4,096 and 8,192
columns (the 8B and 70B shapes' hidden size) in bf16:
  - checks first: every rank's residual after the peer sum (with and without the RMSNorm) equals
    the ranks' rows summed in fp32 plus the add to bf16 rounding, and holds the same bits on
    every rank;
  - then µs per call, 100 calls back to back captured in one CUDA graph: the peer sum against
    NCCL's all-reduce followed by the residual add it replaces, at 1, 4 and 8 rows.

    python bench/bench_all_reduce.py [--json all-reduce.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.engine.collectives import PeerSum  # noqa: E402
from stride.engine.model import RMSNorm  # noqa: E402

ROWS = (1, 4, 8)
DTYPE = torch.bfloat16


def check(peer: PeerSum, norm: RMSNorm, rows: int, cols: int, world: int) -> None:
    """The peer sum's residual (and norm) on every rank against every rank's rows summed in
    fp32 in rank order plus the add; a fresh product each round (an inbox read back stale would
    repeat the last), with negative zeros in it (the inbox's sentinel)."""
    dev = norm.weight.device
    start = torch.randn(
        rows, cols, device=dev, dtype=DTYPE, generator=torch.Generator(device=dev).manual_seed(7)
    )
    for turn, (with_norm, half) in enumerate([(False, 0), (False, 1), (True, 0), (True, 1)]):
        part = torch.randn(rows, cols, device=dev, dtype=DTYPE) * (turn + 1)
        part[:, ::7] = -0.0
        every = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(every, part)
        total = torch.zeros(rows, cols, device=dev)
        for theirs in every:
            total += theirs.float()
        want = total.to(DTYPE) + start
        peer.stage(rows, half).copy_(part)
        residual = start.clone()
        normed = peer.add(residual, half, norm if with_norm else None)
        torch.cuda.synchronize()
        torch.testing.assert_close(residual, want, rtol=2**-7, atol=1e-3)
        if with_norm:
            torch.testing.assert_close(normed, norm(residual), rtol=2**-6, atol=1e-2)
        sums = [torch.empty_like(residual) for _ in range(world)]
        dist.all_gather(sums, residual)
        assert all(torch.equal(sums[0], r) for r in sums), "ranks hold different sums"


def graph_us(calls, dev: torch.device) -> float:
    """µs per call of `calls(i)`, 100 back to back in one CUDA graph, replayed 10 times."""
    with torch.cuda.stream(torch.cuda.Stream(dev)):
        for i in range(3):
            calls(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(100):
            calls(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / 1000 * 1e6, 2)


def timed(peer: PeerSum, rows: int, cols: int, dev: torch.device) -> dict[str, float]:
    """µs per call of the peer sum and of NCCL's all-reduce plus the add, at `rows` rows."""
    residual = torch.zeros(rows, cols, device=dev, dtype=DTYPE)
    part = torch.zeros(rows, cols, device=dev, dtype=DTYPE)

    def nccl(i: int) -> None:
        dist.all_reduce(part)
        residual.add_(part)

    return {
        f"peer_rows{rows}_us": graph_us(lambda i: peer.add(residual, i % 2), dev),
        f"nccl_rows{rows}_us": graph_us(nccl, dev),
    }


def rank_main(rank: int, world: int, port: int, cols: int, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    dev = torch.device("cuda", rank)
    torch.manual_seed(1234 + rank)
    peer = PeerSum.setup(dev, DTYPE, cols)
    assert peer is not None, "these GPUs do not map each other's memory"
    norm = RMSNorm(cols, 1e-5).to(dev, DTYPE)
    norm.weight.data.normal_()
    report = {}
    for rows in filter(peer.fits, ROWS):
        check(peer, norm, rows, cols, world)
        report.update(timed(peer, rows, cols, dev))
    if rank == 0:
        print(f"world {world} cols {cols}: {report}", flush=True)
        results = json.loads(Path(out).read_text()) if Path(out).exists() else {}
        results[f"world{world}/cols{cols}"] = report
        Path(out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="all-reduce.json", help="write the results here")
    args = parser.parse_args()
    for world in (2, 4):
        if torch.cuda.device_count() < world:
            continue
        for cols in (4096, 8192):
            port = 29500 + world * 10 + cols // 4096
            mp.spawn(rank_main, args=(world, port, cols, args.json), nprocs=world)


if __name__ == "__main__":
    main()
