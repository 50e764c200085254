"""FlowGRPO with DanceGRPO's sampler (`sampling.sde_type: dance`, docs/ALGORITHM.md section 13) on the tiny model:
it reaches the rollouts, the first update sees ratio 1, a resume is bit-identical and the run learns. FSDP equal to
unsharded: the `tiny-sd3-dance` run of tests/sharded_training.py (tests/integration/test_sharding.py)."""

import pytest
import torch
from metric_rows import without_timing
from safetensors.torch import load_file

from components.errors import CheckpointError
from components.trainer import checkpoint as ckpt
from components.trainer.training_run import train

DANCE = ["sampling.sde_type=dance", "sampling.noise_level=0.3"]  # DanceGRPO's published eta


def _quiet(_msg: str) -> None:
    pass


def _lora(path):
    return load_file(str(path / ckpt.LORA_FILE))


def test_dance_changes_the_rollouts_and_the_first_update_sees_ratio_one(small_config, tmp_path):
    """One optimizer step per epoch: epoch 1 re-scores its own rollout with the sampling weights (ratio exactly
    1, GRPO-Guard's too); the same seed sampled with `sde` at the same noise level gives other images."""
    one = ["train.epochs=1", "train.gradient_accumulation_steps=2"]
    for guard in ("false", "true"):
        row = train(small_config(*one, *DANCE, f"train.grpo_guard={guard}"), tmp_path / guard, log=_quiet).history[0]
        assert row["ratio_mean"] == 1.0 and row["approx_kl"] == 0.0 and row["clipfrac"] == 0.0
    sde = train(small_config(*one, "sampling.noise_level=0.3"), tmp_path / "sde", log=_quiet).history[0]
    assert sde["reward/mean"] != row["reward/mean"]


def test_resume_gives_the_same_final_lora_as_an_uninterrupted_run(small_config, tmp_path):
    full = train(small_config("train.epochs=4", *DANCE), tmp_path / "full", log=_quiet)
    train(small_config("train.epochs=2", *DANCE), tmp_path / "split", log=_quiet)
    resumed = train(small_config("train.epochs=4", *DANCE), tmp_path / "split", resume=True, log=_quiet)
    a, b = _lora(full.lora_dir), _lora(resumed.lora_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(v.abs().max()) > 1e-4 for v in a.values())  # it did train
    assert without_timing(full.history)[2:] == without_timing(resumed.history)[2:]
    with pytest.raises(CheckpointError, match=r"sampling\.sde_type"):  # a checkpoint sampled with dance stays dance
        train(small_config("train.epochs=5"), tmp_path / "split", resume=True, log=_quiet)


@pytest.mark.slow
def test_flow_grpo_with_dance_sde_learns_on_the_tiny_model(tmp_path):
    """The tiny default config with Dance-SDE at the published eta 0.3: the training reward's trend has its 95% CI
    above 0 within 14 epochs and ends above the first epoch by half its per-sample std (the tiny config's
    acceptance criterion; measured: +0.0013 against a first std of 0.0016, slope CI [8e-5, 1.4e-4] per epoch)."""
    from pipeline.config import TINY_CONFIG, load_config

    config = load_config(TINY_CONFIG, [*DANCE, "train.epochs=14", "tracking.sample_every=0"])
    summary = train(config, tmp_path, log=_quiet).learning_summary()
    assert summary["learned"] and summary["slope_low"] > 0, summary
    assert summary["last3_mean"] > summary["first_mean"] + summary["first_std"] / 2, summary
