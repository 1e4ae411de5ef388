"""Admission that cannot starve, over real HTTP: `--max-waiting 4 --max-num-seqs 2`, five
clients looping on n=1 and one asking n=4, every client honouring Retry-After. The queue never
empties by itself, yet the n=4 request is admitted within 10 s: its first refusal holds room
for it, which the single requests leave free until it comes back."""

from __future__ import annotations

import threading
import time

import httpx

from stride.scheduler.policy import SchedulerConfig
from tests.helpers.decoders import extra_decoders
from tests.helpers.servers import LiveServer, tiny_config

SMALL = {"prompt": "x", "max_tokens": 10, "ignore_eos": True, "decoder": "slow"}
LARGE = {**SMALL, "max_tokens": 4, "n": 4, "stream": True}
CLIENTS = 5


class Loop:
    """A client that sends `body` again and again, sleeping Retry-After after each 429."""

    def __init__(self, url: str, body: dict, stop: threading.Event) -> None:
        self.url, self.body, self.stop = url, body, stop
        self.statuses: list[int] = []
        self.retry_after: list[int] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                status = self.once(client)
                self.statuses.append(status)

    def once(self, client: httpx.Client) -> int:
        with client.stream("POST", f"{self.url}/v1/completions", json=self.body) as r:
            if r.status_code == 429:
                wait = int(r.headers["Retry-After"])
                self.retry_after.append(wait)
                r.read()
                time.sleep(wait)
            else:
                r.read()
            return r.status_code


def test_a_request_of_four_is_admitted_under_steady_load(tiny_dir):
    config = tiny_config(tiny_dir, scheduler=SchedulerConfig(max_waiting=4, max_num_seqs=2))
    with extra_decoders():
        live = LiveServer(config)
        try:
            run_the_scenario(live)
        finally:
            live.stop()


def run_the_scenario(live: LiveServer) -> None:
    stop = threading.Event()
    small = [Loop(live.url, SMALL, stop) for _ in range(CLIENTS)]
    threads = [threading.Thread(target=c.run) for c in small]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while live.core.num_waiting < CLIENTS - 2:  # two run, three wait: the queue is busy
        assert time.monotonic() < deadline, "the load never filled the queue"
        time.sleep(0.01)

    large = Loop(live.url, LARGE, stop)
    first_try = time.monotonic()
    with httpx.Client(timeout=60) as client:
        while (status := large.once(client)) == 429:
            assert time.monotonic() - first_try < 10, large.retry_after
    admitted_after = time.monotonic() - first_try
    stop.set()
    for t in threads:
        t.join(60)

    assert status == 200 and admitted_after < 10
    assert large.retry_after, "the queue was never full for it: nothing was shown"
    for c in small:  # the single ones were served all along, and told when to come back
        assert c.statuses.count(200) >= 1 and set(c.statuses) <= {200, 429}
        assert all(1 <= wait <= 60 for wait in c.retry_after)
    live.wait_idle()
