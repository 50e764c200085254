"""What `flowgrpo run --local` and `flowgrpo ui` need to own a work directory: one instance at a time, and a stop
signal that stops everything they started.

Both start SeaweedFS and MLflow over the same state; a second instance would fight the first over SeaweedFS's
leveldb lock and the MLflow port. The lock is ``flock`` on ``WORKDIR/instance.lock``: the kernel releases it when
its holder dies however it dies, so a killed instance never leaves a stale lock. The file also records the
holder's pid and command, for the message the next instance prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from components.errors import WorkdirBusy, stopped_by

LOCK_FILE = "instance.lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # the holder is between truncating and writing the record
        return {}


@contextlib.contextmanager
def holding_workdir(workdir: Path, command: str) -> Iterator[None]:
    """Hold ``workdir`` for this process while the block runs; WorkdirBusy (one line, naming the holder's pid
    and command) when another instance holds it."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the processes we start
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise WorkdirBusy(
                f"{workdir} is in use by another flowgrpo instance (pid {holder.get('pid', '?')}: "
                f"`{holder.get('command', 'flowgrpo')}`); stop it (Ctrl-C or kill {holder.get('pid', 'PID')}) "
                "or give this one another --workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def is_held_here(workdir: Path) -> bool:
    """Whether this process holds ``workdir`` (``holding_workdir``)."""
    try:
        fd = os.open(workdir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd).get("pid") == os.getpid()
    finally:
        os.close(fd)
    return False  # nobody held it (closing the descriptor released the lock just taken)


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP (a closed terminal) unwind it like Ctrl-C does (``stopped_by``),
    so the ``finally`` blocks that stop services run; further signals wait for that to finish. Ctrl-C works
    even where the shell started this process with SIGINT ignored (a background job). A no-op outside the
    main thread, where Python cannot take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    previous: dict[int, object] = {}

    def ignore(_signum: int, _frame: object) -> None:
        pass

    def stop(signum: int, _frame: object) -> None:
        # The first signal starts the cleanup; a second one (Ctrl-C pressed twice) must not cut it short. A
        # Python handler rather than SIG_IGN: an ignored signal would stay ignored in processes started meanwhile.
        for sig in previous:
            signal.signal(sig, ignore)
        raise KeyboardInterrupt if signum == signal.SIGINT else stopped_by(signum)

    for sig in (*STOP_SIGNALS, signal.SIGINT):
        previous[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
