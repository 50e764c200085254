"""Image generation with a base model plus a saved LoRA, through the pipeline's own ``__call__``.

This is what a registered model serves: no FlowGRPO machinery, just the diffusers pipeline with the
LoRA loaded by its own ``load_lora_weights``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from components.models.base import FlowMatchingModel, same_images
from components.models.config import ModelConfig
from components.models.loading import load_model


def load_with_lora(model_config: ModelConfig, seed: int, lora_dir: Path | None) -> FlowMatchingModel:
    """The base model of ``model_config`` (the tiny one is rebuilt from ``seed``) with the LoRA loaded."""
    model = load_model(model_config, seed)
    if lora_dir is not None:
        model.pipeline.load_lora_weights(str(lora_dir))
    return model


def generate(model: FlowMatchingModel, prompts: list[str], *, resolution: int, num_steps: int,
             guidance_scale: float, seed: int, images: list[list[np.ndarray]] | None = None) -> np.ndarray:
    """(N, H, W, 3) uint8 images, deterministic for ``seed``; a video family's (N, F, H, W, 3) frames. ``images``:
    each prompt's input images (uint8 (R, R, 3) at the model's resolution) for an editing or image-to-video family.
    Several editing pipelines take one prompt and one set of input images per call (Qwen-Image-Edit, Wan2.1 I2V,
    FLUX.2 klein's references): the prompts are sampled in runs that share both, one call each, from one generator."""
    generator = torch.Generator(model.device).manual_seed(seed)
    outputs = []
    with torch.no_grad():
        for start, stop in _runs(prompts, images):
            pil = None if images is None else [[Image.fromarray(x) for x in row] for row in images[start:stop]]
            out = model.pipeline(height=resolution, width=resolution, num_inference_steps=num_steps,
                                 generator=generator, output_type="np",
                                 **model.pipeline_inputs(prompts[start:stop], guidance_scale, pil))
            outputs.append(out.frames if model.video else out.images)
    return (np.clip(np.concatenate(outputs), 0, 1) * 255).round().astype(np.uint8)


def _runs(prompts: list[str], images: list[list[np.ndarray]] | None) -> list[tuple[int, int]]:
    """[start, stop) of the runs of consecutive prompts that share the prompt and the input images; all of them
    when there are no input images (one call, as before editing existed)."""
    if images is None:
        return [(0, len(prompts))]
    starts = [0] + [i for i in range(1, len(prompts))
                    if prompts[i] != prompts[i - 1] or not same_images(images[i], images[i - 1])]
    return list(zip(starts, [*starts[1:], len(prompts)], strict=True))
