"""Run the reward server for real (uvicorn on a loopback port) inside the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn

from components.reward_server.app import create_app
from components.reward_server.settings import ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ok(url: str, timeout_s: float, dead: Callable[[], str | None] = lambda: None,
                  interval_s: float = 0.1) -> None:
    """Poll ``url`` until it answers 200. ``dead()`` returns a message when the server's process has
    exited, to stop waiting at once; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = dead()
        if message:
            raise RuntimeError(message)
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g}s")


@contextlib.contextmanager
def running_server(settings: ServerSettings, wait_ready: bool = True, timeout_s: float = 60) -> Iterator[str]:
    """Yields the base URL; waits for /readyz (or only /healthz with ``wait_ready=False``)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(url + ("/readyz" if wait_ready else "/healthz"), timeout_s, interval_s=0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
