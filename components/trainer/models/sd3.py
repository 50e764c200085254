"""Stable Diffusion 3.x: the SD3 MMDiT with CLIP-L, CLIP-G and T5 conditioning."""

from __future__ import annotations

import torch

from components.trainer.models.base import FlowMatchingModel, PromptEmbeddings


class SD3Model(FlowMatchingModel):
    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype, negative_prompt: str = "") -> None:
        super().__init__(pipeline, device, dtype, negative_prompt)
        # the pipeline's default T5 length, or the (tiny) tokenizer's if shorter
        self.max_sequence_length = min(256, pipeline.tokenizer_3.model_max_length)

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {**super().pipeline_call_kwargs(guidance_scale), "max_sequence_length": self.max_sequence_length}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
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
