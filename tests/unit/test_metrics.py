"""Per-epoch metrics file and progress line."""

import json

from components.flowgrpo.metrics import MetricsFile, progress_line


def test_progress_line_shows_failures_and_missing_values():
    row = {"epoch": 2, "reward/mean": None, "reward/std": None, "failed_fraction": 0.25, "policy_loss": 0.5,
           "kl": 0.0, "clipfrac": 0.1, "images_per_s": 10.0, "time/sampling": 1.0, "time/scoring": 0.5,
           "time/training": 2.0}
    line = progress_line(row, 5, 75)
    assert line.startswith("epoch 2/5 reward n/a ± n/a (25% of samples failed a reward)")
    assert "eta 1m15s" in line
    assert "failed" not in progress_line({**row, "failed_fraction": 0.0, "reward/mean": 0.5}, 5, 1)


def test_metrics_file_writes_strict_json_and_truncates_on_resume(tmp_path):
    metrics = MetricsFile(tmp_path / "m.jsonl")
    for epoch in (1, 2, 3):
        metrics.append({"epoch": epoch, "reward/mean": float("nan") if epoch == 2 else 0.5})
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"epoch": 2, "reward/mean": None}
    assert [r["epoch"] for r in metrics.truncate_after(2)] == [1, 2]
    assert [r["epoch"] for r in metrics.read()] == [1, 2]
