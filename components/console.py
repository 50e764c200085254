"""Status lines for people: one line on stderr, flushed at once so progress shows through pipes and in pods."""

import logging
import sys

from components import environ


def status_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """Keep library chatter (torchvision fallbacks, dtype notes) out of the progress output."""
    environ.TRANSFORMERS_VERBOSITY.set_default()
    environ.DIFFUSERS_VERBOSITY.set_default()
    for name in ("transformers", "diffusers", "peft", "mlflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
