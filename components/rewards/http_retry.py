"""Retrying HTTP calls to reward services: jittered exponential backoff on transient failures only."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

import httpx

EXCERPT = 300


class RetriesExhausted(Exception):
    """Every attempt failed transiently; the message names the last problem."""


def is_transient(status: int) -> bool:
    return status in (408, 429) or status >= 500


async def send_with_retries(
    send: Callable[[], Awaitable[httpx.Response]], *, retries: int, backoff_s: float,
    timeout_s: float | None = None, limit: asyncio.Semaphore | None = None,
) -> httpx.Response:
    """Call ``send`` until it returns a non-transient response (returned, whatever its status).

    Connection errors, timeouts (``timeout_s`` bounds one attempt), 408, 429 and 5xx are retried
    ``retries`` times, sleeping ``backoff_s * 2**k`` with +-50% jitter, outside ``limit`` so a request
    that backs off does not hold an in-flight slot.
    """
    problem = ""
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
        try:
            async with limit or contextlib.nullcontext(), asyncio.timeout(timeout_s):
                response = await send()
        except TimeoutError:
            problem = f"timed out after {timeout_s:g} s"
            continue
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}"
            continue
        if not is_transient(response.status_code):
            return response
        problem = f"HTTP {response.status_code}: {response.text[:EXCERPT]}"
    raise RetriesExhausted(f"gave up after {retries + 1} attempts, last: {problem}")
