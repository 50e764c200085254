"""The single-process trainer: determinism, checkpoints, resume, LoRA export, KL."""

import contextlib
import json
import shutil

import numpy as np
import pytest
import torch
from metric_rows import TIMING_KEYS, without_timing
from safetensors.torch import load_file

from components.errors import CheckpointError, ModelLoadError
from components.models.config import ModelConfig
from components.models.loading import load_model
from components.models.sd3.tiny import build_tiny_sd3
from components.trainer import checkpoint as ckpt
from components.trainer.loop import Trainer, _fingerprint
from components.trainer.training_run import train


def _quiet(_msg: str) -> None:
    pass


def _lora(path):
    return load_file(str(path / ckpt.LORA_FILE))


def _assert_same_lora(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_same_seed_same_metrics_and_lora_and_another_seed_differs(small_config, tmp_path):
    a = train(small_config(), tmp_path / "a", log=_quiet)
    b = train(small_config(), tmp_path / "b", log=_quiet)
    c = train(small_config("seed=1"), tmp_path / "c", log=_quiet)
    assert without_timing(a.history) == without_timing(b.history)
    _assert_same_lora(_lora(a.lora_dir), _lora(b.lora_dir))
    assert not torch.equal(next(iter(_lora(a.lora_dir).values())), next(iter(_lora(c.lora_dir).values())))
    assert [row["epoch"] for row in a.history] == [1, 2]
    for row in a.history:
        assert np.isfinite(row["reward/mean"]) and row["reward/std"] > 0


def test_metrics_file_and_checkpoints_are_written(small_config, tmp_path):
    result = train(small_config(), tmp_path, log=_quiet)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["epoch"] for r in rows] == [1, 2]
    for key in ("reward/mean", "reward/std", "reward/brightness/mean", "policy_loss", "kl", "approx_kl",
                "clipfrac", "grad_norm", "lr", "zero_std_group_fraction", "failed_fraction", *TIMING_KEYS):
        assert key in rows[0], key
    # per-step means: 4 steps, timestep_fraction 0.99 -> steps 0..2 trained; their mean is the overall mean
    per_step = [rows[0][f"update/clipfrac/step{s}"] for s in range(3)]
    assert "clipfrac/step3" not in rows[0]
    assert sum(per_step) / 3 == pytest.approx(rows[0]["clipfrac"])
    assert ckpt.latest_checkpoint(tmp_path) == str(tmp_path / "checkpoints" / "epoch-000002")
    assert (tmp_path / "checkpoints" / "epoch-000001" / ckpt.STATE_FILE).is_file()
    assert not (tmp_path / ".staging" / "epoch-000001").exists()  # the scratch copy is gone once published
    assert (result.lora_dir / ckpt.LORA_FILE).is_file()


def test_the_phase_scope_wraps_each_phase_and_a_handed_in_pipeline_trains_as_the_configured_one(small_config,
                                                                                                  tmp_path):
    config = small_config("train.epochs=1")
    seen: list[tuple[str, str, list[torch.Tensor]]] = []

    @contextlib.contextmanager
    def record(phase: str):
        seen.append((phase, "enter", [p.detach().clone() for p in scoped.params]))
        yield
        seen.append((phase, "exit", [p.detach().clone() for p in scoped.params]))

    pipeline = build_tiny_sd3(config.model.resolution, config.seed)
    scoped = Trainer(config, tmp_path / "scoped", log=_quiet, phase_scope=record, pipeline=pipeline)
    plain = Trainer(config, tmp_path / "plain", log=_quiet)
    assert scoped.model.pipeline is pipeline
    rows = [scoped.run_epoch(), plain.run_epoch()]

    phases = ["encoding", "sampling", "scoring", "training"]
    assert [(phase, event) for phase, event, _ in seen] == [(p, e) for p in phases for e in ("enter", "exit")]
    moved = {phase: not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
             for (phase, _, before), (_, _, after) in zip(seen[::2], seen[1::2], strict=True)}
    assert moved == {"encoding": False, "sampling": False, "scoring": False, "training": True}
    # the scope only observes, and the handed-in pipeline is the configured one: the same epoch, the same LoRA
    assert without_timing(rows[:1]) == without_timing(rows[1:])
    for a, b in zip(scoped.params, plain.params, strict=True):
        assert torch.equal(a, b)


def test_a_handed_in_pipeline_of_no_supported_family_is_refused():
    with pytest.raises(ModelLoadError, match="the pipeline handed in is a StableDiffusionPipeline"):
        load_model(ModelConfig(), 0, pipeline=type("StableDiffusionPipeline", (), {})())


@pytest.mark.parametrize("guard", [False, True])
def test_first_update_sees_ratio_one(small_config, tmp_path, guard):
    # One optimizer step per epoch: every micro-batch of epoch 1 is scored with the sampling weights. GRPO-Guard's
    # ratio compares the rollout's stored means with the training forward's: equal, so exactly 1 too.
    result = train(small_config("train.epochs=1", "train.gradient_accumulation_steps=2",
                                f"train.grpo_guard={str(guard).lower()}"), tmp_path, log=_quiet)
    row = result.history[0]
    assert row["ratio_mean"] == 1.0 and row["approx_kl"] == 0.0 and row["clipfrac"] == 0.0
    if guard:  # a second epoch moves the ratio off 1: the guard's ratio is live, not a constant
        again = train(small_config("train.epochs=2", "train.grpo_guard=true"), tmp_path / "two", log=_quiet)
        assert again.history[1]["ratio_mean"] != 1.0 and again.history[1]["approx_kl"] > 0


def test_saved_lora_reloads_through_diffusers_and_reproduces_images(small_config, tmp_path):
    config = small_config("train.learning_rate=0.05")
    trainer = Trainer(config, tmp_path, log=_quiet)
    trainer.fit()
    lora_dir = tmp_path / "lora"

    def generate(pipe):
        out = pipe(["a cat on a sofa"] * 2, num_inference_steps=4, guidance_scale=1.0, height=32, width=32,
                   generator=torch.Generator().manual_seed(0), output_type="np", max_sequence_length=32)
        return out.images

    trained = generate(trainer.model.pipeline)
    fresh = build_tiny_sd3(32, config.seed)
    base = generate(fresh)
    fresh.load_lora_weights(str(lora_dir))
    reloaded = generate(fresh)
    assert np.array_equal(trained, reloaded)
    assert not np.array_equal(base, reloaded)  # the LoRA really changes the images


@pytest.mark.parametrize(("ema", "algorithm"), [(False, "flow_grpo"), (True, "flow_grpo"), (True, "diffusion_nft")])
def test_resume_gives_the_same_final_lora_as_an_uninterrupted_run(small_config, tmp_path, ema, algorithm):
    extra = ["train.ema.enabled=true", "train.ema.update_every=1", "train.ema.decay=0.5"] if ema else []
    # DiffusionNFT: an old policy that lags (decay 0.5 from the first step), so a resume must restore it
    extra += [f"train.algorithm={algorithm}", "train.diffusion_nft.decay_rate=0.5"]
    full = train(small_config("train.epochs=4", *extra), tmp_path / "full", log=_quiet)
    train(small_config("train.epochs=2", *extra), tmp_path / "split", log=_quiet)
    resumed = train(small_config("train.epochs=4", *extra), tmp_path / "split", resume=True, log=_quiet)
    _assert_same_lora(_lora(full.lora_dir), _lora(resumed.lora_dir))
    # the sample grids follow train.epochs (a grid after the last epoch), which a resume may raise: the split run
    # drew one after its epoch 2, the full run did not; the grids both runs drew are the same
    def grids_apart(history: list[dict]) -> tuple[list[dict], dict]:
        grids = {(r["epoch"], k): v for r in history for k, v in r.items() if k.startswith("heldout/")}
        return [{k: v for k, v in r.items() if not k.startswith("heldout/")} for r in history], grids

    (full_rows, full_grids), (resumed_rows, resumed_grids) = (grids_apart(without_timing(h))
                                                              for h in (full.history, resumed.history))
    assert full_rows == resumed_rows
    assert (4, "heldout/brightness/mean") in full_grids
    assert full_grids == {k: v for k, v in resumed_grids.items() if k[0] != 2}
    s_full = ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path / "full"))
    s_res = ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path / "split"))
    assert s_full.optimizer_step == s_res.optimizer_step == 4 * 8 // 4
    for a, b in zip(s_full.lora, s_res.lora, strict=True):
        assert torch.equal(a, b)
    if ema:  # the exported LoRA is the EMA, not the raw weights
        raw = s_full.lora[0]
        assert not torch.equal(raw, s_full.ema["shadow"][0])
    if algorithm == "diffusion_nft":
        old = s_full.algorithm["old_policy"]
        assert all(torch.equal(a, b) for a, b in zip(old, s_res.algorithm["old_policy"], strict=True))
        assert not torch.equal(old[-1], s_full.lora[-1])  # the old policy really lags the trained weights
    else:
        assert s_full.algorithm is None


def test_resume_refusals(small_config, tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train(small_config(), tmp_path / "empty", resume=True, log=_quiet)
    train(small_config("train.epochs=1"), tmp_path / "run", log=_quiet)
    with pytest.raises(CheckpointError, match="already holds checkpoints; pass --resume"):
        train(small_config(), tmp_path / "run", log=_quiet)
    with pytest.raises(CheckpointError, match=r"differs from the checkpoint's in train\.learning_rate"):
        train(small_config("train.learning_rate=0.01"), tmp_path / "run", resume=True, log=_quiet)
    changed = r"in sampling\.guidance_scale, train\.cfg_uncond_grad, train\.train_cfg \("
    with pytest.raises(CheckpointError, match=changed):
        train(small_config("sampling.guidance_scale=2", "train.train_cfg=true", "train.cfg_uncond_grad=false"),
              tmp_path / "run", resume=True, log=_quiet)
    # compiled or eager computes the same thing: the fingerprint a checkpoint must match leaves it out
    assert _fingerprint(small_config("train.compile=true")) == _fingerprint(small_config())
    # where and how patiently rewards are scored may change
    resumed = train(small_config("rewards.0.timeout_s=60", "reward_server.retry_window_s=60"), tmp_path / "run",
                    resume=True, log=_quiet)
    assert [r["epoch"] for r in resumed.history] == [1, 2]
    # an output holding run.json but no complete checkpoint is the same run stopped before its first one: --resume
    # has nothing to continue; a new run (here: --auto-resume, as a retried job) starts over in it
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train(small_config(), tmp_path / "run", resume=True, log=_quiet)
    again = train(small_config("train.epochs=1"), tmp_path / "run", resume="auto", log=_quiet)
    assert [r["epoch"] for r in again.history] == [1]


def test_partial_checkpoint_is_never_picked(small_config, tmp_path):
    train(small_config("train.epochs=1"), tmp_path, log=_quiet)
    root = tmp_path / "checkpoints"
    first = str(root / "epoch-000001")
    (root / "epoch-000003").mkdir()  # files without a manifest, e.g. an upload cut short
    (root / "epoch-000003" / ckpt.STATE_FILE).write_bytes(b"")
    assert ckpt.latest_checkpoint(tmp_path) == first
    (root / "latest").write_text("epoch-000003\n")  # a pointer to an incomplete one falls back
    assert ckpt.latest_checkpoint(tmp_path) == first
    (root / "epoch-000001" / ckpt.LORA_FILE).write_bytes(b"cut")  # a file shorter than its manifest says
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_kl_to_reference_is_reported_and_bounded_by_beta(small_config, tmp_path):
    result = train(small_config("train.beta=0.5", "train.learning_rate=0.02"), tmp_path, log=_quiet)
    first, second = result.history
    assert first["kl"] > 0  # the LoRA moved after the first optimizer step of epoch 1
    assert second["kl"] > 0 and np.isfinite(second["kl"])


def test_gdpo_with_two_rewards_trains(small_config, tmp_path):
    result = train(
        small_config("reward_aggregation=gdpo",
                     "rewards=[{name: brightness, weight: 1.0}, {name: jpeg_incompressibility, weight: 0.5}]"),
        tmp_path, log=_quiet,
    )
    row = result.history[0]
    assert "reward/jpeg_incompressibility/mean" in row and "reward/brightness/mean" in row
    assert row["update/advantage_mean"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_diffusion_nft_learns_on_the_tiny_model(tmp_path):
    """DiffusionNFT on the tiny default config: the training reward's trend has its 95% CI above 0 within 20 epochs
    (it gains about a tenth of FlowGRPO's per epoch on this random model), and the old policy follows the
    trained weights with NVlabs' decay (0.001 per optimizer step, 4 steps an epoch)."""
    from pipeline.config import TINY_CONFIG, load_config

    config = load_config(TINY_CONFIG, ["train.algorithm=diffusion_nft", "train.epochs=20", "tracking.sample_every=0"])
    result = train(config, tmp_path, log=_quiet)
    summary = result.learning_summary()
    assert summary["learned"], summary
    assert [r["nft/old_decay"] for r in result.history] == pytest.approx([0.004 * e for e in range(1, 21)])
    assert all(r["nft/positive_loss"] > 0 and r["nft/negative_loss"] > 0 for r in result.history)
