"""``python -m components.launch.tether PID:START -- COMMAND...``: run COMMAND until it exits or until the process
PID (started at START) is gone, then stop COMMAND's process group. How a leased service (``process.Lease``) ends
with its owner however the owner ends: a local run killed outright (SIGKILL, out of memory, a CI's timeout) runs no
cleanup of its own, and its services, in sessions of their own, would run on under PID 1.

The tether leads the service's process group (``start_detached`` gives it a session of its own), so stopping the
group the usual way (SIGTERM to the group, then SIGKILL) stops both; it exits with COMMAND's status.

``python -m components.launch.tether PID:START [--scratch FOLDER]... --``, without COMMAND, tethers the processes
leased to PID (``process.leased_to``: those naming PID in their environment, a local run's steps, the kfp executor,
the Ray it started, Ray's workers in groups of their own, and those using a FOLDER): once PID is gone it stops them
and removes the FOLDERs (the run's scratch, Ray's temp folder).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from components.launch.process import (
    ProcessRef,
    group_members,
    remove_scratch,
    scratch_folders,
    stop_group,
    stop_leased,
)

POLL_S = 0.5  # how often the owner is looked at: how late, at most, its services start stopping
USAGE = ("usage: python -m components.launch.tether PID:START -- COMMAND...\n"
         "       python -m components.launch.tether PID:START [--scratch FOLDER]... --")


def _status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode  # killed by signal N: the shell's 128 + N


def _others_run() -> bool:
    """Whether anything of the group but this tether runs: the service, or a process it started (MLflow's server
    runs uvicorn in a child)."""
    return bool(group_members(os.getpid()) - {os.getpid()})


def _parse(argv: list[str]) -> tuple[ProcessRef, list[Path], list[str]] | None:
    """(owner, scratch folders, COMMAND); None when ``argv`` does not read as USAGE says."""
    if len(argv) < 2 or "--" not in argv:
        return None
    cut = argv.index("--")
    options, command = argv[1:cut], argv[cut + 1:]
    if len(options) % 2 or any(flag != "--scratch" for flag in options[::2]) or (options and command):
        return None
    return ProcessRef.parse(argv[0]), scratch_folders(Path(folder) for folder in options[1::2]), command


def main(argv: list[str]) -> int:
    parsed = _parse(argv)
    if parsed is None:
        print(USAGE, file=sys.stderr)
        return 2
    if os.getpgrp() != os.getpid():
        print("tether: must lead its process group (start it with process.start_detached)", file=sys.stderr)
        return 2
    owner, scratch, command = parsed
    if not command:  # a SIGTERM stops this tether: nothing of its own to wait for
        while owner.alive():
            time.sleep(POLL_S)
        print(f"tether: pid {owner.pid} is gone; stopping the processes it leased", file=sys.stderr, flush=True)
        stopped = stop_leased(owner, scratch)
        remove_scratch(scratch)
        return 0 if stopped else 1
    # A SIGTERM to the group is for the service; the tether waits for it to stop. A handler, not SIG_IGN, which the
    # service would inherit.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    service = subprocess.Popen(command)
    while owner.alive():
        try:
            return _status(service.wait(timeout=POLL_S))
        except subprocess.TimeoutExpired:
            pass
    print(f"tether: pid {owner.pid} is gone; stopping {command[0]} (pid {service.pid})", file=sys.stderr, flush=True)
    stop_group(os.getpid(), _others_run)  # SIGKILL, if it comes to that, ends this tether too
    return _status(service.wait())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
