"""``python -m components.launch.tether PID:START -- COMMAND...``: run COMMAND until it exits or until the process
PID (started at START) is gone, then stop COMMAND's process group. How a leased service (``process.Lease``) ends
with its owner however the owner ends: a local run killed outright (SIGKILL, out of memory, a CI's timeout) runs no
cleanup of its own, and its services, in sessions of their own, would run on under PID 1.

The tether leads the service's process group (``start_detached`` gives it a session of its own), so stopping the
group the usual way (SIGTERM to the group, then SIGKILL) stops both; it exits with COMMAND's status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from components.launch.process import ProcessRef, group_members, stop_group

POLL_S = 0.5  # how often the owner is looked at: how late, at most, its services start stopping


def _status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode  # killed by signal N: the shell's 128 + N


def _others_run(service: subprocess.Popen) -> bool:
    """Whether anything of the group but this tether runs: the service, or a process it started (MLflow's server
    runs uvicorn in a child)."""
    members = group_members(os.getpid())
    return service.poll() is None if members is None else bool(members - {os.getpid()})


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m components.launch.tether PID:START -- COMMAND...", file=sys.stderr)
        return 2
    if os.getpgrp() != os.getpid():
        print("tether: must lead its process group (start it with process.start_detached)", file=sys.stderr)
        return 2
    owner = ProcessRef.parse(argv[0])
    # A SIGTERM to the group is for the service; the tether waits for it to stop. A handler, not SIG_IGN, which the
    # service would inherit.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    service = subprocess.Popen(argv[2:])
    while owner.alive():
        try:
            return _status(service.wait(timeout=POLL_S))
        except subprocess.TimeoutExpired:
            pass
    print(f"tether: pid {owner.pid} is gone; stopping {argv[2]} (pid {service.pid})", file=sys.stderr, flush=True)
    stop_group(os.getpid(), lambda: _others_run(service))  # SIGKILL, if it comes to that, ends this tether too
    return _status(service.wait())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
