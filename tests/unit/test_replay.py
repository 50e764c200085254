"""Reading a run output back for an MLflow replay: what it finds, and what it refuses with one line."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from components.errors import RunOutputError
from components.tracking.replay import metric_timestamps
from components.trainer.run_output import read_finished_run


def test_epoch_timestamps_are_the_start_plus_the_running_sum_of_the_epoch_timings():
    rows = [{"epoch": 1, "time/sampling": 1.5, "time/scoring": 0.25, "time/training": 2.0},
            {"epoch": 2, "time/sampling": 1.0, "time/scoring": None, "time/training": 0.5}]
    assert metric_timestamps(rows, 10_000) == [10_000 + 3_750, 10_000 + 3_750 + 1_500]


def _output(root: Path, metrics: str = '{"epoch": 1, "reward/mean": 0.5}\n') -> Path:
    root.mkdir()
    (root / "config.yaml").write_text("seed: 3\ntracking: {experiment: x, registered_model: null}\n")
    (root / "metrics.jsonl").write_text(metrics)
    (root / "samples").mkdir()
    for epoch in (10, 2):
        Image.fromarray(np.full((4, 4, 3), epoch, np.uint8)).save(root / "samples" / f"epoch-{epoch:06d}.png")
    (root / "samples" / "notes.txt").write_text("not a grid")
    return root


def test_an_output_is_read_with_its_grids_by_epoch_and_without_a_lora_when_the_run_did_not_finish(tmp_path):
    run = read_finished_run(_output(tmp_path / "out"))
    assert run.config["seed"] == 3 and run.metrics == [{"epoch": 1, "reward/mean": 0.5}]
    assert [(e, p.name) for e, p in run.samples] == [(2, "epoch-000002.png"), (10, "epoch-000010.png")]
    assert run.lora_dir is None and run.latest_checkpoint is None
    assert run.lineage == {} and run.started_at_ms is None  # written before run.json: nothing invented


@pytest.mark.parametrize(("break_it", "needle"), [
    (lambda root: (root / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2, \n'),
     "metrics.jsonl line 2 is not JSON"),
    (lambda root: (root / "metrics.jsonl").write_text('{"reward/mean": 1}\n'), "line 1 has no integer 'epoch'"),
    (lambda root: (root / "samples" / "epoch-000002.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20),
     "epoch-000002.png is not a readable PNG"),
    (lambda root: (root / "config.yaml").write_text("- a list\n"), "config.yaml is not a mapping"),
    (lambda root: (root / "run.json").write_text("{"), "run.json is unreadable"),
    (lambda root: (root / "config.yaml").unlink(), "is not a run output: it has no config.yaml"),
])
def test_a_damaged_output_is_refused_naming_the_file(tmp_path, break_it, needle):
    root = _output(tmp_path / "out")
    break_it(root)
    with pytest.raises(RunOutputError, match=needle):
        read_finished_run(root)


def test_run_json_gives_the_lineage_and_start(tmp_path):
    root = _output(tmp_path / "out")
    (root / "run.json").write_text(json.dumps({"lineage": {"flowgrpo.git_commit": "abc"}, "started_at_ms": 7}))
    run = read_finished_run(root)
    assert run.lineage == {"flowgrpo.git_commit": "abc"} and run.started_at_ms == 7
