"""AWM (docs/ALGORITHM.md section 11) in the trainer: it learns on the tiny model, a resumed run ends with the same
LoRA (and EMA anchor) as an uninterrupted one, and FSDP on 2 workers trains the LoRA the unsharded run trains."""

import pytest
import torch
from algorithm_runs import resumed_beside_uninterrupted, sharded_beside_plain
from metric_rows import without_timing

from components.trainer import checkpoint as ckpt
from components.trainer.training_run import train

# an EMA anchor that lags from the first step (decay 0.5), so a resume must restore it; the base model's KL on
AWM = ["train.algorithm=awm", "train.awm.decay_rate=0.5", "train.beta=0.04"]


def _quiet(_msg: str) -> None:
    pass


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
    full, resumed = resumed_beside_uninterrupted(small_config, tmp_path, [*AWM, "tracking.sample_every=0"])
    assert without_timing(full.history) == without_timing(resumed.history)
    # 2 optimizer steps an epoch: the second's old log-probs come from the swapped-in sampling weights
    assert all(r["awm/ratio"] != 1.0 for r in full.history)
    s_full = ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path / "full"))
    s_res = ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path / "split"))
    anchor = s_full.algorithm["old_policy"]
    assert all(torch.equal(x, y) for x, y in zip(anchor, s_res.algorithm["old_policy"], strict=True))
    assert not torch.equal(anchor[-1], s_full.lora[-1])  # the anchor really lags the trained weights


@pytest.mark.slow
def test_fsdp_trains_the_lora_the_unsharded_run_trains(tmp_path):
    # 2 optimizer steps an epoch, so the old policy's and the anchor's weight swaps run on the sharded transformer
    sharded_beside_plain(tmp_path, ["sampling.num_steps=4", *AWM])
