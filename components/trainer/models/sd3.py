"""Stable Diffusion 3.x: the SD3 MMDiT with CLIP-L, CLIP-G and T5 conditioning."""

from __future__ import annotations

import torch

from components.trainer.models.base import FlowMatchingModel, PromptEmbeddings


class SD3Model(FlowMatchingModel):
    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype, max_sequence_length: int) -> None:
        super().__init__(pipeline, device, dtype)
        self.max_sequence_length = max_sequence_length

    def pipeline_call_kwargs(self) -> dict:
        return {"max_sequence_length": self.max_sequence_length}

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

    def sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        scheduler = self.pipeline.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            _, h, w = self.latent_shape(resolution)
            p = self.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // p) * (w // p), scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096), scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.detach().float().cpu().clone()

    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings) -> torch.Tensor:
        timestep = torch.full((latents.shape[0],), sigma * self.pipeline.scheduler.config.num_train_timesteps,
                              device=latents.device, dtype=torch.float32)
        return self.transformer(
            hidden_states=latents, timestep=timestep,
            encoder_hidden_states=embeds.tensors["prompt_embeds"],
            pooled_projections=embeds.tensors["pooled_projections"],
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
