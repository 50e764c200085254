"""Run the reward server for real (uvicorn on a loopback port) inside the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from components.reward_server.app import create_app
from components.reward_server.settings import ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(settings: ServerSettings, wait_ready: bool = True, timeout_s: float = 60) -> Iterator[str]:
    """Yields the base URL; waits for /readyz (or only /healthz with ``wait_ready=False``)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    path = "/readyz" if wait_ready else "/healthz"
    try:
        while True:
            try:
                if httpx.get(url + path, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"reward server not {'ready' if wait_ready else 'up'} after {timeout_s}s")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
