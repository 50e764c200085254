"""Local service processes (SeaweedFS, the MLflow server): free ports, start in a session of their own, wait
until ready, stop the whole process group."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from components.errors import FlowGRPOError


class ServiceError(FlowGRPOError):
    """A local service that did not start (the message carries the end of its log)."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports; all sockets are held together so no port is handed out twice."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def venv_binary(name: str, package: str) -> str:
    """The ``name`` executable that pip package ``package`` put beside this interpreter (the venv's), or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise ServiceError(f"`{name}` not found: pip install {package}")
    return found


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def running_process(args: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, what: str,
                    ready: Callable[[], bool], timeout_s: float) -> Iterator[subprocess.Popen]:
    """Start ``args`` with its output in ``log_path``, wait until ``ready()``, yield it, then stop its whole process
    group (also when it died on its own). ServiceError with the log's tail when it exits or is not ready in time."""
    # Its own session, so stopping it reaches every process it starts.
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            problem = (f"exited with {proc.returncode}" if proc.poll() is not None
                       else f"was not ready within {timeout_s:g} s" if time.monotonic() > deadline else None)
            if problem:
                tail = log_path.read_bytes()[-2000:].decode(errors="replace")
                raise ServiceError(f"{what} {problem}; the end of {log_path}:\n{tail}")
            time.sleep(0.2)
        yield proc
    finally:
        stop_process_group(proc)
        # Sweep whatever of its group outlived the leader (or a leader that died on its own).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
