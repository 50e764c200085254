"""AWM (docs/ALGORITHM.md section 11) in the trainer: it learns on the tiny model, a resumed run ends with the same
LoRA (and EMA anchor) as an uninterrupted one, and FSDP on 2 workers trains the LoRA the unsharded run trains."""

import pytest
import torch
from metric_rows import without_timing
from process_group import run_in_process_group, train_tiny
from safetensors.torch import load_file

from components.trainer import checkpoint as ckpt
from components.trainer.training_run import train

# an EMA anchor that lags from the first step (decay 0.5), so a resume must restore it; the base model's KL on
AWM = ["train.algorithm=awm", "train.awm.decay_rate=0.5", "train.beta=0.04"]


def _quiet(_msg: str) -> None:
    pass


def _lora(path):
    return load_file(str(path / ckpt.LORA_FILE))


@pytest.mark.slow
def test_awm_learns_on_the_tiny_model(tmp_path):
    """20 epochs of the tiny default config with AWM's published settings, one optimizer step an epoch as the
    authors' recipes (4 micro-batches accumulated): the training reward's trend has its 95% CI above 0 (about 5x
    DiffusionNFT's slope here); the ratio is exactly 1 (the old log-prob is the forward's own), so nothing is
    clipped; the EMA anchor's decay follows min(0.3, 0.001 step) and it lags the trained weights."""
    from pipeline.config import TINY_CONFIG, load_config

    config = load_config(TINY_CONFIG, ["train.algorithm=awm", "train.epochs=20", "tracking.sample_every=0",
                                       "train.gradient_accumulation_steps=4"])
    result = train(config, tmp_path, log=_quiet)
    summary = result.learning_summary()
    assert summary["learned"], summary
    assert all(r["awm/ratio"] == 1.0 and r["clipfrac"] == 0.0 for r in result.history)
    assert [r["awm/ema_decay"] for r in result.history] == pytest.approx([0.001 * e for e in range(1, 21)])
    assert all(r["awm/ema_kl"] > 0 for r in result.history[1:])


def test_resume_gives_the_same_lora_as_an_uninterrupted_run(small_config, tmp_path):
    extra = [*AWM, "tracking.sample_every=0"]  # no grid at epoch 2
    full = train(small_config("train.epochs=4", *extra), tmp_path / "full", log=_quiet)
    train(small_config("train.epochs=2", *extra), tmp_path / "split", log=_quiet)
    resumed = train(small_config("train.epochs=4", *extra), tmp_path / "split", resume=True, log=_quiet)
    a, b = _lora(full.lora_dir), _lora(resumed.lora_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert without_timing(full.history) == without_timing(resumed.history)
    # 2 optimizer steps an epoch: the second's old log-probs come from the swapped-in sampling weights
    assert all(r["awm/ratio"] != 1.0 for r in full.history)
    s_full = ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path / "full"))
    s_res = ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path / "split"))
    anchor = s_full.algorithm["old_policy"]
    assert all(torch.equal(x, y) for x, y in zip(anchor, s_res.algorithm["old_policy"], strict=True))
    assert not torch.equal(anchor[-1], s_full.lora[-1])  # the anchor really lags the trained weights


def test_fsdp_trains_the_lora_the_unsharded_run_trains(tmp_path):
    # sharded_training.RUN's shape: 2 workers x 4 images, micro-batches of 2 (2 optimizer steps an epoch, so the
    # old policy's and the anchor's weight swaps run on the sharded transformer), KL and EMA on
    run = ["sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
           "train.batch_size_per_worker=2", "sampling.num_steps=4", "train.ema.enabled=true",
           "train.ema.update_every=1", "tracking.system_metrics=false", "tracking.sample_every=0", "train.epochs=2",
           *AWM]
    for sharding in ("none", "fsdp"):
        run_in_process_group(train_tiny, 2, [*run, f"train.sharding={sharding}"], str(tmp_path / sharding))
    plain, sharded = _lora(tmp_path / "none" / "lora"), _lora(tmp_path / "fsdp" / "lora")
    assert plain.keys() == sharded.keys()
    assert all(torch.allclose(plain[k], sharded[k], rtol=1e-5, atol=1e-7) for k in plain)
    assert any(float(v.abs().max()) > 1e-4 for v in sharded.values())  # it did train
