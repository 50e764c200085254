"""Let a checkpoint that is being written finish before its pod goes.

Kubernetes runs a pod's preStop hook when it deletes the pod (a drained node, a preempted spot node, a scale-down)
and sends SIGTERM only once the hook returns, all within the pod's ``terminationGracePeriodSeconds``. The RayJob's
worker pods run ``python -m components.trainer.drain --timeout S`` there: it returns as soon as no checkpoint is
being written on this pod, or after S seconds. A checkpoint cut off anyway is never seen half-written (it is
published files first, then its manifest, then the ``latest`` pointer); what the drain saves is the epochs since the
previous checkpoint.

A writer marks its work with a file named after its pid under the pod's cache folder (:func:`writing`); a marker
whose process is gone (killed mid-write) counts for nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from components import environ, storage

_PREFIX = "checkpoint-writing-"


def _markers() -> Path:
    return storage.cache_root() / "drain"


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """Mark, for the pod's preStop hook, that this process is writing a checkpoint."""
    marker = _markers() / f"{_PREFIX}{os.getpid()}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def writers() -> list[int]:
    """Pids of the live processes writing a checkpoint on this pod now."""
    found = []
    for marker in _markers().glob(f"{_PREFIX}*"):
        pid = marker.name.removeprefix(_PREFIX)
        if pid.isdigit() and _alive(int(pid)):
            found.append(int(pid))
    return sorted(found)


def wait_for_writers(timeout_s: float, poll_s: float = 0.2) -> list[int]:
    """Wait until no checkpoint is being written here, at most ``timeout_s``; the writers still busy then."""
    deadline = time.monotonic() + timeout_s
    while (busy := writers()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return busy


def main(argv: list[str] | None = None) -> int:
    environ.apply_settings()  # as every entry point: it loads nothing, and never will from a hub
    parser = argparse.ArgumentParser(prog="python -m components.trainer.drain", description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, required=True, metavar="S",
                        help="seconds to wait at most (below the pod's terminationGracePeriodSeconds)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    busy = wait_for_writers(args.timeout)
    waited = time.monotonic() - started
    if busy:
        print(f"drain: a checkpoint was still being written after {waited:.1f} s (pids {busy}); the pod goes now "
              "and the run resumes from the previous checkpoint", file=sys.stderr)
    else:
        print(f"drain: no checkpoint being written (waited {waited:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
