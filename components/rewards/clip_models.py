"""Rewards computed with a CLIP model (docs/ALGORITHM.md section 8): CLIP score, PickScore and the LAION
aesthetic predictor.

Weights come only from a local directory holding a transformers ``CLIPModel`` and its
``CLIPProcessor`` (as written by ``save_pretrained``), loaded with ``local_files_only=True``: a
reward never fetches weights from a hub. Models load in ``__init__`` so a bad path fails at start-up.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from transformers import CLIPModel, CLIPProcessor

from components import storage
from components.rewards.arguments import AestheticArgs, ClipArgs
from components.rewards.base import BatchedReward


def local_path(path: str, arg: str) -> Path:
    """The local file or directory ``path`` names, or a ValueError naming ``arg``. An object-store URI
    (``s3://...``) is fetched once into the local cache (``components.storage.local_copy``)."""
    if storage.is_uri(path):
        return storage.local_copy(path)
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ValueError(f"{arg}: {path} does not exist (model rewards load weights from a local path only, "
                         "never from a hub)")
    return resolved


def resolve_device(device: str) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; other values are torch device strings."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device (use auto, cpu, cuda or cuda:N)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    return resolved


def _check_images(images: np.ndarray) -> None:
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"expected uint8 images (B, H, W, 3), got {images.dtype} {images.shape}")


class _ClipReward(BatchedReward):
    """Loads a CLIP model and computes L2-normalised image and text embeddings in micro-batches of
    ``max_batch_size``, to bound memory on large batches. Arguments: ``ClipArgs``."""

    Args = ClipArgs

    def __init__(self, args: ClipArgs) -> None:
        model_path, processor_path = args.model_path, args.processor_path
        self.max_batch_size = args.max_batch_size
        # A fast tokenizer reconfigures its Rust state for padding/truncation on each call and fails with
        # "Already borrowed" when two threads (e.g. reward-server requests) tokenize at once.
        self._tokenizer_lock = threading.Lock()
        self.device = resolve_device(args.device)
        model_dir = local_path(model_path, "model_path")
        processor_arg, processor_dir = ("model_path", model_dir) if processor_path is None else (
            "processor_path", local_path(processor_path, "processor_path"))
        try:
            self.model = CLIPModel.from_pretrained(model_dir, local_files_only=True).eval().to(self.device)
        except Exception as exc:  # whatever from_pretrained raises, the directory is what the user must fix
            raise ValueError(f"model_path: {model_path} does not hold a saved transformers CLIPModel: {exc}") from exc
        try:
            self.processor = CLIPProcessor.from_pretrained(processor_dir, local_files_only=True)
        except Exception as exc:
            raise ValueError(f"{processor_arg}: {processor_dir} does not hold a saved CLIPProcessor (tokenizer and "
                             f"image processor): {exc}") from exc

    @torch.no_grad()
    def image_embeddings(self, images: np.ndarray) -> torch.Tensor:
        """(B, projection_dim) unit-norm image embeddings of uint8 RGB images."""
        _check_images(images)
        chunks = []
        for start in range(0, len(images), self.max_batch_size):
            batch = [Image.fromarray(image) for image in images[start:start + self.max_batch_size]]
            pixels = self.processor(images=batch, return_tensors="pt")["pixel_values"].to(self.device)
            chunks.append(self.model.get_image_features(pixel_values=pixels).pooler_output)
        return F.normalize(torch.cat(chunks).float(), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """(B, projection_dim) unit-norm text embeddings; prompts past CLIP's context are truncated."""
        # A rollout batch repeats each prompt group_size times: encode each distinct prompt once.
        unique = list(dict.fromkeys(prompts))
        max_length = self.model.config.text_config.max_position_embeddings
        chunks = []
        for start in range(0, len(unique), self.max_batch_size):
            with self._tokenizer_lock:
                tokens = self.processor(text=unique[start:start + self.max_batch_size], padding=True,
                                        truncation=True, max_length=max_length, return_tensors="pt")
            chunks.append(self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                                       attention_mask=tokens["attention_mask"].to(self.device))
                          .pooler_output)
        embeddings = F.normalize(torch.cat(chunks).float(), dim=-1)
        position = {prompt: i for i, prompt in enumerate(unique)}
        return embeddings[[position[p] for p in prompts]]

    def cosine(self, images: np.ndarray, prompts: list[str]) -> torch.Tensor:
        """(B,) cosine similarity of each image with its own prompt."""
        return (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(dim=-1)


class ClipScore(_ClipReward):
    """Raw cosine similarity in [-1, 1] between the CLIP image and prompt embeddings.

    (Some papers report ``100 * cos`` or ``max(100 * cos, 0)``; the raw cosine keeps the reward's
    scale independent of the checkpoint's ``logit_scale``.) Arguments as in ``_ClipReward``.
    """

    name = "clip_score"

    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        return self.cosine(images, prompts).cpu().numpy().astype(np.float64)


class PickScore(_ClipReward):
    """PickScore (Kirstain et al. 2023): ``logit_scale.exp() * cos(image, prompt)``, around 20 for
    typical images (upstream FlowGRPO divides by 26; use the reward weight for that).

    ``model_path`` must hold the PickScore checkpoint (``yuvalkirstain/PickScore_v1``, a CLIP ViT-H/14
    fine-tune) saved locally; its processor is ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``'s: save it into
    the same directory or give it as ``processor_path``. Other arguments as in ``_ClipReward``.
    """

    name = "pickscore"

    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        scale = self.model.logit_scale.detach().float().exp()
        return (scale * self.cosine(images, prompts)).cpu().numpy().astype(np.float64)


HEAD_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


class AestheticHead(nn.Module):
    """The MLP of LAION's improved-aesthetic-predictor; parameter names (``layers.0.weight``, ...) match
    its published checkpoints."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings)


class AestheticScore(_ClipReward):
    """LAION aesthetic predictor: an MLP on the unit-norm CLIP image embedding, about 1-10 (the prompt
    is not used). ``model_path`` is the CLIP the head was trained on (ViT-L/14 for the published
    ``sac+logos+ava1-l14-linearMSE.pth``); arguments: ``AestheticArgs``.
    """

    name = "aesthetic"
    Args = AestheticArgs

    def __init__(self, args: AestheticArgs) -> None:
        head_path = args.head_path
        head_file = local_path(head_path, "head_path")
        if not head_file.is_file() or head_file.suffix not in HEAD_SUFFIXES:
            raise ValueError(f"head_path: {head_path} must be a {', '.join(HEAD_SUFFIXES)} file")
        super().__init__(args)
        input_size = self.model.config.projection_dim
        self.head = AestheticHead(input_size)
        try:
            # .pt/.pth/.bin are PyTorch pickles: weights_only refuses anything but tensors.
            state = load_file(head_file) if head_file.suffix == ".safetensors" else torch.load(
                head_file, map_location="cpu", weights_only=True)
            self.head.load_state_dict(state)
        except Exception as exc:  # unreadable file or mismatched keys/shapes: either way the file is wrong
            raise ValueError(f"head_path: {head_path} is not an aesthetic MLP state dict for {input_size}-dim CLIP "
                             f"embeddings: {exc}") from exc
        self.head = self.head.float().eval().to(self.device)

    @torch.no_grad()
    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        return self.head(self.image_embeddings(images)).squeeze(-1).cpu().numpy().astype(np.float64)
