"""Status lines for people: one line on stderr, flushed at once so progress shows through pipes and in pods."""

import sys


def status_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
