"""Checkpoints under ``OUTPUT/checkpoints/``, a local directory or an ``s3://`` prefix.

Each checkpoint ``epoch-NNNNNN`` holds the LoRA in diffusers format (the EMA weights when EMA is on) and
``trainer_state.pt`` (raw LoRA weights, optimizer, EMA, the algorithm's state, RNG, counters). It is built in a
local staging directory and published by :func:`publish_checkpoint` as a folder
(:func:`components.storage.publish_folder`: files first, then a manifest) and then the ``latest`` pointer, so a
reader (or a resume after a crash mid-upload) never sees a partial checkpoint.

Importing this module imports no torch (``run_output`` reads the newest checkpoint's URI where torch is not
installed); writing and reading a checkpoint's state do.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from components import storage
from components.errors import CheckpointError
from components.trainer.drain import writing

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
LORA_FILE = "pytorch_lora_weights.safetensors"
# the file under the checkpoint root that names the checkpoint published last
LATEST_NAME = "latest"


class CheckpointPublishError(storage.FolderPublishError):
    """A checkpoint cannot be published (bad name, unreadable directory)."""


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
    algorithm: dict | None = None  # the algorithm's own state (DiffusionNFT: its old policy)


def checkpoint_root(output: str | Path) -> str:
    return storage.join(output, "checkpoints")


def checkpoint_name(epoch: int) -> str:
    return f"epoch-{epoch:06d}"


def write_checkpoint(output: str | Path, staging: Path, state: TrainerState,
                     save_lora: Callable[[Path], None]) -> str:
    """Build the checkpoint in ``staging`` (a local scratch directory), publish it, return its URI.
    ``save_lora(directory)`` writes the diffusers-format LoRA."""
    import torch

    local = Path(staging) / checkpoint_name(state.epoch)
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    try:
        with writing():  # a pod being deleted waits for this checkpoint (components.trainer.drain)
            save_lora(local)
            torch.save(state.__dict__, local / STATE_FILE)
            return publish_checkpoint(local, checkpoint_root(output))
    finally:
        shutil.rmtree(local, ignore_errors=True)


def publish_checkpoint(local_dir: str | os.PathLike[str], root: str, name: str | None = None) -> str:
    """Publish the checkpoint directory ``local_dir`` as the folder ``root/<name>/`` (name defaults to the
    directory's name; see :func:`components.storage.publish_folder`), then point ``root/latest`` at it, in that
    order, so a reader never sees a pointer to a partial checkpoint. Returns the checkpoint's URI."""
    local = Path(local_dir)
    name = name or local.name
    if not local.is_dir():
        raise CheckpointPublishError(f"cannot publish {local}: not a directory")
    if not name or "/" in name or name in (".", "..", LATEST_NAME):
        raise CheckpointPublishError(f"cannot publish {local}: invalid checkpoint name {name!r}")
    try:
        target = storage.publish_folder(local, root, name)
    except storage.FolderPublishError as exc:
        raise CheckpointPublishError(str(exc)) from None
    storage.put_bytes(name.encode(), storage.join(root, LATEST_NAME))
    return target


def newest_checkpoint(root: str) -> str | None:
    """URI of the checkpoint the ``latest`` pointer under ``root`` names if it is complete; otherwise of the
    most recently published complete checkpoint under ``root``; None when there is none."""
    pointer = storage.join(root, LATEST_NAME)
    try:
        pointed = storage.get_bytes(pointer).decode().strip()
    except (storage.ObjectNotFoundError, storage.ChecksumMismatchError, UnicodeDecodeError):
        pointed = ""
    if pointed and "/" not in pointed and storage.complete_manifest(storage.join(root, pointed)) is not None:
        return storage.join(root, pointed)
    if pointed:
        log.warning("checkpoint %r named by %s is incomplete; looking for an older complete one", pointed, pointer)
    best: tuple[float, str] | None = None
    for name in storage.published_folders(root) - {pointed}:
        manifest = storage.complete_manifest(storage.join(root, name))
        if manifest is not None:
            candidate = (float(manifest.get("published_at", 0.0)), name)
            best = max(best, candidate) if best else candidate
    return storage.join(root, best[1]) if best else None


def latest_checkpoint(output: str | Path) -> str | None:
    """URI (or path) of the newest complete checkpoint of the run at ``output``, None when there is none."""
    return newest_checkpoint(checkpoint_root(output))


def read_checkpoint(uri: str | Path) -> TrainerState:
    import torch

    with tempfile.TemporaryDirectory(prefix="flowgrpo-ckpt-") as tmp:
        local = Path(tmp) / STATE_FILE
        storage.get_file(storage.join(uri, STATE_FILE), local)
        try:
            raw = torch.load(local, map_location="cpu", weights_only=False)
            return TrainerState(**raw)
        except (OSError, RuntimeError, TypeError, EOFError) as exc:
            raise CheckpointError(f"checkpoint {uri} cannot be read: {exc}") from exc
