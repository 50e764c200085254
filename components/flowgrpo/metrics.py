"""Per-epoch metrics: a JSONL file and a one-line progress report."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (the mean of a reward that failed everywhere) replaced by None,
    through nested dicts and lists, so it serialises as strict JSON."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFile:
    """``metrics.jsonl``: one JSON object per epoch, flushed as soon as the epoch ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, epoch: int) -> list[dict]:
        """Drop rows of epochs after ``epoch`` (they are re-run on resume); returns the rows kept."""
        kept = [row for row in self.read() if row["epoch"] <= epoch]
        self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        return kept

    def append(self, row: dict) -> None:
        """Non-finite values (e.g. the mean of an epoch whose rewards all failed) are written as null,
        so every line is strict JSON."""
        with self.path.open("a") as f:
            f.write(json.dumps(finite_or_none(row), allow_nan=False) + "\n")
            f.flush()


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress_line(row: dict, total_epochs: int, eta_seconds: float) -> str:
    def f(key: str, fmt: str = ".4g") -> str:
        value = row.get(key)
        return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)

    failed = row.get("failed_fraction") or 0.0
    failures = f" ({failed:.0%} of samples failed a reward)" if failed else ""
    return (
        f"epoch {row['epoch']}/{total_epochs} reward {f('reward/mean')} ± {f('reward/std', '.3g')}{failures}"
        f" | loss {f('policy_loss', '.3g')} kl {f('kl', '.3g')} clipfrac {f('clipfrac', '.3f')}"
        f" | {f('images_per_s', '.1f')} img/s | sample {f('time/sampling', '.2f')}s"
        f" score {f('time/scoring', '.2f')}s train {f('time/training', '.2f')}s | eta {_duration(eta_seconds)}"
    )


def learning_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """First-epoch mean and per-sample std, last-3-epoch mean, and whether it beat mean + std / 2."""
    first = history[0]
    nan = float("nan")
    last3 = statistics.fmean(nan if row["reward/mean"] is None else row["reward/mean"] for row in history[-3:])
    if first["reward/mean"] is None:
        return {"first_mean": nan, "first_std": nan, "last3_mean": last3, "threshold": nan, "learned": False}
    threshold = first["reward/mean"] + first["reward/std"] / 2
    return {"first_mean": first["reward/mean"], "first_std": first["reward/std"],
            "last3_mean": last3, "threshold": threshold, "learned": last3 > threshold}


def describe_learning(summary: dict[str, float]) -> str:
    """The one-line verdict `train` prints at the end."""
    s = summary
    return (f"first epoch reward mean {s['first_mean']:.6g} (per-sample std {s['first_std']:.3g}); "
            f"last 3 epochs mean {s['last3_mean']:.6g}; "
            f"{'LEARNED' if s['learned'] else 'did not learn'}: last-3 mean "
            f"{'>' if s['learned'] else '<='} first mean + std/2 = {s['threshold']:.6g}")
