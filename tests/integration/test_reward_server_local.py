"""The reward server as a local process: really started, scored over HTTP, reused, stopped, and its failures."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from components.errors import LaunchError
from components.launch.local import RECORDS, start_local, stop_all_local, stop_local
from pipeline.config import TINY_CONFIG, load_config


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (an orphan whose new parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _png_b64(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def state_dir(tmp_path):
    yield tmp_path
    stop_all_local(tmp_path, lambda _: None)  # nothing outlives a failed test


def _record(state_dir, name):
    return json.loads((state_dir / RECORDS / f"{name}.json").read_text())


def test_start_scores_reuses_and_stop_kills_the_process_group(state_dir):
    config = load_config(TINY_CONFIG)  # brightness
    lines: list[str] = []
    url = start_local(config, name="rs-a", state_dir=state_dir, timeout_s=60, log=lines.append)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    record = _record(state_dir, "rs-a")
    pid = record["pid"]
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # its own session and group
    assert httpx.get(f"{url}/readyz").json() == {"ready": True}

    rng = np.random.default_rng(0)
    images = [np.full((8, 8, 3), (200, 100, 50), dtype=np.uint8), rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)]
    # Brightness is the mean ITU-R BT.601 luma over 255, computed here pixel by pixel.
    expected = [sum(0.299 * int(r) + 0.587 * int(g) + 0.114 * int(b) for r, g, b in im.reshape(-1, 3)) / 64 / 255
                for im in images]
    response = httpx.post(f"{url}/v1/score", json={"prompts": ["a", "b"], "images": [_png_b64(i) for i in images]})
    assert response.status_code == 200, response.text
    assert response.json()["results"]["brightness"]["scores"] == pytest.approx(expected, abs=1e-9)
    assert expected[0] == pytest.approx(124.2 / 255)

    again: list[str] = []
    assert start_local(config, name="rs-a", state_dir=state_dir, log=again.append) == url
    assert _record(state_dir, "rs-a")["pid"] == pid and "reused" in again[-1]

    stop_local("rs-a", state_dir, lines.append)
    assert _gone(pid) and not (state_dir / RECORDS / "rs-a.json").exists()
    assert not [p for p in psutil.process_iter() if _pgid(p.pid) == pid and not _gone(p.pid)]  # nor its group
    assert lines[-1] == f"reward server rs-a (pid {pid}) stopped"
    stop_local("rs-a", state_dir, lines.append)  # a second stop: nothing to do
    assert (state_dir / RECORDS / "rs-a.log").exists()  # the log stays for inspection


def test_the_server_survives_the_process_that_started_it(state_dir):
    """The deploy step is a short-lived process; the teardown step, another one, stops the server."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from components.launch.local import start_local
        from pipeline.config import TINY_CONFIG, load_config
        print(start_local(load_config(TINY_CONFIG), name="rs-b", state_dir=Path({str(state_dir)!r}), timeout_s=60,
                          log=lambda _: None))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    url = proc.stdout.strip()
    assert httpx.get(f"{url}/readyz").status_code == 200
    pid = _record(state_dir, "rs-b")["pid"]
    stop_local("rs-b", state_dir, lambda _: None)
    assert _gone(pid)


def test_settings_changed_under_the_same_name_restart_the_server(state_dir):
    start_local(load_config(TINY_CONFIG), name="rs-c", state_dir=state_dir, timeout_s=60, log=lambda _: None)
    pid = _record(state_dir, "rs-c")["pid"]
    second = start_local(load_config(TINY_CONFIG, ["rewards.0.label=luma"]), name="rs-c", state_dir=state_dir,
                         timeout_s=60, log=lambda _: None)
    assert _gone(pid) and _record(state_dir, "rs-c")["pid"] != pid
    assert [r["key"] for r in httpx.get(f"{second}/v1/rewards").json()["rewards"]] == ["luma"]


def test_an_unknown_reward_fails_with_the_log_and_leaves_no_process(state_dir):
    # an import path passes the config's check (only the process that scores imports it); the server fails on it
    lines: list[str] = []
    with pytest.raises(LaunchError) as info:
        start_local(load_config(TINY_CONFIG, ["rewards.0.name=no_such_module:Reward"]), name="rs-d",
                    state_dir=state_dir, timeout_s=60, log=lines.append)
    message = str(info.value)
    assert "reward server rs-d exited with code 2 before it was ready" in message
    assert "cannot import reward 'no_such_module:Reward'" in message  # from the log's tail
    pid = int(re.search(r"\(pid (\d+)", lines[0]).group(1))
    assert _gone(pid) and not (state_dir / RECORDS / "rs-d.json").exists()


def test_a_reward_that_fails_to_load_fails_fast(state_dir):
    # Its arguments are valid (the config loads); the model they name is missing, which only loading tells.
    overrides = ["rewards=[{name: clip_score, args: {model_path: /no/such/clip}}]"]
    lines: list[str] = []
    with pytest.raises(LaunchError) as info:
        start_local(load_config(TINY_CONFIG, overrides), name="rs-e", state_dir=state_dir, timeout_s=60,
                    log=lines.append)
    assert "could not load its rewards" in str(info.value) and "/no/such/clip does not exist" in str(info.value)
    assert _gone(int(re.search(r"\(pid (\d+)", lines[0]).group(1)))


def test_a_server_started_for_a_run_stops_when_the_run_is_killed_outright(state_dir):
    """A local run's deploy step starts the server for the run (run_local puts the run in the steps' environment);
    the run killed by SIGKILL (out of memory, a CI's timeout) runs no cleanup, and the server stops on its own."""
    from components.launch.tether import POLL_S

    step = textwrap.dedent(f"""
        from pathlib import Path
        from components.launch.local import start_local
        from pipeline.config import TINY_CONFIG, load_config
        print(start_local(load_config(TINY_CONFIG), name="rs-f", state_dir=Path({str(state_dir)!r}), timeout_s=60,
                          log=lambda _: None))
    """)
    run = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from components.environ import FLOWGRPO_LEASE_OWNER, patched_environ
        from components.launch.process import ProcessRef
        with patched_environ({{FLOWGRPO_LEASE_OWNER.name: str(ProcessRef.of(os.getpid()))}}):
            subprocess.run([sys.executable, "-c", {step!r}], check=True)
        print("deployed", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert proc.stdout.readline() == "deployed\n", url
        pid = _record(state_dir, "rs-f")["pid"]
        assert httpx.get(f"{url}/readyz").status_code == 200
        time.sleep(3 * POLL_S)
        assert httpx.get(f"{url}/readyz").status_code == 200  # the step is gone, the run is not: still serving
        proc.kill()
        proc.wait()
        started = time.monotonic()
        while not _gone(pid) and time.monotonic() - started < 30:
            time.sleep(0.05)
        took = time.monotonic() - started
        assert _gone(pid) and took < POLL_S + 5, took
        assert not [p for p in psutil.process_iter() if _pgid(p.pid) == pid and not _gone(p.pid)]  # nor its group
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/readyz")
    finally:
        proc.kill()
