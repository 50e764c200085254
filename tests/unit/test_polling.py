"""The one poll loop and backoff, against a fake clock: where the tries fall, where they stop, what ends them."""

import asyncio
import random
import threading
import time

import pytest

from components.polling import Polls, backoff


class FakeClock:
    """Time that moves only when waited on (``wait``) or spent by a try (``spend``)."""

    def __init__(self, wake_at: float | None = None):
        self.now, self.waits, self.wake_at = 100.0, [], wake_at

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return self.wake_at is not None and self.now - 100.0 >= self.wake_at

    def spend(self, seconds: float) -> None:
        self.now += seconds


def _tries(polls: Polls, clock: FakeClock, cost: float = 0.0, done_at: int | None = None) -> list[float]:
    seen = []
    for elapsed in polls:
        seen.append(elapsed)
        clock.spend(cost)
        if done_at is not None and len(seen) == done_at:
            break
    return seen


def test_tries_fall_an_interval_apart_up_to_one_look_past_the_bound():
    clock = FakeClock()
    polls = Polls(1.0, 0.25, wait=clock.wait, clock=clock)
    assert _tries(polls, clock) == [0.0, 0.25, 0.5, 0.75, 1.0]  # the try at 1.0 is the last look
    assert not polls.woken and clock.waits == [0.25] * 4


def test_a_try_that_runs_past_the_bound_is_the_last():
    clock = FakeClock()
    # each try takes 0.375 s: tries start at 0, 0.625; the second ends at 1.0, the bound: no third
    assert _tries(Polls(1.0, 0.25, wait=clock.wait, clock=clock), clock, cost=0.375) == [0.0, 0.625]


def test_a_caller_that_is_done_stops_the_tries_without_another_wait():
    clock = FakeClock()
    assert _tries(Polls(10.0, 0.5, wait=clock.wait, clock=clock), clock, done_at=3) == [0.0, 0.5, 1.0]
    assert clock.waits == [0.5, 0.5]


def test_without_a_bound_the_tries_go_on():
    clock = FakeClock()
    assert len(_tries(Polls(None, 60.0, wait=clock.wait, clock=clock), clock, done_at=1000)) == 1000
    assert clock.now - 100.0 == 999 * 60.0


def test_a_wait_that_answers_true_ends_the_tries_woken():
    clock = FakeClock(wake_at=0.75)
    polls = Polls(10.0, 0.25, wait=clock.wait, clock=clock)
    assert _tries(polls, clock) == [0.0, 0.25, 0.5] and polls.woken


def test_a_bound_passed_ends_the_tries_before_an_event_set_meanwhile_is_heard():
    stop = threading.Event()
    stop.set()
    polls = Polls(0.0, 10.0, wait=stop.wait)
    assert len(list(polls)) == 1 and not polls.woken  # a RayJob past its timeout is reported so, not cancelled


def test_wait_first_pauses_before_the_first_try():
    clock = FakeClock()
    assert _tries(Polls(1.0, 0.5, wait=clock.wait, wait_first=True, clock=clock), clock) == [0.5, 1.0]
    woken = FakeClock(wake_at=0.5)
    polls = Polls(1.0, 0.5, wait=woken.wait, wait_first=True, clock=woken)
    assert _tries(polls, woken) == [] and polls.woken


def test_an_exception_in_a_try_passes_through_unchanged():
    clock = FakeClock()
    error = KeyError("gone")
    with pytest.raises(KeyError) as raised:
        for _ in Polls(1.0, 0.25, wait=clock.wait, clock=clock):
            raise error
    assert raised.value is error and clock.waits == []


def test_the_async_tries_match_the_sync_ones():
    clock = FakeClock(wake_at=1.0)

    async def wait(seconds):
        return clock.wait(seconds)

    async def tries():
        polls = Polls(None, 0.25, wait=wait, clock=clock)
        return [elapsed async for elapsed in polls], polls.woken

    assert asyncio.run(tries()) == ([0.0, 0.25, 0.5, 0.75], True)


def test_an_event_ends_real_polls_at_once():
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    polls = Polls(30.0, 10.0, wait=stop.wait)
    assert len(list(polls)) == 1 and polls.woken
    assert time.monotonic() - started < 5.0


def test_real_time_bound():
    started = time.monotonic()
    tries = list(Polls(0.3, 0.05))
    took = time.monotonic() - started
    assert 0.3 <= took < 2.0 and tries[-1] >= 0.25 and len(tries) >= 2


def test_backoff_doubles_to_its_cap():
    pauses = backoff(1.0, cap_s=30.0)
    assert [next(pauses) for _ in range(8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    uncapped = backoff(0.5)
    assert [next(uncapped) for _ in range(40)][-1] == 0.5 * 2 ** 30  # stops doubling, never overflows


def test_backoff_jitter_draws_once_per_pause_and_caps_after_it(monkeypatch):
    draws = iter([1.5, 0.5, 1.0, 1.5])
    monkeypatch.setattr(random, "uniform", lambda a, b: (a, b) == (0.5, 1.5) and next(draws))
    pauses = backoff(2.0, cap_s=10.0, jitter=0.5)
    assert [next(pauses) for _ in range(4)] == [3.0, 2.0, 8.0, 10.0]  # 2*1.5, 4*0.5, 8*1.0, min(16*1.5, 10)
    assert next(backoff(1.0), None) == 1.0  # no jitter: no draw (the iterator above is spent: it would raise)
