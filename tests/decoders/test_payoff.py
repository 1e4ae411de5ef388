"""Does refining pay? The measured choice between refining and plain steps (`payoff`), and
adaptive Jacobi, lookahead and introspective, whose outputs stay greedy AR's whichever mode they
run in."""

from __future__ import annotations

import pytest

from stride.decoders import payoff
from stride.decoders.payoff import EPOCH, EXPLORE_EVERY, LONGEST_WAIT, MAX_WAIT, PROBE, Payoff
from stride.decoders.rates import bucket
from tests.helpers.adapters import introspective_core
from tests.helpers.cores import run
from tests.helpers.refine import make_refine_core, reqs


class Clock:
    """Time that passes `cost[refining]` seconds per step of the payoff it is read for."""

    def __init__(self, refine_s: float, plain_s: float) -> None:
        self.now, self.cost, self.payoff = 0.0, {True: refine_s, False: plain_s}, None

    def __call__(self) -> float:
        self.now += self.cost[self.payoff.refining]
        return self.now


class Clocked(Payoff):
    """A payoff whose launches take what its `Clock` says a step of its mode takes (not what a
    CPU run measured)."""

    def record(
        self, batch: int, tokens: int, launch_s: float | None, refining: bool, steps: int = 1
    ) -> None:
        launch_s = None if launch_s is None else self.clock.cost[self.refining]
        super().record(batch, tokens, launch_s, refining, steps)


MOST = 9  # the most tokens a refining step commits per sequence (Jacobi's default window + 1)


def clocked(refine_s: float, plain_s: float) -> Payoff:
    clock = Clock(refine_s, plain_s)
    clock.payoff = p = Clocked(MOST, clock)
    return p


def modes(p: Payoff, epochs: int, tokens: dict[bool, int], batch: int = 4):
    """Run `epochs` epochs of steps committing `tokens[mode]` per sequence: each epoch's mode
    and its length in steps."""
    seen: list[tuple[bool, int]] = []
    p.record(batch, 0, 0.0, p.refining)  # the first step only starts the clock
    for epoch in range(epochs):
        mode, steps = p.refining, 0
        while p.epochs == epoch:
            p.record(batch, batch * tokens[p.refining], 0.0, p.refining)
            steps += 1
        seen.append((mode, steps))
    return seen


E, W, L = EXPLORE_EVERY, MAX_WAIT, LONGEST_WAIT


@pytest.mark.parametrize(
    "refine_s, probe, tries",
    [
        # 2x slower: a try of PROBE steps; waits of 2E (twice as slow), 2E, then doubling up
        # to the longest.
        (2.0, PROBE, [1, 2 + 2 * E, 3 + 4 * E, 4 + 8 * E, 5 + 8 * E + W, 6 + 8 * E + 2 * W]),
        # 40x (far more than PAUSE plain steps): could not win with MOST tokens a step, so a
        # try ends after its first step; the waits are 40E, past the longest doubling (a try's
        # share of the time stays about 1 / (E * EPOCH) however slow refining is).
        (40.0, 1, [1, 2 + 40 * E, 3 + 80 * E]),
        # 400x: the waits are the longest there is, not 400E (a measure that far off may have
        # timed a one-off).
        (400.0, 1, [1, 2 + L, 3 + 2 * L]),
    ],
)
def test_refining_that_does_not_pay_gives_way_to_plain_steps_and_is_tried_ever_less_often(
    refine_s, probe, tries
):
    # One token per refining pass at 2 (or 40) plain steps' time: plain is faster.
    seen = modes(clocked(refine_s, plain_s=1.0), tries[-1] + 2, {True: 1, False: 1})
    assert [i for i, (refining, _) in enumerate(seen) if refining] == tries
    # A try of refining stops as soon as it may: a method that never pays costs a few steps.
    assert {steps for refining, steps in seen if refining} == {probe}
    assert {steps for refining, steps in seen if not refining} == {EPOCH}


def test_a_bucket_borrows_the_mode_it_has_not_measured_from_a_neighbour_only():
    p = clocked(refine_s=3.0, plain_s=1.0)
    modes(p, 2, {True: 1, False: 1}, batch=1)  # at 1 sequence: refining tried, 3x slower
    assert p.rates[bucket(1)][True] == pytest.approx(p.rates[bucket(1)][False] / 3)
    for _ in range(EPOCH):  # an epoch of plain steps at 2 sequences, the next bucket ...
        p.record(2, 2, 0.0, False)
    assert p.epochs == 3 and not p.refining  # ... and no try of refining there after it
    assert p.rates[bucket(2)][True] == pytest.approx(p.rates[bucket(2)][False] / 3)
    for _ in range(EPOCH):  # at 8 sequences, far from both: refining is tried there
        p.record(8, 8, 0.0, False)
    assert p.epochs == 4 and p.refining
    assert True not in p.rates[bucket(8)]


def test_a_mode_that_loses_at_one_batch_size_is_still_tried_at_another():
    """Each bucket waits for its own tries: losses at one sequence (refining 3x slower there,
    as EAGLE's loop at batch 1) leave the next try at 8 sequences, where refining wins, as soon
    as a bucket that never lost tries it."""
    p = clocked(refine_s=3.0, plain_s=1.0)
    seen = modes(p, 2 + 4 * (1 + 3 * EXPLORE_EVERY), {True: 1, False: 1}, batch=1)
    assert sum(refining for refining, _ in seen) >= 3  # tried and lost, again and again
    assert p.plain_steps() > EPOCH * 3 * EXPLORE_EVERY  # the wait there has grown
    p.clock.cost[True] = 1.0  # at 8 sequences a refining step costs a plain one's ...
    wins = {True: 3, False: 1}  # ... and makes 3 tokens a sequence
    refined = 0
    for _ in range(EPOCH * (2 + EXPLORE_EVERY)):
        refined += p.refining
        p.record(8, 8 * wins[p.refining], 0.0, p.refining)
    assert p.rates[bucket(8)][True] > p.rates[bucket(8)][False]
    assert refined >= EPOCH * EXPLORE_EVERY  # refining is the mode at 8 sequences now


def test_each_bucket_waits_for_its_own_next_try():
    """Refining lost once at 8 sequences and many times at one: back at 8, where it now pays,
    it is tried again after 8 sequences' wait, not after the one grown at one sequence."""
    p = clocked(refine_s=3.0, plain_s=1.0)
    modes(p, 2, {True: 1, False: 1}, batch=8)  # at 8: plain, then a try of refining that lost
    modes(p, 2 + 4 * (1 + 3 * EXPLORE_EVERY), {True: 1, False: 1}, batch=1)  # lost at 1, again
    assert p.plain_steps() > EPOCH * 3 * EXPLORE_EVERY
    p.clock.cost[True] = 1.0  # at 8 sequences refining now makes 3 tokens a plain step's time
    epochs = p.epochs
    while not p.refining:
        p.record(8, 8, 0.0, False)
    assert p.epochs - epochs <= 1 + 3 * EXPLORE_EVERY  # (the wait after one loss, 3x slower)


def test_plain_steps_are_promised_up_to_the_next_try_of_refining():
    p = clocked(refine_s=2.0, plain_s=1.0)
    modes(p, 2, {True: 1, False: 1})  # plain, then a try of refining that lost
    promise = p.plain_steps()
    assert promise == EPOCH * 2 * E  # (the wait after a 2x loss: 2E epochs of plain steps)
    for _ in range(promise):
        assert not p.refining
        p.record(4, 4, 0.0, False)
    assert p.refining  # tried just where the promise ended


def test_steps_promised_before_a_switch_are_not_the_new_modes_measure():
    p = clocked(refine_s=1.0, plain_s=1.0)
    modes(p, 1, {True: 1, False: 1})
    assert p.refining  # refining is tried now, while some sequences finish plain promises
    for _ in range(5):
        p.record(4, 4, 0.0, False)
    for _ in range(EPOCH):
        p.record(4, 8, 0.0, True)  # 2 tokens a sequence per refining step of 1 s
    assert p.rates[bucket(4)][True] == pytest.approx(2.0)


def test_refining_that_pays_keeps_refining():
    # 3 tokens per refining pass at 1.5 plain steps' time.
    seen = modes(clocked(refine_s=1.5, plain_s=1.0), 3 + EXPLORE_EVERY, {True: 3, False: 1})
    assert seen[:2] == [(False, EPOCH), (True, EPOCH)]  # the probe wins: a whole epoch
    assert seen[2 : 1 + EXPLORE_EVERY] == [(True, EPOCH)] * (EXPLORE_EVERY - 1)
    assert seen[1 + EXPLORE_EVERY] == (False, PROBE)  # plain probed again, and dropped early
    assert seen[2 + EXPLORE_EVERY][0] is True


def test_a_probe_that_is_winning_runs_its_whole_epoch():
    # Refining is as fast as plain for its first steps, then faster: ahead at PROBE, it runs on.
    p = clocked(refine_s=1.0, plain_s=1.0)
    p.record(1, 0, 1.0, p.refining)
    for _ in range(EPOCH):
        p.record(1, 1, 1.0, p.refining)
    assert p.refining
    for step in range(EPOCH):
        p.record(1, 1 if step < PROBE - 1 else 4, 1.0, p.refining)
    assert p.epochs == 2 and p.refining  # measured in full, and it pays


@pytest.mark.parametrize("at", [EPOCH - 1, 0], ids=["mid-epoch", "between-epochs"])
def test_a_pause_is_not_measured(at):
    clock = Clock(refine_s=1.0, plain_s=1.0)
    clock.payoff = p = Payoff(MOST, clock)  # (its launches take 1.0 whatever the clock says)
    p.record(1, 0, 1.0, p.refining)
    for _ in range(EPOCH):  # one epoch of plain steps, measured: then refining
        p.record(1, 1, 1.0, p.refining)
    assert p.refining
    for step in range(EPOCH):
        clock.cost[True] = 1000.0 if step == at else 1.0  # the server idled before it
        p.record(1, 2, 1.0, p.refining)  # (a launch of a step's time; refining pays: a whole epoch)
    assert set(p.rates[0]) == {False} and p.refining  # dropped: the clock restarted there


@pytest.mark.parametrize("bursts", [None, 3], ids=["steps", "bursts"])
@pytest.mark.parametrize("method", ["jacobi", "lookahead", "introspective"])
def test_adaptive_methods_match_greedy_across_mode_switches(tiny_dir, method, bursts, monkeypatch):
    """Default options: the method measures (here a clock on which refining looks slow) and
    switches to plain steps, greedy bursts of them too, and back; every token is still greedy
    AR's."""
    monkeypatch.setattr(payoff, "EPOCH", 4)
    monkeypatch.setattr(payoff, "EXPLORE_EVERY", 2)
    if method == "introspective":  # (a random MASK-slot adapter)
        core = introspective_core(tiny_dir, fused_decode_steps=bursts)
    else:
        core = make_refine_core(tiny_dir, fused_decode_steps=bursts)
    decoder = core.decoders["refine"].causal[method]
    decoder.payoff = clocked(refine_s=3.0, plain_s=1.0)
    ar, _ = run(core, reqs(core, "ar", {}, n=48))
    got, stats = run(core, reqs(core, "refine", {"method": method}, n=48))
    assert got == {k.replace("ar", "refine"): v for k, v in ar.items()}
    measured = decoder.payoff.rates.values()
    assert any(set(modes) == {True, False} for modes in measured)  # both ran, both measured
