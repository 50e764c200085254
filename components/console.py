"""Status lines for people: one line on stderr, flushed at once so progress shows through pipes and in pods."""

import logging
import os
import sys


def status_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """Keep library chatter (torchvision fallbacks, dtype notes) out of the progress output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for name in ("transformers", "diffusers", "peft", "mlflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
