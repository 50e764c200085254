"""Build a model adapter from the `model` config section, by the family registry (``families.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from components.errors import ModelLoadError
from components.models.base import TEXT_ENCODERS, FlowMatchingModel, PromptEmbeddings
from components.models.config import ModelConfig
from components.models.families import load, pipelines, twins

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

__all__ = ["FlowMatchingModel", "PromptEmbeddings", "load_model", "resolve_device"]

MODEL_INDEX = "model_index.json"
_NO_INDEX = "model.path: {path} has no model_index.json; is it a diffusers pipeline directory?"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device is 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    return torch.device(name)


def _adapter(class_name: str) -> type[FlowMatchingModel]:
    """The adapter registered for the pipeline class ``class_name``."""
    return load(pipelines()[class_name].adapter)


def check_model_path(config: ModelConfig) -> None:
    """Refuse a ``model.path`` that is no supported diffusers pipeline, as loading would, without loading it: a local
    directory's model_index.json is read there, an ``s3://`` pipeline's alone is fetched (an unreachable endpoint,
    a missing bucket or pipeline stops the run here, before it writes anything)."""
    from components import storage

    if config.kind != "diffusers":
        return
    path = config.path
    if not storage.is_remote(path):
        _pipeline_class(storage.local_copy(path) if storage.is_uri(path) else Path(path), path)
        return
    index = storage.join(path, MODEL_INDEX)
    try:
        raw = storage.get_bytes(index)
    except storage.ObjectNotFoundError:
        raise ModelLoadError(_NO_INDEX.format(path=path)) from None
    except storage.StorageError as exc:
        raise ModelLoadError(f"model.path: {exc}") from exc
    _index_class(raw, index, path)


def _load_diffusers(path: str, dtype: torch.dtype):
    from components import storage

    root = storage.local_copy(path) if storage.is_uri(path) else Path(path)
    class_name = _pipeline_class(root, path)
    import diffusers

    try:
        return getattr(diffusers, class_name).from_pretrained(
            str(root), dtype=dtype, local_files_only=True, **_adapter(class_name).pipeline_components(root))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model.path: cannot load {path}: {exc}") from exc


def _pipeline_class(root: Path, path: str) -> str:
    """The supported diffusers pipeline class the directory ``root`` (``model.path`` ``path``) holds."""
    index = root / MODEL_INDEX
    if not root.is_dir():
        raise ModelLoadError(f"model.path: {path} is not a directory (a diffusers pipeline saved with save_pretrained)")
    if not index.is_file():
        raise ModelLoadError(_NO_INDEX.format(path=path))
    return _index_class(index.read_bytes(), index, path)


def _index_class(raw: bytes, index: str | Path, path: str) -> str:
    """The supported pipeline class the model_index.json ``raw`` (the file ``index`` of ``path``) names."""
    try:
        class_name = json.loads(raw)["_class_name"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"model.path: {index} is not a valid model_index.json ({exc})") from exc
    if class_name not in pipelines():
        raise ModelLoadError(
            f"model.path: {path} holds a {class_name}; supported pipelines: {', '.join(pipelines())}"
        )
    return class_name


def load_model(config: ModelConfig, seed: int, *, on_device: bool = True,
               pipeline: DiffusionPipeline | None = None) -> FlowMatchingModel:
    """The adapter for ``config.kind``, every module in eval mode and frozen, on its device (with ``on_device``
    false the pipeline stays in host memory: the trainer places each part itself, see ``Trainer``). ``pipeline``:
    one the caller built (a benchmark's real-shape pipeline, in memory), taken instead of ``config.path``'s."""
    device = resolve_device(config.device)
    dtype = _DTYPES[config.dtype]
    if pipeline is not None:
        if type(pipeline).__name__ not in pipelines():
            raise ModelLoadError(f"the pipeline handed in is a {type(pipeline).__name__}; supported pipelines: "
                                 f"{', '.join(pipelines())}")
        pipe = pipeline
    elif config.kind in twins():
        pipe = load(twins()[config.kind].builder)(config.resolution, seed)
        if dtype != torch.float32:
            pipe.to(dtype=dtype)
    else:
        pipe = _load_diffusers(config.path, dtype)
    if on_device:
        pipe.to(device=device)
    for name in ("transformer", "vae", *TEXT_ENCODERS):
        module = getattr(pipe, name, None)
        if module is not None:
            module.eval().requires_grad_(False)
    pipe.set_progress_bar_config(disable=True)
    return _adapter(type(pipe).__name__)(pipe, device, dtype, config.negative_prompt, config.max_sequence_length,
                                         config.num_frames)
