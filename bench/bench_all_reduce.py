"""The all-reduce by message size: NCCL against the one-shot over peer memory (`collectives`).

One process per GPU. For each size, each way runs `--repeats` all-reduces back to back inside
one CUDA graph (as the decode graphs run them), replayed a few times; the time per all-reduce
is rank 0's. The peer result is checked against NCCL's and across ranks (every rank must hold
the same bits). What `collectives.PEER_MAX_BYTES` should be is where the two lines cross.

    python bench/bench_all_reduce.py --world 2 --json ar-2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.engine import collectives  # noqa: E402

SIZES_KIB = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def timed(fn, repeats: int) -> float:
    """Microseconds per call of `fn` captured `repeats` times in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (5 * repeats) * 1e6


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    dtype = torch.bfloat16
    collectives.PEER_MAX_BYTES = max(SIZES_KIB) * 1024
    collectives.setup(device, dtype, "auto")
    results = {}
    for kib in SIZES_KIB:
        n = kib * 1024 // dtype.itemsize
        gen = torch.Generator(device).manual_seed(rank * 1000 + kib)
        x = torch.randn(n, device=device, dtype=dtype, generator=gen)
        nccl = x.clone()
        dist.all_reduce(nccl)
        peer = collectives.all_reduce(x.clone())
        every = [torch.empty_like(peer) for _ in range(world)]
        dist.all_gather(every, peer)
        same = all(torch.equal(every[0], e) for e in every)
        close = torch.allclose(peer.float(), nccl.float(), atol=0.05, rtol=0.02)
        y = x.clone()
        nccl_us = timed(partial(dist.all_reduce, y), args.repeats)
        peer_us = timed(partial(collectives.all_reduce, x), args.repeats)
        results[f"{kib}KiB"] = {"nccl_us": round(nccl_us, 2), "peer_us": round(peer_us, 2),
                                "ranks_agree": same, "matches_nccl": close}  # fmt: skip
        if rank == 0:
            print(f"{kib:>5} KiB  nccl {nccl_us:7.2f} us  peer {peer_us:7.2f} us"
                  f"  ranks agree {same}  matches nccl {close}", flush=True)  # fmt: skip
    if rank == 0 and args.json:
        card = f"{world} x {torch.cuda.get_device_name()}"
        Path(args.json).write_text(json.dumps({"card": card, "world": world, **results}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--repeats", type=int, default=50, help="all-reduces per graph")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    port = 29500 + os.getpid() % 1000
    mp.spawn(rank_main, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
