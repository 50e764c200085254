"""MixGRPO (docs/ALGORITHM.md section 12) in the trainer: it learns on the tiny model with its window moving as
upstream's, a resumed run ends with the same LoRA as an uninterrupted one (the window depends on the epoch alone),
and FSDP on 2 workers trains the LoRA the unsharded run trains."""

import pytest
import torch
from metric_rows import without_timing
from process_group import run_in_process_group, train_tiny
from safetensors.torch import load_file

from components.algorithms.mix_grpo import window_steps
from components.trainer import checkpoint as ckpt
from components.trainer.training_run import train

# the window moves every epoch over steps 0..3 of 6 (the last two are never trained), 2 steps wide
MOVING = ["train.algorithm=mix_grpo", "sampling.num_steps=6", "train.mix_grpo.window_size=2",
          "train.mix_grpo.shift_interval=1"]


# MixGRPO's ODE steps, or MixGRPO-Flash's: DPM-Solver++(2M) after the window on 40% of its points
SOLVERS = {"euler": [], "flash": ["train.mix_grpo.ode_solver=dpm2", "train.mix_grpo.tail_ratio=0.4"]}


def _quiet(_msg: str) -> None:
    pass


def _lora(path):
    return load_file(str(path / ckpt.LORA_FILE))


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
    full = train(small_config("train.epochs=4", *extra), tmp_path / "full", log=_quiet)
    train(small_config("train.epochs=2", *extra), tmp_path / "split", log=_quiet)
    resumed = train(small_config("train.epochs=4", *extra), tmp_path / "split", resume=True, log=_quiet)
    a, b = _lora(full.lora_dir), _lora(resumed.lora_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert without_timing(full.history) == without_timing(resumed.history)
    # epochs 3 and 4 trained windows the first two did not: a resume that restarted the schedule would differ
    assert [_trained_steps(row) for row in full.history] == [[0, 1], [1, 2], [2, 3], [3]]


def test_fsdp_trains_the_lora_the_unsharded_run_trains(tmp_path):
    # sharded_training.RUN's shape: 2 workers x 4 images, micro-batches of 2, KL and EMA on; Flash
    run = ["sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
           "train.batch_size_per_worker=2", "train.beta=0.04", "train.ema.enabled=true", "train.ema.update_every=1",
           "tracking.system_metrics=false", "tracking.sample_every=0", "train.epochs=2", *MOVING,
           *SOLVERS["flash"]]
    for sharding in ("none", "fsdp"):
        run_in_process_group(train_tiny, 2, [*run, f"train.sharding={sharding}"], str(tmp_path / sharding))
    plain, sharded = _lora(tmp_path / "none" / "lora"), _lora(tmp_path / "fsdp" / "lora")
    assert plain.keys() == sharded.keys()
    assert all(torch.allclose(plain[k], sharded[k], rtol=1e-5, atol=1e-7) for k in plain)
    assert any(float(v.abs().max()) > 1e-4 for v in sharded.values())  # it did train
