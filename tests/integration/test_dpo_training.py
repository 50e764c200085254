"""Online DPO (docs/ALGORITHM.md section 14) in the trainer: it learns on the tiny model, a resumed run ends with the
same LoRA as an uninterrupted one, FSDP on 2 workers trains the LoRA the unsharded run trains, and an epoch without
a single preference pair steps the optimizer on zero gradients."""

import pytest
import torch
from algorithm_runs import lora, resumed_beside_uninterrupted, sharded_beside_plain
from metric_rows import without_timing

from components.trainer.training_run import train

DPO = ["train.algorithm=dpo"]


def _quiet(_msg: str) -> None:
    pass


@pytest.mark.slow
def test_dpo_learns_on_the_tiny_model(tmp_path):
    """20 epochs of the tiny default config with the published beta 100: the training reward's trend has its 95% CI
    above 0; each of the 8 groups gives a pair (brightness never ties), a quarter of the samples trained; the
    policy moves away from the reference (w_diff, l_diff no longer 0) and prefers the winners more often than not."""
    from pipeline.config import TINY_CONFIG, load_config

    config = load_config(TINY_CONFIG, [*DPO, "train.epochs=20", "tracking.sample_every=0"])
    result = train(config, tmp_path, log=_quiet)
    summary = result.learning_summary()
    assert summary["learned"], summary
    history = result.history
    assert all(r["dpo/pairs"] == 8 and r["dpo/unpaired_groups"] == 0 for r in history)
    assert all(r["trained_fraction"] == 0.25 for r in history)
    # the first update starts at the reference: every inside term is exactly 0, the loss log 2
    assert history[0]["dpo/w_diff"] == history[0]["dpo/l_diff"] == 0.0
    assert history[0]["policy_loss"] == pytest.approx(0.6931, abs=1e-4)
    assert all(r["dpo/w_diff"] != 0 for r in history[1:])
    assert sum(r["dpo/implicit_acc"] for r in history[10:]) / 10 > 0.5


def test_resume_gives_the_same_lora_as_an_uninterrupted_run(small_config, tmp_path):
    # one pair per micro-batch: 2 micro-batches and 2 optimizer steps an epoch
    full, resumed = resumed_beside_uninterrupted(
        small_config, tmp_path, [*DPO, "train.batch_size_per_worker=2", "tracking.sample_every=0"])
    assert without_timing(full.history) == without_timing(resumed.history)
    assert [r["optimizer_step"] for r in full.history] == [2, 4, 6, 8]


@pytest.mark.slow
def test_fsdp_trains_the_lora_the_unsharded_run_trains(tmp_path):
    # one group of 4 images per worker, one pair per micro-batch: the reference forward with the adapter disabled
    # runs on the sharded transformer
    sharded_beside_plain(tmp_path, ["sampling.num_steps=4", *DPO])


def test_an_epoch_without_a_preference_steps_on_zero_gradients(small_config, tmp_path, monkeypatch):
    """Every image scores the same: no group has a best and a worst, so no pair. The micro-batches still run (on a
    placeholder pair with weight 0, as a worker without pairs must to keep step with the others) and the optimizer
    steps on zero gradients: peft's lora_B starts at 0 and stays there."""
    from components.rewards.brightness import Brightness

    monkeypatch.setattr(Brightness, "score", lambda self, image, prompt, metadata: 0.5)
    result = train(small_config(*DPO, "tracking.sample_every=0"), tmp_path, log=_quiet)
    assert [(r["dpo/pairs"], r["dpo/unpaired_groups"]) for r in result.history] == [(0.0, 2.0)] * 2
    assert [r["optimizer_step"] for r in result.history] == [1, 2]
    assert all("policy_loss" not in r and r["grad_norm"] == 0.0 and r["trained_fraction"] == 0.0
               for r in result.history)
    weights = lora(result.lora_dir)
    assert all(not v.any() for k, v in weights.items() if "lora_B" in k)


def test_an_accumulation_longer_than_the_epochs_pairs_still_steps_once_on_them_all(small_config, tmp_path):
    """A pair takes two samples' places, so the accumulation a config sets for the other algorithms (4 micro-batches
    of 2 samples here) can exceed DPO's micro-batches (2 pairs, one each): the epoch's one step then takes both,
    exactly as an accumulation of 2 does, instead of never stepping."""
    extra = [*DPO, "train.batch_size_per_worker=2", "tracking.sample_every=0", "train.epochs=2"]
    long = train(small_config(*extra, "train.gradient_accumulation_steps=4"), tmp_path / "long", log=_quiet)
    exact = train(small_config(*extra, "train.gradient_accumulation_steps=2"), tmp_path / "exact", log=_quiet)
    assert [r["optimizer_step"] for r in long.history] == [1, 2]
    a, b = lora(long.lora_dir), lora(exact.lora_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)
