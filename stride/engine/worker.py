"""A tensor-parallel worker: one rank's share of the model, running the plans rank 0 sends.

Started by `workers.Workers` as `python -m stride.engine.worker FD`, where FD is its end of a
socket pair to the engine process. It loads its slices of the weights, sizes its KV cache with
the others (as many blocks as the tightest rank), builds the same runner as rank 0 (the same
CUDA graphs, so the collectives they captured meet), then runs every plan that comes: forward
passes, bursts of decode steps (each step's tokens broadcast by rank 0) and KV copies. Its logits
go nowhere: rank 0 has the same ones.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from stride.engine import loader
from stride.engine.config import DTYPES, EngineConfig
from stride.engine.engine import make_cache
from stride.engine.parallel import (
    COLLECTIVE_TIMEOUT,
    Layout,
    backend,
    broadcast_tokens,
    gather_vocab,
    rank_device,
)
from stride.engine.runner import ModelRunner
from stride.engine.workers import shadow, span_of

log = logging.getLogger("stride.engine.worker")


class Rank:
    """One worker rank's model, KV cache and runner, and what it does with each plan."""

    def __init__(self, config: EngineConfig, rank: int, world: int) -> None:
        self.device = rank_device(torch.device(config.device), rank)
        dtype = None if config.dtype == "auto" else DTYPES[config.dtype]
        layout = Layout.of(loader.load_config(config.model), world, rank)
        loaded = loader.load(
            config.model, self.device, dtype, None, layout, config.random_weights
        )
        model = loaded.model
        dtype = next(model.parameters()).dtype
        cache = make_cache(config, model, dtype, self.device, "", parallel=True)
        self.runner = ModelRunner(model, cache, self.device, all_reduce=config.all_reduce)

    def forward(self, spans: list[tuple], num_layers: int | None, fed: int | None) -> None:
        tokens = None if fed is None else self._receive(fed)
        self.runner.forward([span_of(s) for s in spans], num_layers, tokens)

    def decode(self, tables, fed, steps: int, offsets: list[int] | None) -> None:
        """A burst; `fed`: its first tokens, or how many rank 0 broadcasts (fed on the device)."""
        seqs = [shadow(num_cached, table) for num_cached, table in tables]
        tokens = self._receive(fed) if isinstance(fed, int) else fed

        def receive(logits: torch.Tensor, step: int) -> torch.Tensor:
            return self._receive(len(logits))

        self.runner.decode_steps(seqs, tokens, steps, receive, offsets)

    def _receive(self, count: int) -> torch.Tensor:
        """`count` tokens rank 0 broadcasts."""
        return broadcast_tokens(torch.empty(count, dtype=torch.long, device=self.device))

    def copy(self, src: list[int], dst: list[int]) -> None:
        self.runner.cache.copy_slots(src, dst)


def _watch_parent(parent: int) -> None:
    """Exit if the engine process is gone without closing our pipe (no orphans)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops us once it has drained
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(int(sys.argv[1]))
    config, rank, world, port = conn.recv()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = rank_device(torch.device(config.device), rank)  # (rank 0 resolved "auto")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    conn.send(("joining", rank))
    dist.init_process_group(
        backend(device), store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    here = Rank(config, rank, world)
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # the engine process is gone
            return 0
        if kind == "stop":
            here.runner.release_graphs()
            return 0
        if kind == "forward":
            here.forward(*payload)
        elif kind == "decode":
            here.decode(*payload)
        elif kind == "copy":
            here.copy(*payload)
        elif kind == "capture":
            here.runner.capture_features(payload)
        elif kind == "vocab":
            gather_vocab(here.runner.model)
        else:  # (a rank that cannot follow the plans must not go on: its exit fails the engine)
            raise ValueError(f"unknown plan {kind!r}")


if __name__ == "__main__":
    sys.exit(main())
