"""FLUX.1-Kontext: FLUX.1 editing an input image, whose packed latents join the image tokens of every forward.

As ``FluxKontextPipeline`` does: the input image is VAE-encoded (the posterior's mode, shifted and scaled), packed
into 2x2 tokens and appended to the noisy tokens, with position ids whose first coordinate is 1 (the noisy ones
have 0); the transformer's velocity is read off the noisy tokens alone. Guidance is FLUX.1-dev's embedded scale.
"""

from __future__ import annotations

import math

import torch

from components.models.base import PromptEmbeddings
from components.models.flux.adapter import FluxModel

# input images per VAE-encoder forward: its activations at 512 px are 0.31 GiB an image in bf16 (counted with
# fake tensors), so the 64 prompts the prompt cache encodes at a time would need 20 GiB in one forward
ENCODE_IMAGES = 8


class FluxKontextModel(FluxModel):
    input_images = 1
    condition_keys = ("image_latents",)

    def pipeline_inputs(self, prompts: list[str], guidance_scale: float, images: list[list] | None = None) -> dict:
        # the images come at the model's resolution, which is then the output's: the pipeline's resize to its
        # preferred sizes is off, and its output area (1 MP by default) is the input's
        inputs = super().pipeline_inputs(prompts, guidance_scale)
        if not images:
            return inputs
        first = images[0][0]
        return {**inputs, "image": [row[0] for row in images], "_auto_resize": False,
                "max_area": first.width * first.height}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        text = super().encode_prompts(prompts)
        if images is None:  # the text alone: what negative_embeddings keeps
            return text
        return PromptEmbeddings({**text.tensors, **self.encode_input_images(images)})

    @torch.no_grad()
    def encode_input_images(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """``image_latents``: the input's packed tokens (``encode_image``)."""
        return {"image_latents": self.encode_image(images[:, 0])}

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, R, R) in [-1, 1] -> packed image tokens in the model dtype, as many as a latent's (B, tokens,
        4 x VAE channels): the posterior's mode, shifted and scaled, packed as the pipeline packs its latents."""
        vae = self.pipeline.vae
        z = torch.cat([vae.encode(chunk.to(self.device, vae.dtype)).latent_dist.mode()
                       for chunk in pixels.split(ENCODE_IMAGES)])
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor
        b, c, h, w = z.shape
        return self.pipeline._pack_latents(z, b, c, h, w).to(self.dtype)

    def _image_tokens(self, latents: torch.Tensor, embeds: PromptEmbeddings) -> tuple[torch.Tensor, torch.Tensor]:
        image = embeds.tensors["image_latents"]
        key = ("kontext", latents.shape[1], image.shape[1])
        if key not in self._img_ids:
            image_ids = self._latent_ids(math.isqrt(image.shape[1]), latents.device, latents.dtype).clone()
            image_ids[..., 0] = 1
            self._img_ids[key] = torch.cat([super()._image_tokens(latents, embeds)[1], image_ids])
        return torch.cat([latents, image.to(latents.dtype)], dim=1), self._img_ids[key]
