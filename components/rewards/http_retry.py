"""Retrying HTTP calls to reward services: jittered exponential backoff on transient failures only."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable

import httpx

from components.polling import backoff

EXCERPT = 300
MAX_RETRY_AFTER_S = 60.0  # a server asking for a longer pause is treated as failing
MAX_BACKOFF_S = 15.0  # within a retry window, the pause between attempts stops doubling here


class RetriesExhausted(Exception):
    """Every attempt failed transiently; the message names the last problem."""


def is_transient(status: int) -> bool:
    return status in (408, 429) or status >= 500


def retry_after_s(response: httpx.Response) -> float | None:
    """The pause a 429/503 asks for in its ``Retry-After`` header, in seconds (delta form only)."""
    value = response.headers.get("retry-after", "").strip()
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds <= MAX_RETRY_AFTER_S else None


async def send_with_retries(
    send: Callable[[], Awaitable[httpx.Response]], *, retries: int | None, backoff_s: float,
    timeout_s: float | None = None, limit: asyncio.Semaphore | None = None, window_s: float | None = None,
    on_retry: Callable[[str], None] | None = None,
) -> httpx.Response:
    """Call ``send`` until it returns a non-transient response (returned, whatever its status).

    Connection errors, timeouts (``timeout_s`` bounds one attempt), 408, 429 and 5xx are retried
    ``retries`` times (``None``: no count limit) and, with ``window_s``, until ``window_s`` have passed since
    the first failure: the pause before the attempt that would start past the window is shortened so that
    the last attempt starts as the window ends. Pauses are ``backoff_s * 2**k`` with +-50% jitter (at most
    ``MAX_BACKOFF_S`` within a window, or longer when the server's ``Retry-After`` asks for it), slept outside
    ``limit`` so a request that backs off does not hold an in-flight slot. ``on_retry`` hears one line per
    retry: the attempt, the wait and the cause.
    """
    if retries is None and window_s is None:
        raise ValueError("send_with_retries needs retries or window_s")
    problem, asked, first_failure = "", 0.0, 0.0
    attempt, last = 0, False
    pauses = backoff(backoff_s, cap_s=math.inf if window_s is None else MAX_BACKOFF_S, jitter=0.5)
    while True:
        if attempt:
            if last or (retries is not None and attempt > retries):
                break
            pause = max(asked, next(pauses))
            if window_s is not None:
                left = window_s - (time.monotonic() - first_failure)
                if left <= 0:  # the window ended during the last attempt
                    break
                # the window's end is the last attempt, not the point past which no pause fits
                last = pause >= left
                pause = min(pause, left)
            if on_retry is not None:
                budget = f"{retries} retries" if window_s is None else f"{left:.0f} s of the {window_s:g} s window left"
                on_retry(f"attempt {attempt + 1} in {pause:.1f} s ({budget}): {problem}")
            await asyncio.sleep(pause)
        attempt += 1
        try:
            async with limit or contextlib.nullcontext(), asyncio.timeout(timeout_s):
                response = await send()
        except TimeoutError:
            problem = f"timed out after {timeout_s:g} s"
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            if not is_transient(response.status_code):
                return response
            asked = retry_after_s(response) or 0.0
            problem = f"HTTP {response.status_code}: {response.text[:EXCERPT]}"
        if attempt == 1:  # a request that ran long before the server went away still gets the whole window
            first_failure = time.monotonic()
    raise RetriesExhausted(f"gave up after {attempt} attempts in {time.monotonic() - first_failure:.0f} s, "
                           f"last: {problem}")
