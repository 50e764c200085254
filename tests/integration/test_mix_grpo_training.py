"""MixGRPO (docs/ALGORITHM.md section 12) in the trainer: it learns on the tiny model with its window moving as
upstream's, a resumed run ends with the same LoRA as an uninterrupted one (the window depends on the epoch alone),
and FSDP on 2 workers trains the LoRA the unsharded run trains."""

import pytest
from algorithm_runs import resumed_beside_uninterrupted, sharded_beside_plain
from metric_rows import without_timing

from components.algorithms.mix_grpo import window_steps
from components.trainer.training_run import train

# the window moves every epoch over steps 0..3 of 6 (the last two are never trained), 2 steps wide
MOVING = ["train.algorithm=mix_grpo", "sampling.num_steps=6", "train.mix_grpo.window_size=2",
          "train.mix_grpo.shift_interval=1"]


# MixGRPO's ODE steps, or MixGRPO-Flash's: DPM-Solver++(2M) after the window on 40% of its points
SOLVERS = {"euler": [], "flash": ["train.mix_grpo.ode_solver=dpm2", "train.mix_grpo.tail_ratio=0.4"]}


def _quiet(_msg: str) -> None:
    pass


def _trained_steps(row: dict) -> list[int]:
    return sorted(int(k.removeprefix("update/clipfrac/step")) for k in row if k.startswith("update/clipfrac/step"))


@pytest.mark.slow
@pytest.mark.parametrize("solver", SOLVERS)
def test_mix_grpo_learns_on_the_tiny_model_with_its_window_sliding(tmp_path, solver):
    """20 epochs of the tiny default config (10 steps), the window of 4 moving every 2 epochs: the training
    reward's trend has its 95% CI above 0, and each epoch trained exactly the window upstream's rule gives it."""
    from pipeline.config import TINY_CONFIG, load_config

    config = load_config(TINY_CONFIG, ["train.algorithm=mix_grpo", "train.epochs=20", "tracking.sample_every=0",
                                       "train.mix_grpo.shift_interval=2", *SOLVERS[solver]])
    result = train(config, tmp_path, log=_quiet)
    summary = result.learning_summary()
    assert summary["learned"], summary
    windows = [list(window_steps(e, 10, 4, 1, 2)) for e in range(20)]
    assert [_trained_steps(row) for row in result.history] == windows
    assert windows[14] == [7] and windows[16] == [0, 1, 2, 3]  # cut before step 8, then back to the start


@pytest.mark.parametrize("solver", SOLVERS)
def test_resume_gives_the_same_lora_as_an_uninterrupted_run(small_config, tmp_path, solver):
    extra = [*MOVING, *SOLVERS[solver], "tracking.sample_every=0"]  # no grid at epoch 2
    full, resumed = resumed_beside_uninterrupted(small_config, tmp_path, extra)
    assert without_timing(full.history) == without_timing(resumed.history)
    # epochs 3 and 4 trained windows the first two did not: a resume that restarted the schedule would differ
    assert [_trained_steps(row) for row in full.history] == [[0, 1], [1, 2], [2, 3], [3]]


@pytest.mark.slow
def test_fsdp_trains_the_lora_the_unsharded_run_trains(tmp_path):
    sharded_beside_plain(tmp_path, ["train.beta=0.04", *MOVING, *SOLVERS["flash"]])  # KL on; Flash
