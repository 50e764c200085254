"""A real reward-server process (`python -m components.reward_server`, default limits) under hostile load: a flood
of bodies at and over the size cap full of short strings, and slow clients (slowloris headers and bodies). The
server stays responsive, its memory stays within the bound its limits state, and slow connections are closed."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import yaml
from servers import free_port, running_server, wait_until_ok

from components.reward_server.gate import HELD_BODIES_PER_SLOT
from components.reward_server.settings import Limits, ServerSettings
from components.rewards.codec import encode_png_b64
from components.rewards.registry import RewardSpec

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits()  # what the server runs with: the defaults
HEALTHZ_S = 1.0  # the most a /healthz may take while the server is under any of the loads below
SLACK_S = 5.0  # how late past its stated timeout a slow connection may be closed, on a loaded 2-core machine
IMAGE = encode_png_b64(np.full((8, 8, 3), 100, np.uint8))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, psutil.Process]]:
    config = tmp_path_factory.mktemp("hostile") / "server.yaml"
    config.write_text(yaml.safe_dump({"rewards": [{"name": "brightness"}]}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "components.reward_server", "--config", str(config),
                             "--port", str(port), "--log-level", "warning"], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(f"{url}/readyz", 60, dead=lambda: proc.poll() is not None and "exited")
        yield url, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _sized(head: bytes, item: bytes, tail: bytes, size: int) -> bytes:
    """``head`` + items joined by commas + ``tail``, ``size`` bytes long (a space pads the last bytes)."""
    n = (size - len(head) - len(tail) + 1) // (len(item) + 1)
    body = head + b",".join([item] * n) + tail
    return body.replace(head, head + b" " * (size - len(body)), 1)


def _distinct_keys(head: bytes, tail: bytes, size: int) -> bytes:
    """An object of ~7-character distinct keys: what costs a JSON parser most per byte."""
    n = (size - len(head) - len(tail)) // 12
    body = head + b",".join(b'"%07x":0' % i for i in range(n)) + tail
    return body.replace(head, head + b" " * (size - len(body)), 1)


class _Watch:
    """Polls /healthz and samples the server's RSS in the background: the slowest answer and the peak."""

    def __init__(self, url: str, process: psutil.Process) -> None:
        self.url, self.process = url, process
        self.slowest, self.peak_mib, self.failed = 0.0, 0.0, []
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._health), threading.Thread(target=self._memory)]

    def _health(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._done.is_set():
                start = time.perf_counter()
                try:
                    if client.get(f"{self.url}/healthz").status_code != 200:
                        self.failed.append("not 200")
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                self.slowest = max(self.slowest, time.perf_counter() - start)
                time.sleep(0.05)

    def _memory(self) -> None:
        while not self._done.is_set():
            self.peak_mib = max(self.peak_mib, self.process.memory_info().rss / 2**20)
            time.sleep(0.01)

    def __enter__(self) -> _Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for t in self._threads:
            t.join()


def test_a_flood_of_bodies_at_and_over_the_cap_is_refused_with_health_answering_and_memory_bounded(server):
    url, process = server
    cap = LIMITS.max_body_bytes
    assert cap == 4 * LIMITS.max_request_pixels + 2**20 == 17 * 2**20  # derived from the pixel budget
    head = b'{"prompt": ["a"], "image": ["' + IMAGE.encode() + b'"], '
    flood = {  # six at once, as in the probe (57 MB bodies of short strings to /compute)
        "over the cap, declared": (_sized(head + b'"junk": [', b'"ab"', b"]}", cap + 2**20), 413, "max_body_bytes"),
        "over the cap, declared (2)": (_sized(head + b'"junk": [', b'"ab"', b"]}", 57 * 10**6), 413, "max_body_bytes"),
        "over the cap, chunked": (_sized(head + b'"junk": [', b'"ab"', b"]}", cap + 2**20), 413, "max_body_bytes"),
        "at the cap, short strings in an unknown field": (
            _sized(head + b'"junk": [', b'"ab"', b"]}", cap), 413, "max_json_values"),
        "at the cap, short keys in an unknown field": (_distinct_keys(head + b'"junk": {', b"}}", cap), 413,
                                                       "max_json_values"),
        "at the cap, short strings in a known field": (
            _sized(head + b'"kwargs": {"k": [', b'"ab"', b"]}}", cap), 413, "max_json_values"),
    }
    assert [len(body) <= cap for body, _, _ in flood.values()] == [False] * 3 + [True] * 3

    def send(name: str) -> httpx.Response:
        body = flood[name][0]
        content = iter([body[i:i + 2**20] for i in range(0, len(body), 2**20)]) if "chunked" in name else body
        with httpx.Client(timeout=120) as client:
            return client.post(f"{url}/compute", content=content, headers={"content-type": "application/json"})

    with httpx.Client() as client:  # warm: the first request's imports and allocations are not the flood's
        assert client.post(f"{url}/compute", json={"prompt": ["a"], "image": [IMAGE]}).status_code == 200
    baseline = process.memory_info().rss / 2**20
    with _Watch(url, process) as watch, ThreadPoolExecutor(len(flood)) as pool:
        responses = dict(zip(flood, pool.map(send, flood), strict=True))
    for name, (_, status, needle) in flood.items():
        r = responses[name]
        assert r.status_code == status and needle in r.json()["error"], (name, r.text)
    assert watch.slowest < HEALTHZ_S and not watch.failed, (watch.slowest, watch.failed)
    # bodies held at once: those sent, at most HELD_BODIES_PER_SLOT x max_concurrent_requests; a bytearray's
    # growth slack, the connections' buffers and the interpreter's arenas on top
    held = min(len(flood), HELD_BODIES_PER_SLOT * LIMITS.max_concurrent_requests) * cap / 2**20
    assert watch.peak_mib - baseline < 1.25 * held + 64, (baseline, watch.peak_mib, held)


@pytest.mark.parametrize("path", ["/compute", "/v1/score"])
def test_an_unknown_field_is_refused_naming_it(server, path):
    url, _ = server
    body = {"prompt": ["a"], "image": [IMAGE]} if path == "/compute" else {"prompts": ["a"], "images": [IMAGE]}
    r = httpx.post(f"{url}{path}", json={**body, "junk": "x" * 100_000})
    assert r.status_code == 422, r.text
    assert "body.junk: Extra inputs are not permitted" in r.json()["error" if path == "/compute" else "detail"]


def _read_until_closed(sock: socket.socket, received: dict[socket.socket, bytes]) -> bool:
    """Adds what the server sent on ``sock`` to ``received``; whether the server has closed it."""
    while select.select([sock], [], [], 0)[0]:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return True
        if not chunk:
            return True
        received[sock] = received.get(sock, b"") + chunk
    return False


def test_slow_clients_are_closed_while_others_are_served(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    slow_headers, slow_bodies = [], []
    for _ in range(20):  # slowloris: a request line and a partial header, then a byte every 2 s
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow_headers.append(sock)
    kept = socket.create_connection((host, int(port)))  # a kept-alive connection whose next request is slow
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in kept.recv(65536)
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    slow_headers.append(kept)
    for _ in range(3):  # complete headers, then a body at a byte every 2 s
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        slow_bodies.append(sock)
    start = time.monotonic()
    closed_at: dict[socket.socket, float] = {}
    sent: dict[socket.socket, bytes] = {}
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as client:
        # while they are open, a normal client is served, and /healthz answers at once
        served = pool.submit(client.post, f"{url}/v1/score", json={"prompts": ["a"], "images": [IMAGE]})
        deadline = start + max(LIMITS.request_head_timeout_s, LIMITS.body_grace_s) + SLACK_S
        tick = 0
        while len(closed_at) < len(slow_headers) + len(slow_bodies) and time.monotonic() < deadline:
            for sock in slow_headers + slow_bodies:
                if sock not in closed_at and _read_until_closed(sock, sent):
                    closed_at[sock] = time.monotonic() - start
                elif sock not in closed_at and tick % 8 == 0:  # a byte every 2 s
                    with contextlib.suppress(OSError):
                        sock.sendall(b"a")
            if tick % 4 == 0:
                started = time.perf_counter()
                assert client.get(f"{url}/healthz").status_code == 200
                assert time.perf_counter() - started < HEALTHZ_S
            tick += 1
            time.sleep(0.25)
        assert served.result().status_code == 200
    for sock in slow_headers + slow_bodies:
        sock.close()
    header_times = sorted(closed_at.get(s, float("inf")) for s in slow_headers)
    body_times = sorted(closed_at.get(s, float("inf")) for s in slow_bodies)
    for times, timeout in ((header_times, LIMITS.request_head_timeout_s), (body_times, LIMITS.body_grace_s)):
        assert timeout - 0.5 <= times[0] and times[-1] <= timeout + SLACK_S, (timeout, times)
    for sock in slow_bodies:  # told why before being closed
        assert sent.get(sock, b"").startswith(b"HTTP/1.1 408 ") and b"limits.min_body_bytes_per_s" in sent[sock]


def test_bodies_held_are_bounded_and_a_body_still_arriving_holds_no_slot():
    limits = Limits(max_body_bytes=64 * 1024, max_concurrent_requests=1)  # bodies held: 2 x 1 x 64 KiB at most
    with running_server(ServerSettings(rewards=[RewardSpec(name="brightness")], limits=limits)) as url:
        host, port = url.removeprefix("http://").split(":")
        arriving = []
        for _ in range(2):  # 50 KB of a 60 KB body each, the rest to come
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 60000\r\n\r\n" + b" " * 50_000)
            arriving.append(sock)
        time.sleep(0.5)
        body = {"prompts": ["a"], "images": [IMAGE]}
        started = time.perf_counter()
        small = httpx.post(f"{url}/v1/score", json=body, timeout=30)  # the one slot is free: served at once
        assert small.status_code == 200 and time.perf_counter() - started < HEALTHZ_S
        big = httpx.post(f"{url}/v1/score", json={**body, "prompts": ["a" * 40_000]}, timeout=30)
        assert big.status_code == 503 and big.headers["retry-after"] == "1", big.text
        assert "near its bound of 131072" in big.json()["detail"]
        for sock in arriving:
            sock.close()
        time.sleep(0.5)
        assert httpx.post(f"{url}/v1/score", json={**body, "prompts": ["a" * 40_000]}, timeout=30).status_code == 200


def _endless_chunked(host: str, port: int, request: bytes, give_up: int) -> tuple[int, bytes]:
    """Sends ``request`` then 1 MiB chunks of a body that never ends, until the server closes the connection (or
    ``give_up`` bytes are sent); (body bytes sent, every byte the server sent)."""
    chunk = b"%x\r\n" % 2**20 + b" " * 2**20 + b"\r\n"
    sent, received = 0, b""
    with socket.create_connection((host, port), timeout=10) as sock:  # a server that neither reads nor closes: fail
        sock.sendall(request + b"Transfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < give_up:
                sock.sendall(chunk)
                sent += len(chunk)
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(65536):
                received += data
    return sent, received


@pytest.mark.parametrize(("request_head", "status"), [
    (b"POST /compute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n", b"413"),
    (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n", b"413"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n", b"200"),  # a route that reads no body
])
def test_a_body_that_never_ends_is_answered_and_no_more_of_it_is_read(server, request_head, status):
    """The server answers (413 over max_body_bytes; a route without a body at once), closes the connection and
    stops reading: the client can send little more than the cap and the sockets' buffers. Before, it read on, 8 GiB
    in 10 s, until the header timeout closed the connection."""
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    sent, received = _endless_chunked(host, int(port), request_head, give_up=2**30)
    took = time.monotonic() - started
    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 " + status), received[:300]
    assert status == b"200" or b"connection: close" in head.split(b"\r\n")
    # loopback buffers hold a few MiB each way (net.ipv4.tcp_wmem / tcp_rmem): 32 MiB past what the server read
    read_at_most = (LIMITS.max_body_bytes if status == b"413" else 0) + 32 * 2**20
    assert sent < read_at_most and took < SLACK_S, (sent, took)
