"""Launching on this machine: a run's reward server as a local process (the stand-in for the Kubernetes
Deployment) and training on local Ray Train workers (the stand-in for the RayJob).

The deploy step is a short-lived process (a kfp.local task), so the server is started detached and recorded in
``<state_dir>/reward-servers/<name>.json``; the teardown step, another process, reads the record to stop it. The
same settings YAML as on a cluster, minus the judge rewiring: a local vlm_judge keeps the base_url of the config.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from components import environ
from components.console import status_line
from components.errors import LaunchError
from components.launch.kubernetes.reward_deploy import DeployableConfig, reward_server_name
from components.launch.process import (
    Lease,
    ProcessRef,
    free_ports,
    is_running,
    lease_record,
    log_tail,
    start_detached,
    stop_group,
)
from components.reward_server.settings import settings_yaml

if TYPE_CHECKING:
    from components.trainer.config import TrainingJobConfig

Log = Callable[[str], None]
RECORDS = "reward-servers"
# /readyz's 503 detail while the rewards load (components/reward_server/app.py); any other detail is the error
# that stopped them from loading, and waiting longer cannot help.
LOADING = "rewards are still loading"
POLL_S = 0.2


def _folder(state_dir: Path) -> Path:
    return Path(state_dir) / RECORDS


def _read(state_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((_folder(state_dir) / f"{name}.json").read_text())
    except FileNotFoundError:
        return None


def _lease(state_dir: Path, name: str) -> Lease | None:
    """The lease of a server started by a step of a local run (``FLOWGRPO_LEASE_OWNER``): it stops when the run is
    gone."""
    owner = environ.FLOWGRPO_LEASE_OWNER.get()
    return Lease(ProcessRef.parse(owner), _lease_record(state_dir, name)) if owner else None


def _lease_record(state_dir: Path, name: str) -> Path:
    return lease_record(state_dir, f"reward-server-{name}")


def _alive(record: dict[str, Any]) -> bool:
    return is_running(record["pid"], record["config"])


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


def start_local(config: DeployableConfig, *, name: str, state_dir: Path, timeout_s: float | None = None,
                log: Log = status_line) -> str:
    """Start ``python -m components.reward_server`` for the training rewards on a free 127.0.0.1 port, wait for
    /readyz and return its URL. A server of that name already running with the same settings is reused; one with
    other settings is replaced. On failure (exit, load error, ``timeout_s``, default
    ``reward_deploy.ready_timeout_s``) the process is stopped and ``LaunchError`` carries the end of its log. Started
    by a step of a local run, the server is leased to the run (``FLOWGRPO_LEASE_OWNER``): it stops when the run is
    gone."""
    folder = _folder(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    deploy = config.reward_deploy
    text = settings_yaml(config.rewards, deploy.limits, deploy.batching)
    digest = hashlib.sha256(text.encode()).hexdigest()
    record = _read(state_dir, name)
    if record is not None:
        if record["settings_sha256"] == digest and _alive(record) and _readiness(record["url"]) is True:
            log(f"reward server {name} already running at {record['url']} (pid {record['pid']}): reused")
            return record["url"]
        stop_local(name, state_dir, log)  # dead, stuck or serving other settings
    settings, log_path = folder / f"{name}.yaml", folder / f"{name}.log"
    settings.write_text(text)
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    proc = start_detached([sys.executable, "-m", "components.reward_server", "--config", str(settings),
                           "--host", "127.0.0.1", "--port", str(port)],
                          log_path=log_path, env=os.environ | environ.entry_settings(), lease=_lease(state_dir, name))
    record = {"pid": proc.pid, "url": url, "log": str(log_path), "config": str(settings), "settings_sha256": digest}
    (folder / f"{name}.json").write_text(json.dumps(record, indent=2))
    log(f"reward server {name} starting at {url} (pid {proc.pid}, log {log_path})")
    timeout_s = deploy.ready_timeout_s if timeout_s is None else timeout_s
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
        raise LaunchError(f"reward server {name} {problem}; the end of {log_path}:\n{log_tail(log_path)}")
    log(f"reward server {name} ready at {url} after {time.monotonic() - start:.1f} s")
    return url


def stop_local(name: str, state_dir: Path, log: Log = status_line) -> None:
    """Stop the recorded server ``name`` (its whole process group) and forget it; no record or a process already
    gone is fine. Its log stays."""
    record = _read(state_dir, name)
    if record is None:
        return
    pid, running = record["pid"], _alive(record)
    if not stop_group(pid, lambda: _alive(record)):
        raise LaunchError(f"reward server {name} (pid {pid}) survived SIGKILL; stop it by hand")
    (_folder(state_dir) / f"{name}.json").unlink(missing_ok=True)
    _lease_record(state_dir, name).unlink(missing_ok=True)
    log(f"reward server {name} (pid {pid}) {'stopped' if running else 'was not running'}")


def stop_all_local(state_dir: Path, log: Log = status_line) -> None:
    """Stop every recorded server (Ctrl-C cleanup of a local run)."""
    folder = _folder(state_dir)
    for record in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        stop_local(record.stem, state_dir, log)


class LocalLauncher:
    """Starts a run's parts on this machine; ``state_dir`` keeps the records of what it started. Names are the
    cluster's (``reward_server_name``), so a local run's read the same."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)

    def start_reward_server(self, config: DeployableConfig, run_id: str, log: Log = status_line) -> str:
        return start_local(config, name=reward_server_name(run_id), state_dir=self.state_dir, log=log)

    def stop_reward_server(self, config: DeployableConfig, run_id: str, log: Log = status_line) -> None:
        stop_local(reward_server_name(run_id), self.state_dir, log=log)

    def train(self, config: TrainingJobConfig, output: str, *, run_id: str, parent_run_id: str | None, workers: int,
              log: Log = status_line) -> None:
        """Train in this process (``workers`` 0) or on that many local Ray Train workers; a retried step
        continues from the newest checkpoint in ``output``."""
        from components.trainer.training_run import train

        train(config, output, resume="auto", parent_run_id=parent_run_id, workers=workers, log=log)
