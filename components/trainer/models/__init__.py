"""Build a model adapter from the `model` config section."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from components.errors import ModelLoadError
from components.trainer.config import ModelConfig
from components.trainer.models.base import FlowMatchingModel, PromptEmbeddings

__all__ = ["FlowMatchingModel", "PromptEmbeddings", "load_model", "resolve_device"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SD3_MAX_SEQUENCE_LENGTH = 256  # the SD3 pipeline's default T5 length


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device is 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    return torch.device(name)


def _load_diffusers(path: str, dtype: torch.dtype):
    from components import storage

    root = storage.local_copy(path) if "://" in path else Path(path)
    index = root / "model_index.json"
    if not root.is_dir():
        raise ModelLoadError(f"model.path: {path} is not a directory (a diffusers pipeline saved with save_pretrained)")
    if not index.is_file():
        raise ModelLoadError(f"model.path: {path} has no model_index.json; is it a diffusers pipeline directory?")
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"model.path: {index} is not a valid model_index.json ({exc})") from exc
    if class_name != "StableDiffusion3Pipeline":
        raise ModelLoadError(
            f"model.path: {path} holds a {class_name}; supported pipelines: StableDiffusion3Pipeline"
        )
    from diffusers import StableDiffusion3Pipeline

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return StableDiffusion3Pipeline.from_pretrained(str(root), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path: cannot load {path}: {exc}") from exc


def load_model(config: ModelConfig, seed: int) -> FlowMatchingModel:
    """The adapter for ``config.kind``, on its device, every module in eval mode and frozen."""
    from components.trainer.models.sd3 import SD3Model

    device = resolve_device(config.device)
    dtype = _DTYPES[config.dtype]
    if config.kind == "tiny-sd3":
        from components.trainer.models.tiny_sd3 import build_tiny_sd3

        pipe = build_tiny_sd3(config.resolution, seed)
        if dtype != torch.float32:
            pipe.to(dtype=dtype)
    else:
        pipe = _load_diffusers(config.path, dtype)
    pipe.to(device=device)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.eval().requires_grad_(False)
    pipe.set_progress_bar_config(disable=True)
    max_len = min(SD3_MAX_SEQUENCE_LENGTH, pipe.tokenizer_3.model_max_length)
    return SD3Model(pipe, device, dtype, max_len)
