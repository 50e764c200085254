"""What the trainer tests of each algorithm share: a run resumed halfway beside the same run uninterrupted, a
run on 2 workers with its frozen weights sharded beside the same run unsharded, and an algorithm built on a model
with a test's own settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from process_group import run_in_process_group, train_tiny
from safetensors.torch import load_file

from components.algorithms.base import Algorithm, build_algorithm
from components.trainer import checkpoint as ckpt
from components.trainer.config import TrainingJobConfig
from components.trainer.loop import TrainResult
from components.trainer.training_run import train

# sharded_training.RUN's shape: 2 workers x 4 images, micro-batches of 2 (2 optimizer steps an epoch), EMA on
SHARDED_RUN = ["sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
               "train.batch_size_per_worker=2", "train.ema.enabled=true", "train.ema.update_every=1",
               "tracking.system_metrics=false", "tracking.sample_every=0", "train.epochs=2"]


def lora(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / ckpt.LORA_FILE))


def _quiet(_msg: str) -> None:
    pass


def resumed_beside_uninterrupted(small_config: Callable, root: Path, extra: list[str], epochs: int = 4,
                                 split: int = 2) -> tuple[TrainResult, TrainResult]:
    """The run of ``epochs`` uninterrupted, and stopped after ``split`` then resumed: asserts their LoRAs are equal
    bit for bit; returns both results for the caller's own checks."""
    full = train(small_config(f"train.epochs={epochs}", *extra), root / "full", log=_quiet)
    train(small_config(f"train.epochs={split}", *extra), root / "split", log=_quiet)
    resumed = train(small_config(f"train.epochs={epochs}", *extra), root / "split", resume=True, log=_quiet)
    a, b = lora(full.lora_dir), lora(resumed.lora_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return full, resumed


def sharded_beside_plain(root: Path, overrides: list[str]) -> None:
    """The tiny model trained on 2 workers with ``overrides``, unsharded and with FSDP: asserts the same LoRA (to
    float rounding: a sharded all-gather sums in another order) and that it trained."""
    for sharding in ("none", "fsdp"):
        run_in_process_group(train_tiny, 2, [*SHARDED_RUN, *overrides, f"train.sharding={sharding}"],
                             str(root / sharding))
    plain, sharded = lora(root / "none" / "lora"), lora(root / "fsdp" / "lora")
    assert plain.keys() == sharded.keys()
    assert all(torch.allclose(plain[k], sharded[k], rtol=1e-5, atol=1e-7) for k in plain)
    assert any(float(v.abs().max()) > 1e-4 for v in sharded.values())  # it did train


def algorithm_on(model: Any, params: list[torch.Tensor], config: TrainingJobConfig, guidance_scale: float = 1.0,
                 **train: Any) -> Algorithm:
    """``config``'s algorithm on ``model`` with ``train`` changing its `train:` settings and ``guidance_scale`` its
    sampling's, unvalidated: a test's own rollout need not be an epoch of the config."""
    sampling = config.sampling.model_copy(update={"guidance_scale": guidance_scale})
    changed = config.model_copy(update={"train": config.train.model_copy(update=train), "sampling": sampling})
    return build_algorithm(changed, model, params)
