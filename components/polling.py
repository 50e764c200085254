"""Waiting with a bound: the loop behind every poll of the project (``Polls``) and the pauses of its retries
(``backoff``). Each caller keeps its own check, its own early exits and its own message for a timeout."""

from __future__ import annotations

import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator


def backoff(first_s: float, *, cap_s: float = math.inf, jitter: float = 0.0) -> Iterator[float]:
    """Pauses doubling from ``first_s``, each times a uniform draw in [1 - jitter, 1 + jitter] (one draw per pause,
    none without jitter), then at most ``cap_s``. Endless: a caller stops taking pauses when it gives up."""
    doublings = 0
    while True:
        pause = first_s * 2 ** doublings
        if jitter:
            pause *= random.uniform(1 - jitter, 1 + jitter)
        yield min(pause, cap_s)
        doublings = min(doublings + 1, 30)  # 2**30 pauses: beyond any bound, and no float overflow


class Polls:
    """``for elapsed in Polls(timeout_s, interval_s): <one try; return or break when done>``, then what a timeout
    means to the caller (the loop ran out: ``woken`` says whether ``wait`` ended it rather than the clock).

    Tries are ``interval_s`` apart; ``elapsed`` is the time since the polls began, read as a try begins. The polls
    end once ``timeout_s`` (None: no bound) have passed when a try ends: the last try starts before the bound,
    or is the one look after it. The pause is ``wait(interval_s)``: ``time.sleep``, an ``Event.wait`` or an
    awaitable (``async for``) that ends the polls early by returning true. ``wait_first``: a pause before the
    first try too (a watchdog). ``clock`` and ``wait`` are what tests replace."""

    def __init__(self, timeout_s: float | None, interval_s: float, *,
                 wait: Callable[[float], object] | Callable[[float], Awaitable[object]] | None = None,
                 wait_first: bool = False, clock: Callable[[], float] | None = None) -> None:
        self.timeout_s, self.interval_s, self.wait_first = timeout_s, interval_s, wait_first
        self.wait = wait or time.sleep
        self.clock = clock or time.monotonic
        self.start = self.clock()
        self.woken = False

    def elapsed(self) -> float:
        return self.clock() - self.start

    def _over(self) -> bool:
        return self.timeout_s is not None and self.elapsed() >= self.timeout_s

    def _woken(self, answer: object) -> bool:
        self.woken = bool(answer)
        return self.woken

    def __iter__(self) -> Iterator[float]:
        self.start = self.clock()
        if self.wait_first and self._woken(self.wait(self.interval_s)):
            return
        while True:
            yield self.elapsed()
            if self._over() or self._woken(self.wait(self.interval_s)):
                return

    async def __aiter__(self) -> AsyncIterator[float]:
        self.start = self.clock()
        if self.wait_first and self._woken(await self.wait(self.interval_s)):
            return
        while True:
            yield self.elapsed()
            if self._over() or self._woken(await self.wait(self.interval_s)):
                return
