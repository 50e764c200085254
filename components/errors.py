"""Exceptions a user can act on. The CLI prints their message as one line and exits non-zero."""

import signal
import sys
from collections.abc import Callable


class FlowGRPOError(Exception):
    """Base class for errors caused by input the user controls."""


class ConfigError(FlowGRPOError):
    """An experiment config that cannot be read or does not validate."""


class ModelLoadError(FlowGRPOError):
    """A model that cannot be built or loaded."""


class DataError(FlowGRPOError):
    """Prompts or other data that cannot be used."""


class RewardError(FlowGRPOError):
    """A reward that cannot be built or that failed where failure is not allowed."""


class CheckpointError(FlowGRPOError):
    """A checkpoint that is missing, incomplete or does not match the config."""


class LaunchError(FlowGRPOError):
    """A cluster launch that cannot be built, submitted or that did not finish successfully."""


class TrackingError(FlowGRPOError):
    """An MLflow server that cannot be reached or refuses work that has no other place to go (a replay)."""


class RunOutputError(FlowGRPOError):
    """A run output (config.yaml, metrics.jsonl, samples/, lora/) that is missing or cannot be read."""


class WorkdirBusy(FlowGRPOError):
    """A work directory another flowgrpo instance is using."""


EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def stopped_by(signum: int) -> KeyboardInterrupt:
    """The exception a stop signal (SIGTERM, SIGHUP) unwinds with, so every cleanup Ctrl-C runs runs: a plain
    KeyboardInterrupt, not a subclass (the standard library tests for that exact type: ``subprocess.Popen``
    would otherwise wait for its child forever), carrying the signal for the exit status."""
    exc = KeyboardInterrupt(signal.Signals(signum).name)
    exc.signum = signum
    return exc


def exit_status(prog: str, main: Callable[[], int]) -> int:
    """Run an entry point's ``main``: a FlowGRPOError becomes one line on stderr and exit 2, Ctrl-C exit 130, a
    stop signal 128 + its number."""
    try:
        return main()
    except FlowGRPOError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as exc:
        if (signum := getattr(exc, "signum", None)) is not None:  # see stopped_by
            print(f"{prog}: stopped by {signal.Signals(signum).name}; checkpoints written so far are kept",
                  file=sys.stderr)
            return 128 + signum  # the shell's convention for a process ended by that signal
        print(f"{prog}: interrupted; checkpoints written so far are kept", file=sys.stderr)
        return EXIT_INTERRUPTED
