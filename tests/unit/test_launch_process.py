"""running_process: a service that dies or never gets ready is one ServiceError with its log's end; nothing of
its process group outlives the context."""

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from components.launch.process import ServiceError, is_running, running_process


def test_exit_before_ready_reports_code_and_log(tmp_path):
    args = [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"]
    with pytest.raises(ServiceError, match=r"(?s)demo exited with 3; the end of .*bad flag --x"):
        with running_process(args, cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "demo.out", what="demo",
                             ready=lambda: False, timeout_s=30):
            pass


def test_not_ready_in_time_is_stopped(tmp_path):
    args = [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"]
    started = []
    with pytest.raises(ServiceError, match=r"(?s)demo was not ready within 0.5 s.*starting"):
        with running_process(args, cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "demo.out", what="demo",
                             ready=lambda: started.append(1) and False, timeout_s=0.5):
            pass
    assert started  # readiness was polled
    assert not [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(60)" in " ".join(p.info["cmdline"] or [])]


def test_ready_service_is_yielded_then_stopped(tmp_path):
    args = [sys.executable, "-c", "import time; time.sleep(60)"]
    with running_process(args, cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "demo.out", what="demo",
                         ready=lambda: True, timeout_s=5) as proc:
        assert proc.poll() is None
    assert proc.poll() is not None


def _status(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


def test_is_running_reads_the_command_through_a_name_with_parentheses_and_not_that_of_a_zombie(tmp_path):
    # a zombie has no command line left, and neither has a process that is still exiting (sockets open): is_running
    # tells them apart by their state
    ready = tmp_path / "ready"
    code = ("import pathlib, sys, time; pathlib.Path('/proc/self/comm').write_text('a) S (b'); "
            "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_running(child.pid, str(ready)) and not is_running(child.pid, "another command")
        assert _status(child.pid) in {psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING}
    finally:
        child.kill()
    deadline = time.monotonic() + 30
    while _status(child.pid) != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:  # killed, not yet reaped
        time.sleep(0.05)
    assert _status(child.pid) == psutil.STATUS_ZOMBIE and not is_running(child.pid, str(ready))
    child.wait()
    assert _status(child.pid) is None


def test_listens_on_sees_the_port_of_a_child_process_and_no_other(tmp_path):
    from components.launch.process import free_ports, listens_on

    port, other = free_ports(2)
    serve = (f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
             "print('up', flush=True); time.sleep(60)")
    # the listener is the child of a shell, as a server's worker is of its launcher
    args = ["/bin/sh", "-c", f'"{sys.executable}" -c "{serve}"; true']
    ready = tmp_path / "demo.out"
    with running_process(args, cwd=tmp_path, env=dict(os.environ), log_path=ready, what="demo",
                         ready=lambda: "up" in ready.read_text(), timeout_s=30, port=port) as proc:
        assert listens_on(proc.pid, port)
        assert not listens_on(proc.pid, other)
    assert not listens_on(proc.pid, port)  # gone with its process group


def test_a_port_held_by_another_process_is_no_readiness(tmp_path):
    """A server that cannot bind its port must not be taken for the one already there, which answers the same
    health check: the start fails when it exits."""
    import socket

    from components.launch.process import free_ports

    (port,) = free_ports(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        args = [sys.executable, "-c", "import time; time.sleep(1); raise SystemExit('address already in use')"]
        with pytest.raises(ServiceError, match=r"(?s)demo exited with 1.*address already in use"):
            with running_process(args, cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "demo.out",
                                 what="demo", ready=lambda: True, timeout_s=30, port=port):
                pass


# A service with a child of its own, as MLflow's server has its uvicorn: stopping it must reach the whole group.
SERVICE = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"]


def _sleeper(**kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], **kwargs)


def _group(pgid: int) -> list[int]:
    """The live (not zombie) members of process group ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return members


def _wait_for(condition, timeout_s: float) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_leased_service_runs_while_its_owner_lives_and_its_group_stops_when_the_owner_is_killed(tmp_path):
    from components.launch.process import Lease, ProcessRef, start_detached
    from components.launch.tether import POLL_S

    owner = _sleeper()  # stands for a local run; the service is started by another process, as a step starts it
    lease = Lease(ProcessRef.of(owner.pid), tmp_path / "services" / "demo.json")
    proc = start_detached(SERVICE, log_path=tmp_path / "demo.out", env=dict(os.environ), lease=lease)
    try:
        _wait_for(lambda: len(_group(proc.pid)) == 3, 30)  # the tether, the service, its child
        record = json.loads(lease.record.read_text())
        assert record == {"service": str(ProcessRef.of(proc.pid)), "owner": str(ProcessRef.of(owner.pid)),
                          "scratch": []}
        time.sleep(3 * POLL_S)
        assert len(_group(proc.pid)) == 3  # the owner lives: nothing is stopped
        owner.kill()  # SIGKILL: no cleanup of the owner's runs
        owner.wait()
        took = _wait_for(lambda: not _group(proc.pid), 15)
        assert took < POLL_S + 5, took
        assert proc.wait(timeout=5) == 128 + signal.SIGTERM  # the service's status: stopped by SIGTERM
        assert f"tether: pid {owner.pid} is gone" in (tmp_path / "demo.out").read_text()
    finally:
        owner.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_leased_running_process_is_stopped_as_any_and_its_record_removed(tmp_path):
    from components.launch.process import Lease, ProcessRef

    lease = Lease(ProcessRef.of(os.getpid()), tmp_path / "services" / "demo.json")
    with running_process(SERVICE, cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "demo.out", what="demo",
                         ready=lambda: True, timeout_s=30, lease=lease) as proc:
        assert lease.record.exists()
        _wait_for(lambda: len(_group(proc.pid)) == 3, 30)
    assert not _group(proc.pid) and not lease.record.exists()


def test_exit_status_of_a_tethered_service_is_its_own(tmp_path):
    from components.launch.process import Lease, ProcessRef, start_detached

    lease = Lease(ProcessRef.of(os.getpid()), tmp_path / "demo.json")
    proc = start_detached([sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "demo.out",
                          env=dict(os.environ), lease=lease)
    assert proc.wait(timeout=30) == 3


def test_reap_leases_stops_leftovers_of_a_dead_owner_and_nothing_else(tmp_path):
    from components.launch.process import Lease, ProcessRef, reap_leases, start_detached

    folder = tmp_path / "services"
    owner, live_owner = _sleeper(), _sleeper()
    stranger = _sleeper(start_new_session=True)  # leads a group, as a recorded service did
    kept = start_detached(SERVICE, log_path=tmp_path / "kept.out", env=dict(os.environ),
                          lease=Lease(ProcessRef.of(live_owner.pid), folder / "kept.json"))
    left = start_detached(SERVICE, log_path=tmp_path / "left.out", env=dict(os.environ),
                          lease=Lease(ProcessRef.of(owner.pid), folder / "left.json"))
    try:
        _wait_for(lambda: len(_group(left.pid)) == 3 and len(_group(kept.pid)) == 3, 30)
        left.kill()  # its tether killed too (SIGKILL to it alone): the service and its child run on in its group
        left.wait()
        owner_ref = ProcessRef.of(owner.pid)
        owner.kill()
        owner.wait()
        assert len(_group(left.pid)) == 2
        # a record whose pid another process has taken since: the start time differs, so it is not signalled
        stranger_ref = ProcessRef.of(stranger.pid)
        (folder / "reused.json").write_text(json.dumps({
            "service": str(ProcessRef(stranger.pid, stranger_ref.start + 1)), "owner": str(owner_ref)}))
        lines: list[str] = []
        reap_leases(folder, lines.append)
        assert not _group(left.pid)
        assert lines == [f"stopping left (process group {left.pid}), left running by pid {owner_ref.pid}, which is "
                         "gone"]
        assert stranger.poll() is None and len(_group(kept.pid)) == 3  # a stranger, a live owner's service: untouched
        assert sorted(p.name for p in folder.iterdir()) == ["kept.json"]
    finally:
        for proc in (owner, live_owner, stranger):
            proc.kill()
        for proc in (kept, left):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def _ticks_by_hand(pid: int) -> int:
    """The start time of ``pid`` as versions before psutil recorded it: proc(5)'s starttime, field 22 of
    /proc/PID/stat (after the name, which may hold spaces and parentheses)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def test_records_of_earlier_versions_are_reaped_as_before_or_forgotten_untouched(tmp_path):
    """A work directory may hold records of a run of an earlier version, which read start times from /proc by hand.
    Their PID:TICKS names the same process as now: the service a dead run left is stopped. A PID: (no start time,
    written where there was no /proc) cannot be told from a process that took the pid since: the record is
    forgotten and nothing it names is signalled."""
    from components.launch.process import ProcessRef, reap_leases

    folder = tmp_path / "services"
    folder.mkdir()
    owner, live, left, stranger = _sleeper(), _sleeper(), *(_sleeper(start_new_session=True) for _ in range(2))
    try:
        assert ProcessRef.parse(f"{live.pid}:{_ticks_by_hand(live.pid)}") == ProcessRef.of(live.pid)
        (folder / "left.json").write_text(json.dumps({"service": f"{left.pid}:{_ticks_by_hand(left.pid)}",
                                                      "owner": f"{owner.pid}:{_ticks_by_hand(owner.pid)}"}))
        (folder / "unknown.json").write_text(json.dumps({"service": f"{stranger.pid}:", "owner": f"{live.pid}:"}))
        with pytest.raises(ValueError):
            ProcessRef.parse(f"{live.pid}:")
        owner.kill()
        owner.wait()
        lines: list[str] = []
        reap_leases(folder, lines.append)
        assert lines == [f"stopping left (process group {left.pid}), left running by pid {owner.pid}, which is gone"]
        assert left.wait(timeout=10) == -signal.SIGTERM
        assert live.poll() is None and stranger.poll() is None and not list(folder.iterdir())
    finally:
        for proc in (owner, live, left, stranger):
            proc.kill()
            proc.wait()


# A step of a local run, as the train step is with its Ray: it leaves the run's session and starts a process that
# leads a group of its own (as Ray's workers do), out of reach of any process group or session the run knows.
STEP = [sys.executable, "-c", "import os, subprocess, sys, time; os.setsid(); subprocess.Popen([sys.executable, '-c', "
        "'import os, time; os.setpgid(0, 0); time.sleep(300)']); time.sleep(300)"]


def _leased_env(owner) -> dict[str, str]:
    from components.environ import FLOWGRPO_LEASE_OWNER

    return {**os.environ, FLOWGRPO_LEASE_OWNER.name: str(owner)}


def _scratch(folder: Path) -> Path:
    (folder / "session" / "logs").mkdir(parents=True)
    return folder


def _logging_to(log: Path) -> subprocess.Popen:
    """A process that keeps ``log`` open, its environment naming no run: a Ray process of the run that renamed itself
    (setproctitle), which can overwrite the environment /proc shows, keeping its log in Ray's temp folder."""
    return subprocess.Popen([sys.executable, "-c", "import sys, time; log = open(sys.argv[1], 'a'); time.sleep(300)",
                             str(log)])


def test_a_tether_without_a_service_stops_what_its_owner_leased_in_any_group_and_removes_its_scratch(tmp_path):
    """A local run killed outright: its steps and all they started (the kfp executor, its Ray, Ray's workers in groups
    of their own) name the run in their environment; the run's tether stops them all and removes the run's scratch
    folders. Before, nothing stopped them: the train step and its Ray trained on after a kill -9 of the run."""
    from components.launch.process import Lease, ProcessRef, leased_to, start_detached, stop_leased
    from components.launch.tether import POLL_S

    owner, other = _sleeper(), _sleeper()
    ref, other_ref = ProcessRef.of(owner.pid), ProcessRef.of(other.pid)
    earlier = ProcessRef(owner.pid, ref.start + 1)  # the same pid, another process: a run before this one
    scratch = (_scratch(tmp_path / "tmp-run"), _scratch(tmp_path / "tmp-ray"))
    # leased to nobody, to another run, to the pid's earlier run; a log open in another Ray's temp folder
    strangers = [_sleeper(), _sleeper(env=_leased_env(other_ref)), _sleeper(env=_leased_env(earlier)),
                 _logging_to(_scratch(tmp_path / "tmp-other-ray") / "session" / "logs" / "raylet.out")]
    tether = start_detached([], log_path=tmp_path / "run.log", env=dict(os.environ),
                            lease=Lease(ref, tmp_path / "services" / "run.json", scratch))
    steps = [*(subprocess.Popen(STEP, env=_leased_env(ref)) for _ in range(2)),
             _logging_to(scratch[1] / "session" / "logs" / "dashboard_agent.log")]
    try:
        _wait_for(lambda: len(leased_to(ref, scratch)) == 5, 30)  # the steps, their children, the "agent"
        time.sleep(3 * POLL_S)
        assert len(leased_to(ref, scratch)) == 5 and tether.poll() is None  # the owner lives: nothing is stopped
        owner.kill()  # SIGKILL: no cleanup of the owner's runs
        owner.wait()
        took = _wait_for(lambda: not leased_to(ref, scratch) and not any(f.exists() for f in scratch), 15)
        assert took < POLL_S + 5, took
        assert tether.wait(timeout=10) == 0
        assert f"tether: pid {owner.pid} is gone; stopping the processes it leased" in (
            tmp_path / "run.log").read_text()
        assert all(p.poll() is None for p in strangers)
    finally:
        for proc in (owner, other, tether, *strangers):
            proc.kill()
        stop_leased(ref, scratch, grace_s=1)
        for step in steps:
            step.wait(timeout=10)


def test_reap_leases_stops_what_a_dead_run_leased_and_removes_only_its_scratch(tmp_path):
    """The run's tether killed too (an OOM kill of both, a kill of its group): the next owner of the work directory
    stops what the dead run's steps started and removes its scratch folders, but not a folder a record names that is
    not one (a record is a file in the work directory, which anyone may edit), nor what a live run leased."""
    from components.launch.process import Lease, ProcessRef, leased_to, reap_leases, start_detached, stop_leased

    folder = tmp_path / "services"
    owner, live = _sleeper(), _sleeper()
    ref, live_ref = ProcessRef.of(owner.pid), ProcessRef.of(live.pid)
    scratch, notes = _scratch(tmp_path / "tmp-run"), _scratch(tmp_path / "notes")
    tether = start_detached([], log_path=tmp_path / "run.log", env=dict(os.environ),
                            lease=Lease(ref, folder / "run.json", (scratch, notes)))
    live_tether = start_detached([], log_path=tmp_path / "live.log", env=dict(os.environ),
                                 lease=Lease(live_ref, folder / "live.json"))
    steps = [subprocess.Popen(STEP, env=_leased_env(ref)), subprocess.Popen(STEP, env=_leased_env(live_ref)),
             _logging_to(scratch / "session" / "logs" / "dashboard_agent.log")]
    reader = _logging_to(notes / "session" / "logs" / "read.log")  # a folder that is no scratch: not the run's
    try:
        _wait_for(lambda: len(leased_to(ref, [scratch])) == 3 and len(leased_to(live_ref)) == 2, 30)
        tether.kill()  # the tether first: nothing is left to stop the steps
        tether.wait()
        owner.kill()
        owner.wait()
        time.sleep(1)
        left = leased_to(ref, [scratch])
        assert len(left) == 3 and scratch.exists()
        lines: list[str] = []
        reap_leases(folder, lines.append)
        assert lines == [f"stopping 3 process(es) that pid {owner.pid}, which is gone, started: {sorted(left)}"]
        assert not leased_to(ref, [scratch]) and not scratch.exists() and notes.exists()
        assert reader.poll() is None  # kept: the record named its folder, but it is no scratch folder
        assert len(leased_to(live_ref)) == 2 and live_tether.poll() is None  # a live run's: untouched
        assert sorted(p.name for p in folder.iterdir()) == ["live.json"]
    finally:
        for proc in (owner, live, tether, live_tether, reader):
            proc.kill()
        stop_leased(ref, [scratch], grace_s=1)
        stop_leased(live_ref, grace_s=1)
        for step in steps:
            step.wait(timeout=10)


def test_readiness_is_polled_every_0_2_s_up_to_the_bound(tmp_path):
    args = [sys.executable, "-c", "import time; time.sleep(60)"]
    asked = []
    with pytest.raises(ServiceError, match=r"not ready within 0\.5 s"):
        with running_process(args, cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "demo.out", what="demo",
                             ready=lambda: asked.append(time.monotonic()) and False, timeout_s=0.5):
            pass
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert asked[-1] - asked[0] >= 0.45  # not given up before the bound: the last look is past it
    assert 3 <= len(asked) <= 4 and all(gap >= 0.19 for gap in gaps), gaps


def test_a_group_that_ignores_sigterm_gets_its_grace_then_sigkill(tmp_path):
    from components.launch.process import stop_group

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline() == "up\n"  # SIGTERM is ignored from here on
    started = time.monotonic()
    assert stop_group(proc.pid, lambda: proc.poll() is None, grace_s=0.5)
    took = time.monotonic() - started
    assert proc.returncode == -9 and 0.5 <= took < 3.0, (proc.returncode, took)
