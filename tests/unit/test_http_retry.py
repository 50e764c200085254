"""The shared retry helper against a real local HTTP server that answers from a script."""

import asyncio
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

    def do_GET(self):
        status, headers = self.replies.pop(0) if self.replies else (200, {})
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
    _Script.seen = []
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
