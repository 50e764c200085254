"""What a run across hosts relies on in one process: the pod drain that lets a checkpoint finish, the command a
stopped run prints to resume, and how a lost Ray node is told from a live one."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from components.trainer import drain
from components.trainer.entry import resume_command
from components.trainer.ray_train import _node_state


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGRPO_CACHE_DIR", str(tmp_path / "cache"))


def _write_for(seconds: float, cache_dir: str) -> None:
    os.environ["FLOWGRPO_CACHE_DIR"] = cache_dir
    with drain.writing():
        time.sleep(seconds)


def _writer(seconds: float, tmp_path) -> multiprocessing.Process:
    """A process writing a checkpoint for ``seconds``, returned once its mark is there."""
    writer = multiprocessing.get_context("spawn").Process(target=_write_for, args=(seconds, str(tmp_path / "cache")))
    writer.start()
    deadline = time.monotonic() + 30
    while not drain.writers() and time.monotonic() < deadline:
        time.sleep(0.05)
    return writer


def test_the_drain_waits_for_a_checkpoint_being_written_and_no_longer(tmp_path):
    writer = _writer(2.0, tmp_path)
    assert drain.writers() == [writer.pid]
    started = time.monotonic()
    assert drain.wait_for_writers(30) == []  # the writer finished: nothing left busy
    waited = time.monotonic() - started
    writer.join()
    assert 0.5 < waited < 10  # it waited for the write (2 s from its start), not for the 30 s bound
    assert drain.writers() == []


def test_a_writer_killed_mid_checkpoint_does_not_hold_the_drain(tmp_path):
    writer = _writer(60.0, tmp_path)
    assert drain.writers() == [writer.pid]
    writer.kill()
    writer.join()
    marker = tmp_path / "cache" / "drain" / f"checkpoint-writing-{writer.pid}"
    assert marker.exists()  # a kill -9 leaves its marker behind
    started = time.monotonic()
    assert drain.wait_for_writers(30) == []
    assert time.monotonic() - started < 1


def test_the_drain_gives_up_at_its_timeout_and_the_command_exits_0(tmp_path):
    with drain.writing():
        started = time.monotonic()
        assert drain.wait_for_writers(0.5) == [os.getpid()]
        assert 0.5 <= time.monotonic() - started < 3
        out = subprocess.run([sys.executable, "-m", "components.trainer.drain", "--timeout", "0.3"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "still being written after" in out.stderr  # the pod must go on terminating
    out = subprocess.run([sys.executable, "-m", "components.trainer.drain", "--timeout", "5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "no checkpoint being written" in out.stderr


@pytest.mark.parametrize(("argv", "expected"), [
    (["/venv/bin/python3", "-m", "components.trainer", "--config", "env:X", "--output", "s3://b/r", "--ray-workers",
      "2", "--auto-resume"],
     "python3 -m components.trainer --config env:X --output s3://b/r --ray-workers 2 --resume"),
    (["/venv/bin/python", "/venv/bin/flowgrpo", "train", "--config", "my run.yaml", "a=1", "--ray-workers", "4"],
     "python /venv/bin/flowgrpo train --config 'my run.yaml' a=1 --ray-workers 4 --resume"),
    (["flowgrpo", "train", "--resume", "--output", "o"], "flowgrpo train --output o --resume"),
])
def test_the_resume_command_is_the_command_line_with_resume(argv, expected):
    assert resume_command(argv) == expected


def test_a_node_is_dead_unreachable_or_up():
    with socket.create_server(("127.0.0.1", 0)) as server:
        up = {"Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": server.getsockname()[1]}
        assert _node_state(up) == "up"
    closed = dict(up)  # nothing listens there any more: a raylet that is gone
    assert _node_state(closed) == "unreachable"
    assert _node_state({**up, "Alive": False}) == "dead"


class _SlowStartingRay:
    """A stand-in for the ``ray`` module whose local start fails ``failures`` times as Ray's does when its raylet
    does not register in time, then succeeds; it records the GCS address each start was given."""

    TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
               "startup or the GCS has become overloaded.")

    def __init__(self, failures: int, error: str = TIMEOUT) -> None:
        self.failures, self.error = failures, error
        self.addresses: list[str] = []
        self.shutdowns = 0
        self.util = type("util", (), {"get_node_ip_address": staticmethod(lambda: "127.0.0.1")})

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.addresses.append(os.environ["RAY_ADDRESS"])
        if len(self.addresses) <= self.failures:
            raise Exception(self.error)

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_local_ray_that_times_out_at_start_is_started_again_and_the_third_timeout_is_one_clear_error(monkeypatch):
    from components.trainer.ray_train import LocalRayStartError, _ray_session

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    lines: list[str] = []
    ray, ran = _SlowStartingRay(failures=2), []
    with _ray_session(ray, lines.append):
        ran.append(os.environ["RAY_ADDRESS"])
    assert len(ray.addresses) == 3 and ray.shutdowns == 2 and ran == ray.addresses[-1:]
    assert [line.split(":")[0] for line in lines] == ["the local Ray did not start (try 1 of 3",
                                                      "the local Ray did not start (try 2 of 3"]
    assert "RAY_ADDRESS" not in os.environ  # restored after the session

    ray, ran = _SlowStartingRay(failures=3), []
    with pytest.raises(LocalRayStartError, match=r"did not start in 3 tries .* the machine is likely too busy"):
        with _ray_session(ray, lines.append):
            ran.append(True)
    assert ran == [] and len(ray.addresses) == 3 and ray.shutdowns == 3

    ray = _SlowStartingRay(failures=1, error="some other start failure")  # not retried: not a busy machine's
    with pytest.raises(Exception, match="some other start failure"):
        with _ray_session(ray, lines.append):
            ran.append(True)
    assert ran == [] and len(ray.addresses) == 1 and ray.shutdowns == 0
