"""The shared retry helper against a real local HTTP server that answers from a script."""

import asyncio
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from components.rewards.http_retry import RetriesExhausted, retry_after_s, send_with_retries


class _Script(BaseHTTPRequestHandler):
    replies: ClassVar[list] = []
    seen: ClassVar[list] = []
    down_until: ClassVar[float] = 0.0  # a monotonic time before which every request gets a 503

    def do_GET(self):
        status, headers = self.replies.pop(0) if self.replies else (200, {})
        if time.monotonic() < self.down_until:
            status = 503
        type(self).seen.append(time.monotonic())
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Script)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Script.seen, _Script.down_until = [], 0.0
    yield f"http://127.0.0.1:{server.server_address[1]}/", _Script
    server.shutdown()


def _get(url, **kw):
    async def go():
        async with httpx.AsyncClient() as client:
            return await send_with_retries(lambda: client.get(url), **kw)
    return asyncio.run(go())


def test_retry_after_is_honoured(scripted):
    url, script = scripted
    script.replies = [(429, {"Retry-After": "0.6"}), (200, {})]
    response = _get(url, retries=2, backoff_s=0.01)
    assert response.status_code == 200 and len(script.seen) == 2
    assert script.seen[1] - script.seen[0] >= 0.55  # the server's pause, not the 10 ms backoff


def test_non_transient_status_is_returned_without_retry(scripted):
    url, script = scripted
    script.replies = [(404, {}), (200, {})]
    assert _get(url, retries=3, backoff_s=0.01).status_code == 404 and len(script.seen) == 1


def test_exhausted_retries_name_the_last_problem(scripted):
    url, script = scripted
    script.replies = [(503, {})] * 3
    with pytest.raises(RetriesExhausted, match=r"gave up after 3 attempts in \d+ s, last: HTTP 503"):
        _get(url, retries=2, backoff_s=0.01)


def test_retry_after_parsing():
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "3"})) == 3.0
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None
    assert retry_after_s(httpx.Response(429, headers={"Retry-After": "3600"})) is None  # too long: just fail
    assert retry_after_s(httpx.Response(429)) is None


def _window_schedule(backoff_s: float, window_s: float) -> list[float]:
    """When each attempt should start, from the first failure, without jitter: pauses double from ``backoff_s``
    and the first one that would pass the window is cut so that the last attempt falls at its end."""
    times, pause = [0.0], backoff_s
    while times[-1] + pause < window_s:
        times.append(times[-1] + pause)
        pause *= 2
    return [*times, window_s]


def _against(url: str, script, back_at: float | None, monkeypatch) -> tuple[object, list[float]]:
    """The response or RetriesExhausted, and each attempt's start from the first's, against a server answering
    503 until ``back_at`` s (None: throughout)."""
    monkeypatch.setattr(random, "uniform", lambda a, b: 1.0)  # no jitter: the schedule is exact
    script.down_until = time.monotonic() + (back_at if back_at is not None else 3600)
    try:
        outcome = _get(url, retries=None, backoff_s=BACKOFF_S, window_s=WINDOW_S)
    except RetriesExhausted as exc:
        outcome = exc
    return outcome, [t - script.seen[0] for t in script.seen]


# backoff 0.05 s in a 3 s window: pauses 0.05 .. 0.8 fit, 1.6 would end at 3.15 s; the old rule gave up there,
# at 1.55 s, so a server back at 2 s (2/3 of the window) was never tried
BACKOFF_S, WINDOW_S, BACK_AT_S = 0.05, 3.0, 2.0


def test_a_server_back_late_in_the_window_is_used(scripted, monkeypatch):
    response, times = _against(*scripted, BACK_AT_S, monkeypatch)
    expected = _window_schedule(BACKOFF_S, WINDOW_S)
    assert expected == pytest.approx([0, 0.05, 0.15, 0.35, 0.75, 1.55, 3.0])
    assert isinstance(response, httpx.Response) and response.status_code == 200, response
    assert len(times) == len(expected), times
    # never early; late by the attempts' own latency at most (generous for a loaded machine)
    for got, want in zip(times, expected, strict=True):
        assert want - 0.01 <= got <= want + 0.3, (times, expected)


def test_a_window_is_used_to_its_end_then_given_up(scripted, monkeypatch):
    error, times = _against(*scripted, None, monkeypatch)
    assert isinstance(error, RetriesExhausted) and str(error).startswith("gave up after 7 attempts in 3 s"), error
    assert "last: HTTP 503" in str(error)
    assert len(times) == 7 and WINDOW_S - 0.01 <= times[-1] <= WINDOW_S + 0.3, times
