"""Retrying HTTP calls to reward services: jittered exponential backoff on transient failures only."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

import httpx

EXCERPT = 300
MAX_RETRY_AFTER_S = 60.0  # a server asking for a longer pause is treated as failing


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
    send: Callable[[], Awaitable[httpx.Response]], *, retries: int, backoff_s: float,
    timeout_s: float | None = None, limit: asyncio.Semaphore | None = None,
) -> httpx.Response:
    """Call ``send`` until it returns a non-transient response (returned, whatever its status).

    Connection errors, timeouts (``timeout_s`` bounds one attempt), 408, 429 and 5xx are retried
    ``retries`` times, sleeping ``backoff_s * 2**k`` with +-50% jitter (or longer when the server's
    ``Retry-After`` asks for it), outside ``limit`` so a request that backs off does not hold an
    in-flight slot.
    """
    problem, asked = "", 0.0
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(max(asked, backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)))
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
        asked = retry_after_s(response) or 0.0
        problem = f"HTTP {response.status_code}: {response.text[:EXCERPT]}"
    raise RetriesExhausted(f"gave up after {retries + 1} attempts, last: {problem}")
