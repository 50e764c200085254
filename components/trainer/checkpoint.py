"""Checkpoints under ``OUTPUT/checkpoints/``, a local directory or an ``s3://`` prefix.

Each checkpoint ``epoch-NNNNNN`` holds the LoRA in diffusers format (the EMA weights when EMA is on) and
``trainer_state.pt`` (raw LoRA weights, optimizer, EMA, RNG, counters). It is built in a local staging
directory and published through :func:`components.storage.publish_checkpoint`: files first, then a
manifest, then the ``latest`` pointer, so a reader (or a resume after a crash mid-upload) never sees a
partial checkpoint.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from components import storage
from components.errors import CheckpointError

STATE_FILE = "trainer_state.pt"
LORA_FILE = "pytorch_lora_weights.safetensors"


@dataclass
class TrainerState:
    epoch: int  # epochs completed
    optimizer_step: int
    lora: list[torch.Tensor]
    optimizer: dict
    ema: dict | None
    rng: torch.Tensor
    config_fingerprint: dict
    mlflow_run_id: str | None = None


def checkpoint_root(output: str | Path) -> str:
    return storage.join(output, "checkpoints")


def checkpoint_name(epoch: int) -> str:
    return f"epoch-{epoch:06d}"


def write_checkpoint(output: str | Path, staging: Path, state: TrainerState,
                     save_lora: Callable[[Path], None]) -> str:
    """Build the checkpoint in ``staging`` (a local scratch directory), publish it, return its URI.
    ``save_lora(directory)`` writes the diffusers-format LoRA."""
    local = Path(staging) / checkpoint_name(state.epoch)
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    try:
        save_lora(local)
        torch.save(state.__dict__, local / STATE_FILE)
        return storage.publish_checkpoint(local, checkpoint_root(output))
    finally:
        shutil.rmtree(local, ignore_errors=True)


def latest_checkpoint(output: str | Path) -> str | None:
    """URI (or path) of the newest complete checkpoint, None when there is none."""
    return storage.latest_checkpoint(checkpoint_root(output))


def read_checkpoint(uri: str | Path) -> TrainerState:
    with tempfile.TemporaryDirectory(prefix="flowgrpo-ckpt-") as tmp:
        local = Path(tmp) / STATE_FILE
        storage.get_file(storage.join(uri, STATE_FILE), local)
        try:
            raw = torch.load(local, map_location="cpu", weights_only=False)
            return TrainerState(**raw)
        except (OSError, RuntimeError, TypeError, EOFError) as exc:
            raise CheckpointError(f"checkpoint {uri} cannot be read: {exc}") from exc
