"""Metrics rows without their wall-clock timings: what two runs that compute the same must agree on."""

TIMING_KEYS = ("time/sampling", "time/scoring", "time/training", "images_per_s")


def without_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in history]
