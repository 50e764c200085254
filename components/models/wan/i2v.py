"""Wan2.1 image-to-video: Wan2.1's video DiT animating an input image, which becomes the first frame.

As ``WanImageToVideoPipeline`` conditions it, the image enters every forward twice, and both are computed once per
prompt here and kept in the embedding (``condition_keys``), so the CFG negative rows carry them as the pipeline's
negative pass does:
- ``image_embeds``: the CLIP image encoder's penultimate hidden states of the image (the pipeline's
  ``encode_image``), which the transformer's cross-attention reads beside the text (``encoder_hidden_states_image``);
- ``condition``: the image as the first frame of a video whose other frames are zero, VAE-encoded (the posterior's
  mode) and normalised with the VAE's latents_mean / latents_std, after a mask of the VAE's time grouping
  (``vae_scale_factor_temporal`` channels, ones on the first latent frame, which holds the known frame): concatenated
  channel-wise to the noisy latents, hence the transformer's 2 x 16 + 4 = 36 input channels. It predicts the
  16 channels of the video alone, which the SDE step and its log-prob see.
Guidance is plain CFG: the negative pass has the negative text with the same image embeds and condition latents.

Deviation: the 480P pipeline makes 832 x 480 videos; models here make square frames of ``model.resolution`` and
the input image is cropped to its centre square first (``components/dataset/input_images.py``).
"""

from __future__ import annotations

import torch

from components.errors import DataError, ModelLoadError
from components.models.base import PromptEmbeddings, input_pixels, same_images, wan_latent_stats
from components.models.wan.adapter import WanModel


class WanImageToVideoModel(WanModel):
    input_images = 1
    condition_keys = ("image_embeds", "condition")

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype, negative_prompt: str = "",
                 max_sequence_length: int | None = None, num_frames: int = 1) -> None:
        super().__init__(pipeline, device, dtype, negative_prompt, max_sequence_length, num_frames)
        if pipeline.config.expand_timesteps:
            raise ModelLoadError("model.path holds a Wan2.2 TI2V pipeline (expand_timesteps is set); only Wan2.1 "
                                 "image-to-video pipelines are supported")
        if self.transformer.config.image_dim is None or pipeline.image_encoder is None:
            raise ModelLoadError("model.path holds a WanImageToVideoPipeline without the CLIP image encoder Wan2.1 "
                                 "image-to-video reads (transformer image_dim, image_encoder); only Wan2.1 "
                                 "image-to-video pipelines are supported")

    def pipeline_inputs(self, prompts: list[str], guidance_scale: float, images: list[list] | None = None) -> dict:
        # the text comes in as embeddings: the pipeline's own prompt cleaning needs ftfy (see WanModel.encode_prompts)
        inputs = {k: v for k, v in super().pipeline_inputs(prompts, guidance_scale).items()
                  if k not in ("prompt", "negative_prompt")}
        inputs["prompt_embeds"] = self.encode_prompts(prompts).tensors["prompt_embeds"]
        inputs["negative_prompt_embeds"] = self.negative_embeddings().expand_to(len(prompts)).tensors["prompt_embeds"]
        if not images:
            return inputs
        # the pipeline animates one image per call, repeated over its prompts (a list of several would be
        # encoded once per prompt per image)
        if not all(same_images(row[:1], images[0][:1]) for row in images[1:]):
            raise DataError("WanImageToVideoPipeline animates one input image per call; call it once per image")
        return {**inputs, "image": images[0][0]}

    def move_text_encoders(self, device: torch.device) -> None:
        super().move_text_encoders(device)
        self.to_device("image_encoder", device=device)

    def release_text_encoders(self) -> None:
        super().release_text_encoders()
        self.pipeline.image_encoder = None

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        text = super().encode_prompts(prompts)
        if images is None:  # the text alone: the shared CFG negative
            return text
        return PromptEmbeddings({**text.tensors, **self.encode_input_images(images)})

    @torch.no_grad()
    def encode_input_images(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """The first frame's CLIP states ``image_embeds`` and its ``condition`` latents."""
        first = images[:, 0]
        return {"image_embeds": self.encode_image(first), "condition": self.encode_condition(first)}

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, R, R) in [-1, 1] -> the CLIP image encoder's penultimate states (B, tokens, width), through the
        pipeline's own ``encode_image`` and image processor, which take the images' uint8 pixels."""
        arrays = list(input_pixels(pixels).permute(0, 2, 3, 1).cpu().numpy())
        return self.pipeline.encode_image(arrays, self.device).to(self.dtype)

    def encode_condition(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, R, R) in [-1, 1] -> the mask and the normalised latents of the video that starts with the image
        and is zero after it, (B, vae_scale_factor_temporal + 16, latent frames, R / 8, R / 8)."""
        vae = self.pipeline.vae
        b, c, h, w = pixels.shape
        video = torch.cat([pixels[:, :, None], pixels.new_zeros(b, c, self.num_frames - 1, h, w)], dim=2)
        z = vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode().to(self.device, torch.float32)
        mean, std = wan_latent_stats(vae, z.device, torch.float32)
        # pixel frame 0 fills the first latent frame's group of vae_scale_factor_temporal frames alone (the VAE is
        # causal), every later group holds generated frames: ones on latent frame 0, zeros after
        mask = torch.zeros(b, self.pipeline.vae_scale_factor_temporal, *z.shape[2:], device=z.device)
        mask[:, :, 0] = 1
        return torch.cat([mask, (z - mean) / std], dim=1).to(self.dtype)

    def _inputs(self, latents: torch.Tensor, embeds: PromptEmbeddings) -> dict[str, torch.Tensor]:
        condition = embeds.tensors["condition"].to(latents.dtype)
        return {**super()._inputs(torch.cat([latents, condition], dim=1), embeds),
                "encoder_hidden_states_image": embeds.tensors["image_embeds"]}
