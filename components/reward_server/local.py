"""A run's reward server as a local process: the local pipeline's stand-in for the Kubernetes Deployment.

The deploy step is a short-lived process (a kfp.local task), so the server is started detached (its own session,
no inherited pipes) and recorded in ``<state_dir>/reward-servers/<name>.json``; the teardown step, another
process, reads the record to stop it. The same settings YAML as on a cluster (deploy.settings_yaml), minus the
judge rewiring: a local vlm_judge keeps the base_url of the config.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from components.console import status_line
from components.errors import LaunchError
from components.reward_server.deploy import DeployableConfig, settings_yaml

RECORDS = "reward-servers"
# /readyz's 503 detail while the rewards load (components/reward_server/app.py); any other detail is the error
# that stopped them from loading, and waiting longer cannot help.
LOADING = "rewards are still loading"
STOP_GRACE_S = 10.0
POLL_S = 0.2
TAIL_LINES = 20


def _folder(state_dir: Path) -> Path:
    return Path(state_dir) / RECORDS


def _read(state_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((_folder(state_dir) / f"{name}.json").read_text())
    except FileNotFoundError:
        return None


def _alive(record: dict[str, Any]) -> bool:
    """Whether the recorded server still runs. Where /proc exists, the pid must still run that server's command
    line: pids are reused, and stopping must never signal a stranger."""
    pid = record["pid"]
    with contextlib.suppress(ChildProcessError):  # not our child: started by an earlier, finished step
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # our child, exited (now reaped)
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        return record["config"] in (Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"))
    except OSError:
        return True  # no /proc (macOS): the pid is all there is to check


def _readiness(url: str) -> bool | str:
    """True when ready; False while starting or loading; the load error when the rewards failed to load."""
    try:
        response = httpx.get(f"{url}/readyz", timeout=2.0)
    except httpx.HTTPError:
        return False
    if response.status_code == 200:
        return True
    try:
        detail = str(response.json().get("detail"))
    except ValueError:
        return False
    return False if detail == LOADING else detail


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(f"  | {line}" for line in lines) or "  | (empty)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_local(config: DeployableConfig, *, name: str, state_dir: Path, timeout_s: float | None = None,
                log: Callable[[str], None] = status_line) -> str:
    """Start ``flowgrpo reward-server`` for the training rewards on a free 127.0.0.1 port, wait for /readyz and
    return its URL. A server of that name already running with the same settings is reused; one with other
    settings is replaced. On failure (exit, load error, ``timeout_s``, default ``reward_deploy.ready_timeout_s``)
    the process is stopped and ``LaunchError`` carries the end of its log."""
    folder = _folder(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    text = settings_yaml(config)
    digest = hashlib.sha256(text.encode()).hexdigest()
    record = _read(state_dir, name)
    if record is not None:
        if record["settings_sha256"] == digest and _alive(record) and _readiness(record["url"]) is True:
            log(f"reward server {name} already running at {record['url']} (pid {record['pid']}): reused")
            return record["url"]
        stop_local(name, state_dir, log)  # dead, stuck or serving other settings
    settings, log_path = folder / f"{name}.yaml", folder / f"{name}.log"
    settings.write_text(text)
    url = f"http://127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "pipeline.cli", "reward-server", "--config", str(settings),
               "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]]
    with log_path.open("wb") as out:
        # Own session: Ctrl-C in the caller's terminal and the caller's exit do not reach it. No inherited pipes:
        # a runner reading the caller's stdout to its end would otherwise wait for the server too.
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | {"HF_HUB_OFFLINE": "1"}, start_new_session=True)
    record = {"pid": proc.pid, "url": url, "log": str(log_path), "config": str(settings), "settings_sha256": digest}
    (folder / f"{name}.json").write_text(json.dumps(record, indent=2))
    log(f"reward server {name} starting at {url} (pid {proc.pid}, log {log_path})")
    timeout_s = config.reward_deploy.ready_timeout_s if timeout_s is None else timeout_s
    start = time.monotonic()
    while (state := _readiness(url)) is not True:
        if proc.poll() is not None:
            problem = f"exited with code {proc.returncode} before it was ready"
        elif state:
            problem = f"could not load its rewards: {state}"
        elif time.monotonic() - start > timeout_s:
            problem = f"was not ready after {timeout_s:.0f} s"
        else:
            time.sleep(POLL_S)
            continue
        stop_local(name, state_dir, log)
        raise LaunchError(f"reward server {name} {problem}; the end of {log_path}:\n{_tail(log_path)}")
    log(f"reward server {name} ready at {url} after {time.monotonic() - start:.1f} s")
    return url


def stop_local(name: str, state_dir: Path, log: Callable[[str], None] = status_line) -> None:
    """Stop the recorded server ``name`` (SIGTERM to its process group, SIGKILL after STOP_GRACE_S) and forget it;
    no record or a process already gone is fine. Its log stays."""
    record = _read(state_dir, name)
    if record is None:
        return
    pid, running = record["pid"], _alive(record)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if _alive(record):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)  # the group: anything the server started goes too
            deadline = time.monotonic() + STOP_GRACE_S
            while _alive(record) and time.monotonic() < deadline:
                time.sleep(0.05)
    if _alive(record):
        raise LaunchError(f"reward server {name} (pid {pid}) survived SIGKILL; stop it by hand")
    (_folder(state_dir) / f"{name}.json").unlink(missing_ok=True)
    log(f"reward server {name} (pid {pid}) {'stopped' if running else 'was not running'}")


def stop_all_local(state_dir: Path, log: Callable[[str], None] = status_line) -> None:
    """Stop every recorded server (Ctrl-C cleanup of a local run)."""
    folder = _folder(state_dir)
    for record in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        stop_local(record.stem, state_dir, log)
