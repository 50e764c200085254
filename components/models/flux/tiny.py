"""A random-initialised, FLUX.1-dev-shaped diffusers pipeline built from config only (no files, no hub).

Every part of the real model is there at toy size: joint (double-stream) and single-stream blocks with
3-axis RoPE, the guidance embedding of the distilled dev model, 2x2-packed 16-channel latents, a pooled
CLIP-L-style encoder and a T5 encoder. The VAE downsamples by 4, so a 32 px image is 4x4 = 16 tokens.
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel

from components.models import tiny_tokenizers as tok
from components.models.sd3.tiny import (
    CLIP_HIDDEN,
    LATENT_CHANNELS,
    T5_DIM,
    T5_MAX_LENGTH,
    tiny_clip,
    tiny_t5,
    tiny_vae,
)


def build_tiny_flux(resolution: int, seed: int, pipeline_class: type = FluxPipeline) -> FluxPipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=T5_DIM,
            pooled_projection_dim=CLIP_HIDDEN, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
        )
        vae = tiny_vae(resolution, seed + 1, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE values
        text_encoder = tiny_clip(seed + 2, projection=False)
        text_encoder_2 = tiny_t5(seed + 3)
    # FLUX.1-dev's scheduler: resolution-dependent shift
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = pipeline_class(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tok.clip_tokenizer(),
        text_encoder_2=text_encoder_2, tokenizer_2=tok.t5_tokenizer(T5_MAX_LENGTH),
    )
    for module in (transformer, vae, text_encoder, text_encoder_2):
        module.eval().requires_grad_(False)
    return pipe


def build_tiny_flux_kontext(resolution: int, seed: int) -> FluxKontextPipeline:
    """The same tiny model as a FLUX.1-Kontext pipeline: it edits an input image (``kontext.py``)."""
    return build_tiny_flux(resolution, seed, FluxKontextPipeline)
