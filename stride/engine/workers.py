"""Rank 0's side of tensor parallelism: the worker processes of the other ranks, and the runner
and KV cache that mirror every device call onto them.

The engine process is rank 0: it schedules, samples and returns logits, as with one device.
Ranks 1..N-1 are worker processes (`stride.engine.worker`), one per device, each holding its
share of the weights and of every layer's KV heads. Before rank 0 runs a forward pass (or a
burst of decode steps, or a KV copy) it sends the workers that step's plan as plain data over a
pipe each: the spans' cached lengths, block tables, tokens, positions and masks. Every rank then
runs the same pass, meeting at the collectives (`parallel`); rank 0 samples, and broadcasts a
burst's sampled tokens, which are the next step's input on every rank. Nothing above the engine
knows about ranks: the scheduler and decoders call the runner and the cache as always.

Workers exit when their pipe closes (the engine process ended or was killed), when rank 0 sends
"stop", or when their parent changes; they ignore SIGINT and SIGTERM, as the engine process does,
so that a server drains before anything stops. A worker that exits fails the engine at its next
collective (gloo fails at once; on NCCL a watcher aborts the group) or its next plan: the
engine's supervision restarts it like after any other fault. A step that fails on rank 0 alone
leaves the workers inside a collective nobody will join, so it stops them too: then the engine
restarts (a request's own error, isolated with one device, costs a restart here).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stride.engine.config import EngineConfig
from stride.engine.kv_cache import KVCache
from stride.engine.parallel import (
    COLLECTIVE_TIMEOUT,
    backend,
    broadcast_tokens,
    gather_vocab,
    rank_device,
)
from stride.engine.runner import ModelRunner, SampledTokens
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # for a worker to start its interpreter and reach the rendezvous


class WorkerDied(RuntimeError):
    """A tensor-parallel worker is gone: the engine cannot run another step."""


def plain_span(c: Span) -> tuple:
    """What a worker needs of a span (plain data: it crosses a pipe)."""
    mask = None if c.mask is None else c.mask.cpu()
    return (c.seq.num_cached, list(c.seq.block_table), list(c.token_ids), c.num_logits,
            c.positions, mask, c.offset, c.fed)  # fmt: skip


_SHADOW = SamplingParams(seed=0)  # (seeded: a shadow draws nothing, and needs no random seed)


def shadow(num_cached: int, block_table: list[int]) -> Sequence:
    """A worker's stand-in for a sequence: its KV cursor and block table are all a pass reads."""
    seq = Sequence("", [], _SHADOW)
    seq.num_cached, seq.block_table = num_cached, block_table
    return seq


def span_of(plain: tuple) -> Span:
    num_cached, table, tokens, num_logits, positions, mask, offset, fed = plain
    return Span(shadow(num_cached, table), tokens, num_logits, positions, mask, offset, fed)


class Workers:
    """The worker processes of ranks 1..N-1, started and joined to the process group with rank 0
    (this process). One group per process: starting another stops the last one's workers."""

    _current: Workers | None = None

    def __init__(
        self, procs: list[subprocess.Popen], conns: list[Connection], store: dist.Store
    ) -> None:
        self.procs, self.conns, self.store = procs, conns, store
        self.dead: str | None = None
        self._releases: list[Callable[[], None]] = []  # see `before_close`
        self._stopping = threading.Event()  # set once we stop them: their exits are no fault
        self._finalizer = Finalize(
            self, _stop, args=(procs, conns, self._stopping), exitpriority=10
        )
        for rank, proc in enumerate(procs, 1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"stride-tp-watch-{rank}", daemon=True
            ).start()

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> Workers:
        if cls._current is not None:
            cls._current.close()
        world = config.tensor_parallel_size
        if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
            raise ValueError(
                f"--tensor-parallel-size {world} needs {world} GPUs from {device}; "
                f"{torch.cuda.device_count()} are visible"
            )
        config = dataclasses.replace(config, device=str(device))  # what "auto" came to here
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
        )  # fmt: skip
        procs: list[subprocess.Popen] = []
        conns: list[Connection] = []
        try:
            for rank in range(1, world):
                ours, theirs = socket.socketpair()
                with theirs:
                    cmd = [sys.executable, "-m", "stride.engine.worker", str(theirs.fileno())]
                    procs.append(_spawn(cmd, theirs.fileno()))
                conns.append(Connection(ours.detach()))
                conns[-1].send((config, rank, world, store.port))
            for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True), 1):
                _await_start(proc, conn, rank)
            if device.type == "cuda":
                torch.cuda.set_device(rank_device(device, 0))
            dist.init_process_group(
                backend(device), store=store, rank=0, world_size=world, timeout=COLLECTIVE_TIMEOUT
            )
        except BaseException:
            _stop(procs, conns)
            raise
        log.info("tensor parallel over %d ranks (%s)", world, backend(device))
        cls._current = cls(procs, conns, store)
        return cls._current

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, message: tuple[str, Any]) -> None:
        """One message to every worker, pickled once; WorkerDied if one is gone."""
        if self.dead is not None:
            raise WorkerDied(self.dead)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send_bytes(data)
            except (OSError, ValueError) as e:
                # (a closed socket is most often a worker that exited: say how, once reaped)
                gone = f"tensor-parallel rank {rank} is gone ({type(e).__name__})"
                self.fail(self.exited() or gone)
                raise WorkerDied(self.dead) from e

    def exited(self, wait: float = 1.0) -> str | None:
        """Which worker exited, if one did (waiting up to `wait` s: a peer's crash reaches the
        collectives before its exit is reaped)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self.procs, 1):
                if proc.poll() is not None:
                    return f"tensor-parallel rank {rank} exited with code {proc.returncode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def fail(self, why: str) -> None:
        """Give the group up: the workers stop, and every later plan raises WorkerDied."""
        if self.dead is None:
            self.dead = why
            log.error("tensor parallelism failed: %s", why)
        self._stopping.set()
        for proc in self.procs:  # (they may wait in a collective: asking them would not do)
            if proc.poll() is None:
                proc.kill()
        self.close()

    def before_close(self, release: Callable[[], None]) -> None:
        """Run `release` before the group is left: what holds the group's collectives (CUDA
        graphs that captured them) must go first, or NCCL's destroy waits for it forever."""
        self._releases.append(release)

    def close(self) -> None:
        """Stop the workers (they finish the plan in hand) and leave the process group."""
        self._finalizer()
        for release in self._releases:
            release()
        self._releases.clear()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead peer may not go quietly
                log.debug("destroying the process group failed", exc_info=True)
        if Workers._current is self:
            Workers._current = None

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping.is_set():
            return
        self.dead = f"tensor-parallel rank {rank} exited with code {code}"
        log.error("%s", self.dead)
        if dist.is_initialized() and dist.get_backend() == "nccl":
            # A collective waiting for the dead rank would wait forever on the device.
            dist.distributed_c10d._abort_process_group()


def _spawn(cmd: list[str], fd: int) -> subprocess.Popen:
    """A worker in a session of its own: a terminal's Ctrl-C or a `kill` of the server's process
    group reaches the server, which drains and then stops the workers, not the workers first."""
    root = str(Path(__file__).resolve().parents[2])  # where `stride` is, installed or not
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen(cmd, pass_fds=(fd,), start_new_session=True, env=env)


def _await_start(proc: subprocess.Popen, conn: Connection, rank: int) -> None:
    """Wait until worker `rank` reaches the rendezvous (or say why it never will)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not conn.poll(0.2):
        if proc.poll() is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} exited at start ({proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel rank {rank} did not start in {START_TIMEOUT_S} s")
    conn.recv()


def _stop(
    procs: list[subprocess.Popen], conns: list[Connection], stopping: threading.Event | None = None
) -> None:
    """Ask every worker to stop, then make sure: wait a little, then kill (no orphans). Run by
    `Workers.close`, when the `Workers` are collected, and at the process's exit."""
    if stopping is not None:
        stopping.set()
    data = pickle.dumps(("stop", None))
    for conn in conns:
        try:
            conn.send_bytes(data)
            conn.close()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class MirroredKVCache(KVCache):
    """Rank 0's KV cache: every copy between slots is also made on the workers' caches."""

    def __init__(self, workers: Workers, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self.workers.send(("copy", (src, dst)))
        super().copy_slots(src, dst)


class MirroredRunner(ModelRunner):
    """Rank 0's runner: each pass is sent to the workers before it runs here."""

    def __init__(
        self, workers: Workers, model, cache: KVCache, device: torch.device, **kwargs
    ) -> None:
        super().__init__(model, cache, device, **kwargs)
        self.workers = workers
        workers.before_close(self.release_graphs)

    def capture_features(self, layers: tuple[int, ...]) -> None:
        self.workers.send(("capture", tuple(layers)))  # (the decode graphs are captured again)
        self._here(super().capture_features, layers)

    def gather_vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole embedding and LM head (gathered from every rank's slices)."""
        self.workers.send(("vocab", None))
        return self._here(gather_vocab, self.model)

    def forward(
        self, spans: list[Span], num_layers: int | None = None, fed: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        count = None if fed is None else len(fed)
        self.workers.send(("forward", ([plain_span(c) for c in spans], num_layers, count)))
        return self._here(self._forward_fed, spans, num_layers, fed)

    def _forward_fed(self, spans, num_layers, fed):
        if fed is not None:
            broadcast_tokens(fed)  # (the workers' fed rows read the same tokens)
        return super().forward(spans, num_layers, fed)

    def decode_steps(
        self,
        seqs: list[Sequence],
        tokens: list[int] | torch.Tensor,
        steps: int,
        sample: Callable[[torch.Tensor, int], torch.Tensor],
        offsets: list[int] | None = None,
    ) -> SampledTokens:
        fed = len(tokens) if isinstance(tokens, torch.Tensor) else list(tokens)
        tables = [(s.num_cached, list(s.block_table)) for s in seqs]
        self.workers.send(("decode", (tables, fed, steps, offsets)))

        def sample_everywhere(logits: torch.Tensor, step: int) -> torch.Tensor:
            return broadcast_tokens(sample(logits, step))

        def here() -> SampledTokens:
            first = broadcast_tokens(tokens) if isinstance(tokens, torch.Tensor) else tokens
            return super(MirroredRunner, self).decode_steps(
                seqs, first, steps, sample_everywhere, offsets
            )

        return self._here(here)

    def _here(self, run, *args):
        """Rank 0's share of a pass. If it fails, because a worker died (which fails the
        collectives) or here alone (the workers then wait in one for us), stop them all."""
        try:
            return run(*args)
        except Exception as e:
            exited = self.workers.exited()
            if exited is None:
                self.workers.fail(f"rank 0 failed mid-pass: {type(e).__name__}: {e}")
                raise
            self.workers.fail(exited)
            raise WorkerDied(exited) from e
