"""`flowgrpo ui` and `flowgrpo run --local` own their work directory: a stop signal stops every process they
started, and a second instance is refused in one line that names the first."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from components.errors import WorkdirBusy
from components.launch.process import free_ports, port_is_free
from pipeline.single_instance import holding_workdir, is_held_here

REPO = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from pathlib import Path
from pipeline.single_instance import holding_workdir, is_held_here
with holding_workdir(Path(sys.argv[1]), "a test holder"):
    print("held", flush=True)
    time.sleep(600)
"""


def _env() -> dict[str, str]:
    drop = ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RAY_ADDRESS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _flowgrpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirBusy, match=rf"in use by another flowgrpo instance \(pid {holder.pid}: `a test "
                                              r"holder`\); stop it \(Ctrl-C or kill \d+\) or give this one"):
            with holding_workdir(tmp_path, "the second"):
                pass
    finally:
        holder.kill()  # SIGKILL: no cleanup of its own runs
        holder.wait(timeout=30)
    with holding_workdir(tmp_path, "the second"):  # the kernel released the dead holder's lock
        with pytest.raises(WorkdirBusy, match=rf"pid {os.getpid()}: `the second`"):  # and a lock is per open file
            with holding_workdir(tmp_path, "the third"):
                pass


def test_sigterm_stops_ui_and_every_process_it_started_and_a_second_instance_is_refused(tmp_path):
    workdir = tmp_path / "wd"
    (workdir / "mlflow").mkdir(parents=True)
    (workdir / "mlflow" / "mlflow.db").touch()  # an empty database: MLflow creates its tables
    (port,) = free_ports(1)
    ui = subprocess.Popen(_flowgrpo("ui", "--workdir", str(workdir), "--port", str(port)), cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in ui.stdout:
            lines.append(line)
            if line.startswith("MLflow UI: "):
                break
        assert lines[-1].startswith(f"MLflow UI: http://127.0.0.1:{port}"), "".join(lines)
        started = psutil.Process(ui.pid).children(recursive=True)
        commands = " ".join(" ".join(p.cmdline()) for p in started)
        assert "weed" in commands and "mlflow" in commands and not port_is_free(port)

        # Another instance on the same work directory, a ui or a run, is refused at once in one line.
        for args in (["ui", "--workdir", str(workdir), "--port", str(free_ports(1)[0])],
                     ["run", "--local", "--workdir", str(workdir)]):
            began = time.monotonic()
            second = subprocess.run(_flowgrpo(*args), cwd=REPO, env=_env(), capture_output=True, text=True,
                                    timeout=120)
            assert second.returncode == 2, second.stderr
            # `run` announces itself first (`local run of CONFIG in WORKDIR`); the refusal is one line
            (line,) = [line for line in second.stderr.splitlines() if not line.startswith("local run of ")]
            assert f"error: {workdir} is in use by another flowgrpo instance (pid {ui.pid}: `flowgrpo ui`)" in line
            assert time.monotonic() - began < 60  # refused before starting anything

        ui.send_signal(signal.SIGTERM)
        rest, _ = ui.communicate(timeout=90)
    finally:
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGKILL)
    assert ui.returncode == 0, rest
    assert "MLflow UI stopped" in rest
    gone = psutil.wait_procs(started, timeout=10)[1]
    assert [p.pid for p in gone if p.status() != psutil.STATUS_ZOMBIE] == []
    assert port_is_free(port)  # nothing left holding the port (or SeaweedFS's lock) for the next `flowgrpo ui`


# `flowgrpo run --local` in a process that notes every process it starts and what it imported
SECOND_RUN = """
import json, subprocess, sys, time
started = []
popen_init = subprocess.Popen.__init__
def noting(self, args, *rest, **kwargs):
    started.append(str(args))
    popen_init(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = noting
from pipeline.cli import main
began = time.monotonic()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.monotonic() - began, "started": started,
                  "heavy": sorted(m for m in ("torch", "kfp", "ray", "mlflow", "diffusers") if m in sys.modules)}))
"""


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_second_run_is_refused_before_it_reads_its_config_or_starts_anything(tmp_path):
    """Before, a second `run --local` was refused after 35 s and 438 MB: it read the config and imported the trainer
    (torch) first. Now the work directory is the first thing it takes: a config that does not exist is not even
    looked at."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not is_held_here(tmp_path)  # held, by another process
        before = _snapshot(tmp_path)
        second = subprocess.run([sys.executable, "-c", SECOND_RUN, "run", "--local", "--workdir", str(tmp_path),
                                 "--config", str(tmp_path / "no-such-config.yaml")],
                                cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert second.stderr == (f"flowgrpo run: error: {tmp_path} is in use by another flowgrpo instance (pid "
                             f"{holder.pid}: `a test holder`); stop it (Ctrl-C or kill {holder.pid}) or give this "
                             "one another --workdir\n")
    result = json.loads(second.stdout)
    assert result["code"] == 2 and result["started"] == [] and result["heavy"] == []
    assert result["seconds"] < 1.0, result
    assert _snapshot(tmp_path) == before  # nothing written, not even the lock file's record


def test_is_held_here_inside_this_process_holding_only(tmp_path):
    assert not is_held_here(tmp_path)  # no lock file yet
    with holding_workdir(tmp_path, "this test"):
        assert is_held_here(tmp_path)
    assert not is_held_here(tmp_path)  # the file stays, unlocked
