"""Per-epoch metrics: a JSONL file and a one-line progress report."""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HELDOUT = re.compile(r"^heldout/.+/mean$")


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


class EpochEta:
    """The time a run has left, from the mean of its epochs after the first this process runs: that one also
    loads the model, compiles and samples the base model's grid, and made the first estimates many times too long
    (71 min said after epoch 1 of a 5-minute run)."""

    def __init__(self, total_epochs: int, first_epoch: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.first, self.clock = total_epochs, first_epoch, clock
        self.warm: float | None = None  # when the warm-up epoch ended

    def after(self, epoch: int) -> float | None:
        """Seconds left once ``epoch`` has ended; None after the warm-up epoch when more follow (unknown yet)."""
        now = self.clock()
        if self.warm is None:
            self.warm = now
            return 0.0 if epoch >= self.total else None
        return (now - self.warm) / (epoch - self.first - 1) * (self.total - epoch)


def progress_line(row: dict, total_epochs: int, eta_seconds: float | None, first_mean: float | None = None) -> str:
    """One epoch's line: the signals that move (the reward and its change since the first epoch, the held-out
    reward when the epoch sampled it, the advantages' size, the gradient norm); clipping and KL only when they
    act, the loss never (with group-normalised advantages it is ~0 by construction). ``eta_seconds`` None: the
    epoch warmed up, the estimate comes with the next one."""
    def f(key: str, fmt: str = ".4g") -> str:
        value = row.get(key)
        return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)

    failed = row.get("failed_fraction") or 0.0
    failures = f" ({failed:.0%} of samples failed a reward)" if failed else ""
    mean = row.get("reward/mean")
    change = (f" ({mean - first_mean:+.3f} since epoch 1)" if first_mean is not None and mean is not None
              and math.isfinite(mean) and math.isfinite(first_mean) and row["epoch"] > 1 else "")
    heldout = "".join(f" | held-out {key[8:-5]} {f(key, '.3f')}" for key in row if _HELDOUT.match(key))
    acting = "".join(f" {name} {f(key, fmt)}" for name, key, fmt in (("clipfrac", "clipfrac", ".3f"),
                                                                     ("kl", "kl", ".3g"))
                     if (row.get(key) or 0) > 0)
    eta = f"eta after epoch {row['epoch'] + 1}" if eta_seconds is None else f"eta {_duration(eta_seconds)}"
    return (
        f"epoch {row['epoch']}/{total_epochs} reward {f('reward/mean', '.3f')} ± {f('reward/std', '.3g')}{change}"
        f"{failures}{heldout} | |adv| {f('update/advantage_abs_mean', '.3g')} grad {f('grad_norm', '.3g')}{acting}"
        f" | {f('images_per_s', '.1f')} img/s | sample {f('time/sampling', '.2f')}s"
        f" score {f('time/scoring', '.2f')}s train {f('time/training', '.2f')}s | {eta}"
    )


def reward_trend(history: list[dict[str, Any]], key: str = "reward/mean",
                 level: float = 0.95) -> tuple[float, float, float]:
    """Least-squares slope of ``key`` per epoch and its CI (normal quantile of the slope's standard error);
    NaNs with fewer than 3 finite epochs. Epochs are not independent (the policy carries over), so the CI is
    a guide to whether the curve rises, not a test."""
    points = [(float(row["epoch"]), float(row[key])) for row in history
              if row.get(key) is not None and math.isfinite(row[key])]
    nan = float("nan")
    if len(points) < 3:
        return nan, nan, nan
    n = len(points)
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in points)
    half = statistics.NormalDist().inv_cdf((1 + level) / 2) * math.sqrt(residual / (n - 2) / sxx)
    return slope, slope - half, slope + half


def learning_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """First-epoch mean and per-sample std, last-3-epoch mean, the training reward's trend per epoch with its
    95% CI, and ``learned``: the trend's CI lies above 0. Also the held-out reward of the fixed sample prompts
    at the start and at the last epoch that sampled them, per reward, when the run sampled them."""
    first = history[0]
    nan = float("nan")
    last3 = statistics.fmean(nan if row["reward/mean"] is None else row["reward/mean"] for row in history[-3:])
    slope, low, high = reward_trend(history)
    out = {"first_mean": nan if first["reward/mean"] is None else first["reward/mean"],
           "first_std": nan if first["reward/std"] is None else first["reward/std"], "last3_mean": last3,
           "epochs": len(history), "slope": slope, "slope_low": low, "slope_high": high, "learned": low > 0}
    for key, value in first.items():
        if key.startswith("heldout/") and key.endswith("/base") and value is not None:
            name = key[8:-5]
            last = [row for row in history if row.get(f"heldout/{name}/mean") is not None]
            if last:
                out[f"heldout/{name}/base"] = value
                out[f"heldout/{name}/last"] = last[-1][f"heldout/{name}/mean"]
                out[f"heldout/{name}/last_epoch"] = last[-1]["epoch"]
    return out


def describe_learning(summary: dict[str, float]) -> str:
    """The verdict `train` prints at the end: what the training reward did (on the training prompts, with the
    sampler's noise), the held-out sample prompts' reward, and where the verdict that counts is."""
    s = summary
    verdict = ("LEARNED: the trend's CI is above 0" if s["learned"] else
               "did not learn: the trend's CI includes 0 or lies below it")
    line = (f"training reward (training prompts): first epoch {s['first_mean']:.4g} (per-sample std "
            f"{s['first_std']:.3g}), last 3 epochs {s['last3_mean']:.4g}; trend {s['slope']:+.3g}/epoch "
            f"(95% CI [{s['slope_low']:+.3g}, {s['slope_high']:+.3g}]) over {s['epochs']} epochs; {verdict}")
    heldout = [f"{k[8:-5]} {v:.4g} at epoch 0 -> {s[k[:-5] + '/last']:.4g} at epoch {s[k[:-5] + '/last_epoch']}"
               for k, v in s.items() if k.startswith("heldout/") and k.endswith("/base")]
    if heldout:
        line += f". Sample grid prompts (held out, fixed noise): {'; '.join(heldout)}"
    return line + ". The held-out evaluation (`flowgrpo evaluate`, the pipeline's evaluate step) decides."
