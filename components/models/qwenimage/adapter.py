"""Qwen-Image: an MMDiT on 2x2-packed latents of a 3D (video) VAE, conditioned on Qwen2.5-VL hidden states.

Guidance is true CFG: the negative prompt gets its own forward (its text length differs from the prompt's,
as in the pipeline), and the guided velocity is rescaled to the conditional one's norm per token.
"""

from __future__ import annotations

import math

import torch

from components.models.base import PackedLatentModel, PromptEmbeddings, decode_wan_vae


class QwenImageModel(PackedLatentModel):
    guidance_mode = "true_cfg"
    batch_cfg = False
    default_max_sequence_length = 512  # the pipeline's, which upstream flow_grpo keeps

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        # the pipeline enables true CFG only with a negative prompt (an empty one counts)
        negative = self.negative_prompt if guidance_scale > 1 else None
        return {"true_cfg_scale": guidance_scale, "negative_prompt": negative,
                "max_sequence_length": self.max_sequence_length}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        embeds, mask = self.pipeline.encode_prompt(prompt=prompts, device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask; rows must keep one to be selected and batched
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return PromptEmbeddings({"prompt_embeds": embeds.to(self.dtype), "prompt_embeds_mask": mask})

    def trim_embedding(self, row: PromptEmbeddings) -> PromptEmbeddings:
        length = int(row.tensors["prompt_embeds_mask"].sum())
        return PromptEmbeddings({k: v[:, :length] for k, v in row.tensors.items()})

    def combine_cfg(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        guided = uncond + scale * (cond - uncond)
        return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

    def _image_tokens(self, latents: torch.Tensor, embeds: PromptEmbeddings) -> tuple[torch.Tensor, list]:
        """The transformer's image tokens and their ``img_shapes`` (frames, rows, columns of each grid): the noisy
        latents (Qwen-Image-Edit appends its input's)."""
        grid = math.isqrt(latents.shape[1])
        return latents, [[(1, grid, grid)]] * latents.shape[0]

    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings, guidance: float) -> torch.Tensor:
        mask = embeds.tensors["prompt_embeds_mask"]
        tokens, img_shapes = self._image_tokens(latents, embeds)
        return self.transformer(
            hidden_states=tokens, timestep=self._timestep(latents, sigma),
            encoder_hidden_states=embeds.tensors["prompt_embeds"],
            # as the pipeline: no mask when nothing is padded (the unmasked attention path)
            encoder_hidden_states_mask=None if embeds.cached("unpadded", lambda: bool(mask.all())) else mask,
            img_shapes=img_shapes, return_dict=False,
        )[0][:, :latents.shape[1]]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_wan_vae(self.pipeline.vae, self._unpack(latents))[:, :, 0]  # (B, C, 1, H, W): one frame
