"""Wan2.1 text-to-video: a DiT over (1, 2, 2) patches of every latent frame, cross-attending to UMT5 states, and
a causal 3D VAE (time compressed 4x after the first frame, space 8x).

The family's conventions, mapped onto the shared sampler (velocity = d x / d sigma, noise at sigma 1):
- Latents keep their time axis, (C, T, H, W) with T = (num_frames - 1) / 4 + 1; the transformer patchifies them
  itself, and the SDE step and its log-prob (a mean over every latent dimension) see the time axis as one more.
- It is conditioned on the timestep 1000 sigma and predicts the velocity, as SD3.
- Text is padded with zeros to ``max_sequence_length`` and no mask is passed, so the negative prompt batches
  with the prompt (plain CFG, ``uncond + w (cond - uncond)``).
- The released pipeline ships a UniPC multistep scheduler; the SDE sampler steps Euler, so the adapter swaps in
  the flow-matching Euler scheduler under the same shift (Flow-Factory steps its own SDE scheduler too).
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from components.errors import ModelLoadError
from components.models.base import FlowMatchingModel, PromptEmbeddings, decode_wan_vae

# Flow-Factory's default Wan LoRA targets: self- and cross-attention and the feed-forward of every block
WAN_LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
DEFAULT_FLOW_SHIFT = 3.0  # the WanPipeline docstring's 480p value (5.0 for 720p)


class WanModel(FlowMatchingModel):
    video = True
    lora_targets = WAN_LORA_TARGETS
    default_max_sequence_length = 226  # the pipeline's, which Flow-Factory keeps

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype, negative_prompt: str = "",
                 max_sequence_length: int | None = None, num_frames: int = 1) -> None:
        super().__init__(pipeline, device, dtype, negative_prompt, max_sequence_length, num_frames)
        step = pipeline.vae_scale_factor_temporal
        if (num_frames - 1) % step:
            below = (num_frames - 1) // step * step + 1
            raise ModelLoadError(f"model.num_frames is {num_frames}; Wan's VAE needs (num_frames - 1) divisible by "
                                 f"{step}: use {below} or {below + step}")
        if pipeline.config.boundary_ratio is not None:
            raise ModelLoadError("model.path holds a two-expert Wan2.2 pipeline (boundary_ratio is set); only "
                                 "single-transformer Wan2.1 pipelines (text- and image-to-video) are supported")
        if not isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler):
            shift = pipeline.scheduler.config.get("flow_shift") or DEFAULT_FLOW_SHIFT
            pipeline.scheduler = FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=pipeline.scheduler.config.num_train_timesteps, shift=shift)

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {"guidance_scale": guidance_scale, "negative_prompt": self.negative_prompt,
                "max_sequence_length": self.max_sequence_length, "num_frames": self.num_frames}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        # WanPipeline's own text path (encode_prompt without CFG is this call) for both Wan2.1 pipelines: the
        # image-to-video one's is the same code, but cleans prompts with ftfy unconditionally (diffusers 0.42.1),
        # which is no dependency here; this one runs ftfy when it is installed
        embeds = WanPipeline._get_t5_prompt_embeds(self.pipeline, prompt=prompts, device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
        return PromptEmbeddings({"prompt_embeds": embeds.to(self.dtype)})

    def latent_frames(self) -> int:
        return (self.num_frames - 1) // self.pipeline.vae_scale_factor_temporal + 1

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        side = resolution // self.pipeline.vae_scale_factor_spatial
        # what the transformer predicts: its input may carry conditioning channels too (image-to-video)
        return (self.transformer.config.out_channels, self.latent_frames(), side, side)

    def image_seq_len(self, resolution: int) -> int:
        _, frames, h, w = self.latent_shape(resolution)
        _, ph, pw = self.transformer.config.patch_size
        return frames * (h // ph) * (w // pw)

    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings, guidance: float) -> torch.Tensor:
        timestep = torch.full((latents.shape[0],), sigma * self.pipeline.scheduler.config.num_train_timesteps,
                              device=latents.device, dtype=torch.float32)
        return self.transformer(timestep=timestep, return_dict=False, **self._inputs(latents, embeds))[0]

    def _inputs(self, latents: torch.Tensor, embeds: PromptEmbeddings) -> dict[str, torch.Tensor]:
        """The transformer's inputs besides the timestep."""
        return {"hidden_states": latents, "encoder_hidden_states": embeds.tensors["prompt_embeds"]}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_wan_vae(self.pipeline.vae, latents).transpose(1, 2)  # (B, F, 3, H, W)
