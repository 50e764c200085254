"""Qwen-Image-Edit-2509 ("Plus", ``QwenImageEditPlusPipeline``): Qwen-Image editing an input image, which enters
twice, as the pipeline does (docs/MODELS.md):

- the Qwen2.5-VL text encoder sees it: resized to the pipeline's condition area (384 x 384 px for a square) and
  named in the prompt as ``Picture 1: <|vision_start|><|image_pad|><|vision_end|>`` before the instruction, so the
  text embedding carries its vision tokens. The negative prompt of true CFG is encoded with the image too, so each
  row has its own negative (``negative_for``).
- its VAE latents (the posterior's mode, normalised per channel, resized first to the pipeline's VAE area: 1024 x
  1024 px for a square, whatever the output size) are packed into 2x2 tokens and appended to the noisy tokens,
  ``img_shapes`` naming both grids for the 3-axis RoPE; the velocity is read off the noisy tokens alone.

One input image per prompt: the pipeline takes a list (several references, "Picture 1", "Picture 2", ...), and
more would take each row's images through the same two paths, their tokens appended in order.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
from PIL import Image
from transformers import Qwen2VLProcessor

from components.errors import DataError
from components.models.base import PromptEmbeddings, input_pixels, same_images
from components.models.qwenimage.adapter import QwenImageModel

NEGATIVE_KEYS = ("negative_prompt_embeds", "negative_prompt_embeds_mask")


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """transformers' ``Qwen2VLProcessor`` without its video processor: the pipeline gives it images only, and the
    video processor needs torchvision, which the project's image does not ship (its absence makes the stock
    class refuse to build). It reads the hub's ``processor/`` folder as the stock class does."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class QwenImageEditModel(QwenImageModel):
    input_images = 1
    condition_keys = ("image_latents",)

    @classmethod
    def pipeline_components(cls, root: Path) -> dict:
        return {"processor": ImageQwen2VLProcessor.from_pretrained(str(root / "processor"), local_files_only=True)}

    def pipeline_inputs(self, prompts: list[str], guidance_scale: float, images: list[list] | None = None) -> dict:
        inputs = super().pipeline_inputs(prompts, guidance_scale)
        if images is None:
            return inputs
        # the pipeline's __call__ refuses a batch (its image list is one prompt's references) but makes several
        # samples of one prompt and image (the evaluation's images_per_prompt)
        same = all(p == prompts[0] for p in prompts) and all(same_images(row, images[0]) for row in images)
        if not same:
            raise DataError(f"{type(self.pipeline).__name__} edits one prompt and input image per call; got "
                            f"{len(prompts)} different ones")
        return {**inputs, "prompt": prompts[:1], "image": list(images[0]), "num_images_per_prompt": len(prompts)}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        if images is None:  # the text alone (the template without a picture)
            return super().encode_prompts(prompts)
        rows = []
        for prompt, image in zip(prompts, images[:, 0], strict=True):
            condition = self._resized(_pil(image), plus.CONDITION_IMAGE_SIZE)
            text = self._text(prompt, condition)
            negative = self._text(self.negative_prompt, condition)
            rows.append(PromptEmbeddings({**text, **dict(zip(NEGATIVE_KEYS, negative.values(), strict=True))}))
        return PromptEmbeddings({**PromptEmbeddings.cat(rows).tensors, **self.encode_input_images(images)})

    @torch.no_grad()
    def encode_input_images(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """``image_latents``: each input's packed VAE tokens; the text encoder's view of it is in the prompt's
        embedding (``encode_prompts``)."""
        return {"image_latents": torch.cat([self._image_latents(_pil(image)) for image in images[:, 0]])}

    def _text(self, prompt: str, condition: Image.Image) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipeline.encode_prompt(prompt=[prompt], image=[condition], device=self.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds.to(self.dtype), "prompt_embeds_mask": mask}

    def _resized(self, image: Image.Image, area: int) -> Image.Image:
        width, height = plus.calculate_dimensions(area, image.width / image.height)
        return self.pipeline.image_processor.resize(image, height, width)

    def _image_latents(self, image: Image.Image) -> torch.Tensor:
        """The packed VAE tokens of the input, (1, tokens, 4 x VAE channels), as the pipeline makes them."""
        pipe = self.pipeline
        width, height = plus.calculate_dimensions(plus.VAE_IMAGE_SIZE, image.width / image.height)
        pixels = pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
        z = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None)
        return pipe._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4]).to(self.dtype)

    def negative_for(self, cond: PromptEmbeddings) -> PromptEmbeddings:
        if "image_latents" not in cond.tensors:
            return super().negative_for(cond)
        return PromptEmbeddings({"prompt_embeds": cond.tensors["negative_prompt_embeds"],
                                 "prompt_embeds_mask": cond.tensors["negative_prompt_embeds_mask"],
                                 "image_latents": cond.tensors["image_latents"]})

    def trim_embedding(self, row: PromptEmbeddings) -> PromptEmbeddings:
        out = dict(row.tensors)
        for embeds, mask in (("prompt_embeds", "prompt_embeds_mask"), NEGATIVE_KEYS):
            if mask in out:
                length = int(out[mask].sum())
                out[embeds], out[mask] = out[embeds][:, :length], out[mask][:, :length]
        return PromptEmbeddings(out)

    def _image_tokens(self, latents: torch.Tensor, embeds: PromptEmbeddings) -> tuple[torch.Tensor, list]:
        image = embeds.tensors["image_latents"]
        grid, image_grid = math.isqrt(latents.shape[1]), math.isqrt(image.shape[1])
        shapes = [[(1, grid, grid), (1, image_grid, image_grid)]] * latents.shape[0]
        return torch.cat([latents, image.to(latents.dtype)], dim=1), shapes


def _pil(image: torch.Tensor) -> Image.Image:
    """(3, R, R) in [-1, 1] (an exact image of uint8 pixels, ``model_input``) -> the PIL image it came from."""
    return Image.fromarray(np.ascontiguousarray(input_pixels(image).permute(1, 2, 0).cpu().numpy()))
