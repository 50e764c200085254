"""Per-epoch metrics file and progress line."""

import json
import math

import numpy as np
import pytest

from components.trainer.metrics import (
    EpochEta,
    MetricsFile,
    describe_learning,
    learning_summary,
    progress_line,
    reward_trend,
)


def test_progress_line_shows_failures_and_missing_values():
    row = {"epoch": 2, "reward/mean": None, "reward/std": None, "failed_fraction": 0.25, "policy_loss": 0.5,
           "kl": 0.0, "clipfrac": 0.1, "images_per_s": 10.0, "time/sampling": 1.0, "time/scoring": 0.5,
           "time/training": 2.0}
    line = progress_line(row, 5, 75)
    assert line.startswith("epoch 2/5 reward n/a ± n/a (25% of samples failed a reward)")
    assert "eta 1m15s" in line
    assert "failed" not in progress_line({**row, "failed_fraction": 0.0, "reward/mean": 0.5}, 5, 1)


def _eta_lines(clock_at_ends: list[float], total: int, first_epoch: int = 0) -> list[float | None]:
    times = iter([0.0, *clock_at_ends])  # the clock when the estimator starts, then at each epoch's end
    eta = EpochEta(total, first_epoch, clock=lambda: next(times))
    next(times)
    return [eta.after(first_epoch + i + 1) for i in range(len(clock_at_ends))]


def test_the_warm_up_epoch_gives_no_eta_and_counts_in_none():
    # epoch 1 takes 300 s (model load, compile, the base grid), the next ones 10, 10, 16 s: 20 epochs in all
    assert _eta_lines([300, 310, 320, 336], total=20) == [None, 10 * 18, 10 * 17, 12 * 16]
    # a resumed run warms up again, on its first epoch after the checkpoint
    assert _eta_lines([200, 205, 215], total=10, first_epoch=6) == [None, 5 * 2, 7.5 * 1]
    assert _eta_lines([300], total=1) == [0.0]  # a one-epoch run: nothing left
    row = {"epoch": 1, "reward/mean": 0.5}
    assert progress_line(row, 20, None).endswith("| eta after epoch 2")
    assert progress_line({**row, "epoch": 2}, 20, 180.0).endswith("| eta 3m00s")


def test_metrics_file_writes_strict_json_and_truncates_on_resume(tmp_path):
    metrics = MetricsFile(tmp_path / "m.jsonl")
    for epoch in (1, 2, 3):
        metrics.append({"epoch": epoch, "reward/mean": float("nan") if epoch == 2 else 0.5})
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"epoch": 2, "reward/mean": None}
    assert [r["epoch"] for r in metrics.truncate_after(2)] == [1, 2]
    assert [r["epoch"] for r in metrics.read()] == [1, 2]


def test_progress_line_shows_what_moves_and_hides_what_does_not():
    row = {"epoch": 5, "reward/mean": 0.30, "reward/std": 0.2, "update/advantage_abs_mean": 0.71,
           "grad_norm": 0.84, "policy_loss": 1e-6, "kl": 0.0, "clipfrac": 0.0, "images_per_s": 12.0,
           "time/sampling": 1.0, "time/scoring": 0.5, "time/training": 2.0, "heldout/geneval/mean": 0.41}
    line = progress_line(row, 80, 10, first_mean=0.25)
    assert "reward 0.300 ± 0.2 (+0.050 since epoch 1)" in line
    assert "held-out geneval 0.410" in line and "|adv| 0.71 grad 0.84" in line
    assert "loss" not in line and "kl" not in line and "clipfrac" not in line  # zero or ~0 by construction
    acting = progress_line({**row, "kl": 0.02, "clipfrac": 0.125}, 80, 10, first_mean=0.25)
    assert "clipfrac 0.125 kl 0.02" in acting
    assert "since epoch 1" not in progress_line({**row, "epoch": 1}, 80, 10, first_mean=0.30)


def _history(values):
    return [{"epoch": i + 1, "reward/mean": v, "reward/std": 0.1} for i, v in enumerate(values)]


def test_reward_trend_is_the_least_squares_slope_with_its_standard_error():
    rng = np.random.default_rng(0)
    y = 0.3 + 0.002 * np.arange(1, 41) + rng.normal(0, 0.02, 40)
    slope, low, high = reward_trend(_history(y.tolist()))
    # independently: numpy's least squares and the textbook standard error of a slope
    x = np.arange(1, 41, dtype=float)
    (b, _), residuals, *_ = np.polyfit(x, y, 1, full=True)
    se = np.sqrt(residuals[0] / (len(x) - 2) / ((x - x.mean()) ** 2).sum())
    assert slope == pytest.approx(b, rel=1e-9)
    assert (low, high) == pytest.approx((b - 1.959964 * se, b + 1.959964 * se), rel=1e-5)
    assert all(math.isnan(v) for v in reward_trend(_history([0.1, 0.2])))


def test_the_verdict_is_the_trend_and_names_the_held_out_figures():
    rising = learning_summary(_history([0.30, 0.31, 0.30, 0.33, 0.34, 0.35, 0.36]))
    flat = learning_summary(_history([0.30, 0.35, 0.28, 0.33, 0.29, 0.34, 0.30]))
    assert rising["learned"] and rising["slope_low"] > 0
    assert not flat["learned"] and flat["slope_low"] < 0 < flat["slope_high"]
    assert "LEARNED" in describe_learning(rising) and "did not learn" in describe_learning(flat)
    rows = _history([0.30, 0.31, 0.32, 0.33])
    rows[0]["heldout/geneval/base"] = 0.25
    rows[1]["heldout/geneval/mean"], rows[3]["heldout/geneval/mean"] = 0.27, 0.31
    summary = learning_summary(rows)
    assert (summary["heldout/geneval/base"], summary["heldout/geneval/last"]) == (0.25, 0.31)
    line = describe_learning(summary)
    assert "geneval 0.25 at epoch 0 -> 0.31 at epoch 4" in line and "held-out evaluation" in line
