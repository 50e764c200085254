"""FLUX.1: a guidance-distilled MMDiT (dev) on packed latents, with CLIP-L (pooled) and T5 conditioning.

FLUX.1-dev has no CFG: ``guidance_scale`` is an input of every transformer forward (training's too), so the
ratio stays exactly 1 only if training embeds the sampling scale. FLUX.1-schnell has no guidance at all.
"""

from __future__ import annotations

import math

import torch

from components.models.base import PackedLatentModel, PromptEmbeddings
from components.models.families import GuidanceMode


class FluxModel(PackedLatentModel):
    # T5 tokens: upstream flow_grpo trains with 128 (the pipeline's default is 512)
    default_max_sequence_length = 128
    text_tokenizer = "tokenizer_2"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._img_ids: dict[object, torch.Tensor] = {}

    @property
    def guidance_mode(self) -> GuidanceMode:
        return "embedded" if self.transformer.config.guidance_embeds else "none"

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {"guidance_scale": guidance_scale, "max_sequence_length": self.max_sequence_length}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeddings({"prompt_embeds": embeds.to(self.dtype), "pooled_projections": pooled.to(self.dtype)})

    def _latent_ids(self, grid: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Position ids of a grid x grid token image (the pipeline's), made once per size."""
        if grid not in self._img_ids:
            self._img_ids[grid] = self.pipeline._prepare_latent_image_ids(None, grid, grid, device, dtype)
        return self._img_ids[grid]

    def _image_tokens(self, latents: torch.Tensor, embeds: PromptEmbeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's image tokens and their position ids: the noisy latents (Kontext appends its input's)."""
        return latents, self._latent_ids(math.isqrt(latents.shape[1]), latents.device, latents.dtype)

    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings, guidance: float) -> torch.Tensor:
        tokens, ids = self._image_tokens(latents, embeds)
        text = embeds.tensors["prompt_embeds"]
        g = None
        if self.transformer.config.guidance_embeds:
            g = torch.full((latents.shape[0],), guidance, device=latents.device, dtype=torch.float32)
        return self.transformer(
            hidden_states=tokens, timestep=self._timestep(latents, sigma), guidance=g,
            encoder_hidden_states=text, pooled_projections=embeds.tensors["pooled_projections"],
            txt_ids=torch.zeros(text.shape[1], 3, device=latents.device, dtype=latents.dtype),
            img_ids=ids, return_dict=False,
        )[0][:, :latents.shape[1]]
