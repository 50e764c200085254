"""bench_algorithms.py's arithmetic on made-up runs, against numbers worked out by hand: the held-out curve's clock
and images, the mean over seeds with its t-interval, the time to a target gain, the report and the plot."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_algorithms as bench

T_975_2DF = 4.302652729911275  # Student's t, 97.5th percentile, 2 degrees of freedom (a table's value)


def _history(base: float, gains: dict[int, float], epochs: int, seconds: float) -> list[dict]:
    """Rows as the trainer writes them: each epoch's phase times, the grid's held-out mean where it was sampled."""
    rows = []
    for epoch in range(1, epochs + 1):
        row = {"epoch": epoch, "time/sampling": seconds / 2, "time/scoring": seconds / 4,
               "time/training": seconds / 4}
        if epoch in gains:
            row[f"heldout/{bench.REWARD}/mean"] = base + gains[epoch]
        rows.append(row)
    rows[0][f"heldout/{bench.REWARD}/base"] = base
    return rows


def test_t_interval_is_the_mean_and_the_t_quantile_times_the_standard_error():
    mean, low, high = bench.t_interval([1.0, 2.0, 3.0])  # mean 2, sample std 1
    assert mean == 2.0
    assert low == pytest.approx(2 - T_975_2DF / math.sqrt(3)) and high == pytest.approx(2 + T_975_2DF / math.sqrt(3))
    single = bench.t_interval([0.5])
    assert single[0] == 0.5 and math.isnan(single[1]) and math.isnan(single[2])


def test_the_curve_counts_training_minutes_and_images_from_epoch_zero():
    c = bench.curve(_history(0.3, {2: 0.05, 4: 0.1}, epochs=4, seconds=30.0), images_per_epoch=64)
    assert list(c["minutes"]) == [0.0, 1.0, 2.0]  # 2 and 4 epochs of 30 s
    assert list(c["images"]) == [0, 128, 256]
    assert c["gain"] == pytest.approx([0.0, 0.05, 0.1])
    planned = bench.curve(_history(0.3, {2: 0.05, 4: 0.1}, epochs=4, seconds=30.0), 64, epoch_seconds=6.0)
    assert list(planned["minutes"]) == [0.0, 0.2, 0.4]  # 2 and 4 epochs of the planned 6 s, whatever the rows say


def test_reach_is_where_the_seeds_mean_gain_first_meets_the_target():
    # two seeds whose gain grows linearly to 0.1 and 0.3 in 2 minutes: the mean is 0.1 per minute
    runs = [bench.curve(_history(0.2, {4: g}, epochs=4, seconds=30.0), 64) for g in (0.1, 0.3)]
    assert bench.reach_minutes(runs, 0.15) == pytest.approx(1.5, abs=2 / 199)  # the 200-point grid's spacing
    assert math.isnan(bench.reach_minutes(runs, 0.25))
    mean, low, high = bench.band(runs, "minutes", np.array([2.0]))
    half = 12.706204736174707 * 0.1  # t(0.975, 1 df) x the standard error: std 0.1414 / sqrt 2
    assert mean[0] == pytest.approx(0.2) and (low[0], high[0]) == pytest.approx((0.2 - half, 0.2 + half))


def test_report_and_plot_show_every_algorithm(tmp_path, capsys):
    def run(seed: int, gain: float, partial: float, strict: float) -> dict:
        rewards = {bench.REWARD: {"delta": partial, "ci_low": partial - 0.02, "ci_high": partial + 0.02},
                   bench.STRICT: {"delta": strict, "ci_low": strict - 0.05, "ci_high": strict + 0.05}}
        return {"seed": seed, "history": _history(0.25, {2: gain / 2, 4: gain}, 4, 30.0), "eval": {"rewards": rewards}}

    results = {"flow_grpo": [run(0, 0.08, 0.06, 0.01), run(1, 0.10, 0.07, 0.0)],
               "diffusion_nft": [run(0, 0.16, 0.09, 0.08), run(1, 0.20, 0.11, 0.04)]}
    bench.report(results, {"flow_grpo": 4, "diffusion_nft": 4}, 64)
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    # flow_grpo: final gains 0.08, 0.10 -> 0.09; diffusion_nft's mean gain 0.09 per minute reaches it at 1.0 of 2.0
    assert "+0.090" in rows["flow_grpo"] and "0.250 -> 0.340" in rows["flow_grpo"]
    assert "1.0 (0.50x)" in rows["diffusion_nft"] and "+0.100" in rows["diffusion_nft"]  # eval partial mean
    assert "3 of 4" in rows["diffusion_nft"]  # per-run CIs above 0: both partial, one strict (0.08 - 0.05)
    losing = {"flow_grpo": [run(0, -0.02, 0.0, 0.0), run(1, -0.04, 0.0, 0.0)],
              "diffusion_nft": results["diffusion_nft"]}
    bench.report(losing, {"flow_grpo": 4, "diffusion_nft": 4}, 64)
    losing_rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
                   if line.startswith("| ")}
    assert losing_rows["diffusion_nft"].rstrip().endswith("| - |")  # no time to reach a reference that lost ground
    # neither mean eval delta (0.065, 0.100) reaches the demo's 150-epoch gain
    assert "reached (mean eval delta at or above it) by: none; the best is diffusion_nft, +0.100" in out
    bench.plot(results, 64, tmp_path / "curves.png")
    from PIL import Image

    with Image.open(tmp_path / "curves.png") as image:
        assert image.size == (1210, 440)  # 11 x 4 inches at 110 dpi


def test_epochs_are_measured_once_per_workdir_and_reused_by_later_seeds(tmp_path, monkeypatch):
    seconds = {"flow_grpo": 3.5, "diffusion_nft": 2.9, "grpo_guard": 5.0}
    measured = []

    def epoch_seconds(algorithms: list[str], _overrides: list[str]) -> dict[str, float]:
        measured.append(algorithms)
        return {a: seconds[a] for a in algorithms}

    monkeypatch.setattr(bench, "epoch_seconds", epoch_seconds)
    args = SimpleNamespace(algorithms=["flow_grpo", "diffusion_nft"], minutes=2.0, smoke=False, demo_fraction=None)
    assert bench.plan_epochs(args, [], tmp_path) == {"flow_grpo": 34, "diffusion_nft": 41}  # 120 / 3.5, 120 / 2.9
    assert bench.plan_epochs(args, [], tmp_path) == {"flow_grpo": 34, "diffusion_nft": 41}
    assert measured == [["flow_grpo", "diffusion_nft"]]  # side by side, once; the second call read DIR/epochs.json
    with pytest.raises(SystemExit, match="epochs of 2 min"):
        bench.plan_epochs(SimpleNamespace(**{**vars(args), "minutes": 12.0}), [], tmp_path)
    # an algorithm added later is measured beside the first planned one, on a machine now twice as slow
    seconds.update(flow_grpo=7.0, grpo_guard=10.0)
    later = bench.plan_epochs(SimpleNamespace(**{**vars(args), "algorithms": ["grpo_guard", "flow_grpo"]}), [],
                              tmp_path)
    assert measured[-1] == ["flow_grpo", "grpo_guard"]
    assert later == {"grpo_guard": 24, "flow_grpo": 34}  # 10 s x (3.5 / 7) = 5 s then: 120 / 5


def test_a_budget_of_half_the_demo_is_half_its_epochs_of_its_own_algorithm(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "epoch_seconds", lambda algorithms, _o: {"flow_grpo": 2.0, "diffusion_nft": 1.2})
    args = SimpleNamespace(algorithms=["flow_grpo"], minutes=12.0, smoke=False, demo_fraction=0.5)
    # the demo: 150 epochs of 1.2 s = 3 min; half of it, 1.5 min = 90 s, is 45 epochs of 2 s
    assert bench.plan_epochs(args, [], tmp_path) == {"flow_grpo": 45}
    assert json.loads((tmp_path / bench.PLAN_FILE).read_text())["minutes"] == pytest.approx(1.5)


def test_every_registered_algorithm_is_benchmarked_on_the_demo_and_at_real_shape():
    """An algorithm added as one module (docs/DESIGN.md) is missed here until the benchmark selects it."""
    from bench_gpu_throughput import ALGORITHM_RECIPES

    from components.algorithms.base import algorithms
    from pipeline.config import load_config

    def selected(overrides: list[str]) -> str:
        return next((o.split("=", 1)[1] for o in overrides if o.startswith("train.algorithm=")), "flow_grpo")

    assert set(algorithms()) <= {selected(o) for o in bench.ALGORITHMS.values()}
    assert set(bench.ALGORITHMS) == set(ALGORITHM_RECIPES)
    for name, (recipe, overrides) in ALGORITHM_RECIPES.items():
        assert load_config(recipe, overrides).train.algorithm == selected(bench.ALGORITHMS[name]), name


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "gpu"])
def test_every_algorithms_throughput_workload_selects_it_at_its_published_settings(cpu):
    """The smoke run measures three algorithms; each one's workload (its recipe and overrides) loads here, on the
    CPU stand-in and at the GPU shape, and selects what its name says."""
    import bench_gpu_throughput as gpu

    selected = {"flow_grpo": "flow_grpo", "grpo_guard": "flow_grpo", "diffusion_nft": "diffusion_nft",
                "mix_grpo": "mix_grpo", "mix_grpo_flash": "mix_grpo", "dance_grpo": "flow_grpo", "awm": "awm",
                "dpo": "dpo"}
    assert set(gpu.ALGORITHM_RECIPES) == set(selected) == set(bench.ALGORITHMS)
    for algorithm, key in selected.items():
        config = gpu.workload(cpu, False, algorithm=algorithm)
        assert config.train.algorithm == key, algorithm
        assert config.train.grpo_guard == (algorithm == "grpo_guard")
        assert (config.sampling.sde_type == "dance") == (algorithm == "dance_grpo")
        assert (config.train.mix_grpo.ode_solver == "dpm2") == (algorithm == "mix_grpo_flash")
        assert config.model.kind == ("tiny-sd3" if cpu else "diffusers")
