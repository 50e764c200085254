"""Stable Diffusion 3.x: the SD3 MMDiT with CLIP-L, CLIP-G and T5 conditioning."""

from __future__ import annotations

import torch

from components.models.base import FlowMatchingModel, PromptEmbeddings


class SD3Model(FlowMatchingModel):
    # T5 tokens: upstream flow_grpo trains with 128 (the pipeline's default is 256; CLIP stays at 77)
    default_max_sequence_length = 128
    text_tokenizer = "tokenizer_3"

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {**super().pipeline_call_kwargs(guidance_scale), "max_sequence_length": self.max_sequence_length}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
        )
        return PromptEmbeddings({"prompt_embeds": embeds.to(self.dtype), "pooled_projections": pooled.to(self.dtype)})

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        side = resolution // self.pipeline.vae_scale_factor
        return (self.transformer.config.in_channels, side, side)

    def image_seq_len(self, resolution: int) -> int:
        _, h, w = self.latent_shape(resolution)
        p = self.transformer.config.patch_size
        return (h // p) * (w // p)

    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings, guidance: float) -> torch.Tensor:
        timestep = torch.full((latents.shape[0],), sigma * self.pipeline.scheduler.config.num_train_timesteps,
                              device=latents.device, dtype=torch.float32)
        return self.transformer(
            hidden_states=latents, timestep=timestep,
            encoder_hidden_states=embeds.tensors["prompt_embeds"],
            pooled_projections=embeds.tensors["pooled_projections"],
            return_dict=False,
        )[0]
