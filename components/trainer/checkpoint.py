"""Checkpoints under ``OUTPUT/checkpoints/``, published atomically.

Each checkpoint is a directory ``epoch-NNNNNN`` with the LoRA in diffusers format
(the EMA weights when EMA is on) and ``trainer_state.pt`` (raw LoRA weights,
optimizer, EMA, RNG, counters). It is written under a temporary name, renamed
when complete, and only then does the ``latest`` pointer name it, so a reader
never sees a partial checkpoint.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from components.errors import CheckpointError

STATE_FILE = "trainer_state.pt"
LORA_FILE = "pytorch_lora_weights.safetensors"
LATEST = "latest"


@dataclass
class TrainerState:
    epoch: int  # epochs completed
    optimizer_step: int
    lora: list[torch.Tensor]
    optimizer: dict
    ema: dict | None
    rng: torch.Tensor
    config_fingerprint: dict


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def _name(epoch: int) -> str:
    return f"epoch-{epoch:06d}"


def write_checkpoint(output_dir: Path, state: TrainerState, save_lora) -> Path:
    """Write a checkpoint; ``save_lora(directory)`` writes the diffusers-format LoRA into it."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _name(state.epoch)
    tmp = root / f".tmp-{_name(state.epoch)}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_lora(tmp)
    torch.save(state.__dict__, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    return final


def _complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / LORA_FILE).is_file()


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint: the one ``latest`` names, else the newest complete directory."""
    root = checkpoint_root(output_dir)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if _complete(named):
            return named
    candidates = sorted(p for p in root.glob("epoch-*") if _complete(p)) if root.is_dir() else []
    return candidates[-1] if candidates else None


def read_checkpoint(path: Path) -> TrainerState:
    try:
        raw = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        return TrainerState(**raw)
    except (OSError, RuntimeError, TypeError, EOFError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from exc
