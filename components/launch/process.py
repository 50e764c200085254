"""The one process runner of local runs: free ports, a process in a session of its own (so stopping it reaches
everything it starts), readiness waits, and stopping a whole process group, SIGTERM then SIGKILL.

Two lifetimes: ``running_process`` holds a service for the duration of a ``with`` block (SeaweedFS, the MLflow
server); ``start_detached`` starts one that outlives its caller (a local run's reward server, started by one
pipeline step and stopped by another) and is found again by its pid and command line.

Either can be leased to an owner (a local run): it then runs under a tether (``components.launch.tether``) that
stops it once the owner is gone, also when the owner was killed outright (SIGKILL, out of memory) and no
``finally`` of its ran, and it is recorded so that the next owner of the work directory stops it should the
tether have been killed too (``reap_leases``). The processes a local run's steps start are leased to it through
their environment (``FLOWGRPO_LEASE_OWNER``, ``leased_to``): a tether without a service of its own stops them, and
removes the run's scratch folders.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from components import environ
from components.errors import FlowGRPOError
from components.polling import Polls

STOP_GRACE_S = 10.0
TAIL_LINES = 20
# How a local run leases its services: its ProcessRef in the environment of the steps it runs (the reward server is
# started by one), the lease records in STATE_DIR/LEASES_DIR.
LEASES_DIR = "services"
# The names of a lease's scratch folders (``scratch_folders``).
SCRATCH_PREFIX = "tmp-"
# The unit of a ProcessRef's start: the clock ticks of /proc/PID/stat, which records of earlier versions hold.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# The states of a process that is no more than its exit status, waiting to be reaped.
ENDED = {psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}


class ServiceError(FlowGRPOError):
    """A local service that did not start (the message carries the end of its log)."""


@dataclass(frozen=True)
class ProcessRef:
    """A process by its pid and start time: a pid alone may have been reused by another process since."""

    pid: int
    start: int  # clock ticks after boot (``_started``)

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        """The process ``pid`` is now; psutil.NoSuchProcess when there is none."""
        return cls(pid, _started(psutil.Process(pid)))

    @classmethod
    def parse(cls, text: str) -> ProcessRef:
        """The inverse of ``str``: ``PID:START``. ValueError for anything else, among it the ``PID:`` an earlier
        version wrote where it found no /proc: a pid alone may be another process's by now."""
        pid, _, start = text.partition(":")
        return cls(int(pid), int(start))

    def __str__(self) -> str:
        return f"{self.pid}:{self.start}"

    def alive(self) -> bool:
        """Whether this very process still runs (a zombie does not)."""
        try:
            proc = psutil.Process(self.pid)
            return proc.status() not in ENDED and _started(proc) == self.start
        except psutil.Error:
            return False  # gone, or another user's: not this one


def _started(proc: psutil.Process) -> int:
    """When ``proc`` started, in clock ticks after boot (on Linux the starttime of /proc/PID/stat). Not psutil's
    create_time alone: that adds the boot time, which moves with the wall clock (NTP, a person setting it)."""
    return round((proc.create_time() - psutil.boot_time()) * CLOCK_TICKS)


@dataclass(frozen=True)
class Lease:
    """Ties a service to its ``owner``: the service runs under a tether that stops its process group once the owner
    is gone, and ``record`` (a JSON file) names both until the service is stopped, for ``reap_leases``. Without a
    service (``tethered([])``) the tether stops the processes leased to the owner (``leased_to``) and removes the
    ``scratch`` folders (``scratch_folders``)."""

    owner: ProcessRef
    record: Path
    scratch: tuple[Path, ...] = ()

    def tethered(self, args: list[str]) -> list[str]:
        folders = [arg for path in self.scratch for arg in ("--scratch", str(path))]
        return [sys.executable, "-m", "components.launch.tether", str(self.owner), *folders, "--", *args]

    def write(self, pid: int) -> None:
        self.record.parent.mkdir(parents=True, exist_ok=True)
        self.record.write_text(json.dumps({"service": str(ProcessRef.of(pid)), "owner": str(self.owner),
                                           "scratch": [str(path) for path in self.scratch]}))

    def release(self) -> None:
        self.record.unlink(missing_ok=True)


def lease_record(state_dir: Path, service: str) -> Path:
    """Where the lease of ``service`` of the work directory ``state_dir`` is recorded: in the folder the next owner
    reaps (``reap_leases(state_dir / LEASES_DIR)``)."""
    return Path(state_dir) / LEASES_DIR / f"{service}.json"


def reap_leases(folder: Path, log: Callable[[str], None]) -> None:
    """Stop the process group of every service recorded in ``folder`` whose owner is gone (left running by an owner
    killed outright, its tether killed too) and the processes leased to that owner, remove its scratch folders, and
    forget the records of services already gone. For the next owner of a work directory, before it starts
    anything."""
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            service, owner = ProcessRef.parse(record["service"]), ProcessRef.parse(record["owner"])
            scratch = scratch_folders(Path(name) for name in record.get("scratch", []))
        except (OSError, ValueError, KeyError, TypeError):
            # half written by an owner killed while writing it, or an earlier version's without start times
            path.unlink(missing_ok=True)
            continue
        if owner.alive():
            continue
        if _group_left(service):
            log(f"stopping {path.stem} (process group {service.pid}), left running by pid {owner.pid}, which is gone")
            if not stop_group(service.pid, lambda s=service: _group_left(s)):
                raise ServiceError(f"{path.stem} (process group {service.pid}) survived SIGKILL; stop it by hand")
        if left := leased_to(owner, scratch):
            log(f"stopping {len(left)} process(es) that pid {owner.pid}, which is gone, started: {sorted(left)}")
            if not stop_leased(owner, scratch):
                raise ServiceError(f"processes of pid {owner.pid} survived SIGKILL: "
                                   f"{sorted(leased_to(owner, scratch))}; stop them by hand")
        remove_scratch(scratch)
        path.unlink(missing_ok=True)


def leased_to(owner: ProcessRef, scratch: Iterable[Path] = ()) -> set[int]:
    """The pids of the processes leased to ``owner``, this one excepted: those that name it in their environment
    (``FLOWGRPO_LEASE_OWNER``, which a local run sets for its steps: its steps and all they start, however deep and
    in whatever process group or session), and those with a file open in one of its ``scratch`` folders. The
    second for Ray's processes: those that rename themselves (setproctitle: its agents, its workers) can overwrite
    the environment the system shows, and each keeps its log open in Ray's temp folder, the run's. A file open,
    not a working directory: a person's shell may be there. Nothing of another run's or of another Ray's."""
    marker = str(owner)
    folders = tuple(os.path.join(os.path.realpath(folder), "") for folder in scratch)
    pids = set()
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):  # gone, or another user's
            # the environment as exec'd: empty once a process is a zombie
            if proc.environ().get(environ.FLOWGRPO_LEASE_OWNER.name) == marker or (
                    folders and any(file.path.startswith(folders) for file in proc.open_files())):
                pids.add(proc.pid)
    return pids


def stop_leased(owner: ProcessRef, scratch: Iterable[Path] = (), grace_s: float = STOP_GRACE_S) -> bool:
    """Stop the processes leased to ``owner`` (``leased_to``), SIGTERM then SIGKILL; whether none is left."""
    folders = list(scratch)
    return stop_processes(lambda: leased_to(owner, folders), grace_s)


def stop_processes(members: Callable[[], set[int]], grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM to every pid of ``members()``, SIGKILL to those still there after ``grace_s``; ``members()`` is asked
    at every poll, so a process started meanwhile (Ray restarting a worker) is stopped too. Whether none is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        sent: set[int] = set()
        for _ in Polls(grace_s, 0.05):
            left = members()
            if not left:
                return True
            for pid in left - sent:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            sent |= left
    return not members()


def scratch_folders(folders: Iterable[Path]) -> list[Path]:
    """Those of ``folders`` that can be a lease's scratch: folders named ``SCRATCH_PREFIX``... of this user's. A
    record is a file in the work directory: the folders it names are only taken (their users stopped, the folders
    removed) when they are such."""
    found = []
    for folder in folders:
        with contextlib.suppress(OSError):
            info = folder.lstat()
            if folder.name.startswith(SCRATCH_PREFIX) and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
                found.append(folder)
    return found


def remove_scratch(folders: Iterable[Path]) -> None:
    """Remove those of ``folders`` that can be a lease's scratch (``scratch_folders``)."""
    for folder in scratch_folders(folders):
        shutil.rmtree(folder, ignore_errors=True)


def _group_left(leader: ProcessRef) -> bool:
    """Whether anything of the process group that ``leader`` started still runs (zombies do not). While any member
    does, the kernel gives no new process the group's number, so a group without its leader is still the
    leader's."""
    if leader.alive():
        return True
    with contextlib.suppress(psutil.Error):  # gone, or a zombie that no longer says when it started
        if _started(psutil.Process(leader.pid)) != leader.start:
            return False  # the pid is another process's now: the group, led by it, is not the recorded one
    return bool(group_members(leader.pid))


def group_members(pgid: int) -> set[int]:
    """The pids of process group ``pgid`` that run (zombies do not)."""
    members = set()
    for pid in psutil.pids():
        with contextlib.suppress(OSError, psutil.Error):  # gone
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() not in ENDED:
                members.add(pid)
    return members


def port_is_free(port: int) -> bool:
    """Whether a server could listen on loopback ``port`` now (as servers do, with SO_REUSEADDR: connections
    of a stopped server in TIME_WAIT do not hold the port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a process's log, indented, for an error message."""
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(f"  | {line}" for line in tail) or "  | (empty)"


def stop_group(pid: int, alive: Callable[[], bool], grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM to the process group that ``pid`` leads, SIGKILL when it is still ``alive()`` after ``grace_s``;
    whether it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not alive():
            return True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        for _ in Polls(grace_s, 0.05):
            if not alive():
                break
    return not alive()


@contextlib.contextmanager
def running_process(args: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, what: str,
                    ready: Callable[[], bool], timeout_s: float, port: int | None = None, lease: Lease | None = None
                    ) -> Iterator[subprocess.Popen]:
    """Start ``args`` with its output in ``log_path``, wait until ``ready()``, yield it, then stop its whole process
    group (also when it died on its own). ServiceError with the log's tail when it exits or is not ready in time.

    ``port``: ready also needs the process (or a child) listening there. Another server already on that port
    answers the same health check, and this one, failing to bind, would be taken for it. ``lease``: see
    ``start_detached``; released once the group is stopped."""
    proc = start_detached(args, log_path=log_path, env=env, cwd=cwd, lease=lease)
    try:
        for _ in Polls(timeout_s, 0.2):
            if ready() and (port is None or listens_on(proc.pid, port)):
                break
            if proc.poll() is not None:
                raise ServiceError(f"{what} exited with {proc.returncode}; {_log_end(log_path)}")
        else:
            raise ServiceError(f"{what} was not ready within {timeout_s:g} s; {_log_end(log_path)}")
        yield proc
    finally:
        stop_group(proc.pid, lambda: proc.poll() is None)
        # Sweep whatever of its group outlived the leader (or a leader that died on its own).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if lease is not None:
            lease.release()


def _log_end(log_path: Path) -> str:
    return f"the end of {log_path}:\n{log_tail(log_path)}"


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` or one of its descendants listens on TCP ``port``."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp")):
                return True
    return False


def start_detached(args: list[str], *, log_path: Path, env: dict[str, str], cwd: Path | None = None,
                   lease: Lease | None = None) -> subprocess.Popen:
    """Start ``args`` with its output in ``log_path``, in a session of its own: stopping its group reaches every
    process it starts, the caller's Ctrl-C does not, and it may outlive the caller (find it again with
    ``is_running(pid, marker)``). No inherited pipes: a runner reading the caller's stdout to its end would
    otherwise wait for it too.

    With a ``lease`` the process started is the tether, leading the group with ``args`` in it (its command line
    holds ``args``, its exit status is theirs), and the lease's record is written."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(lease.tethered(args) if lease else args, cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    if lease is not None:
        lease.write(proc.pid)
    return proc


def is_running(pid: int, marker: str) -> bool:
    """Whether ``pid`` still runs the command whose arguments include ``marker``: the command line is checked, as
    pids are reused, and stopping must never signal a stranger."""
    with contextlib.suppress(ChildProcessError):  # not our child: started by an earlier, finished step
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # our child, exited (now reaped)
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        if not cmdline:
            # a process that is exiting has released its memory (and with it its command line) before it closes its
            # files and sockets: it runs until the kernel makes it a zombie
            return proc.status() not in ENDED
        return marker in cmdline
    except psutil.Error:
        return False  # gone (a zombie among them), or another user's

