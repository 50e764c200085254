"""A random-initialised, Wan2.1-I2V-shaped image-to-video diffusers pipeline built from config only (no files, no hub).

tiny-wan's text encoder, VAE and scheduler (``tiny.py``) with the image-to-video parts at toy size:
a CLIP ViT image encoder (32 px, 8 px patches: 17 tokens, its penultimate layer's states read, as Wan2.1-I2V reads
ViT-H/14's 257), its CLIPImageProcessor (resize, centre crop, CLIP's mean / std), and a transformer that takes the
mask and the first frame's latents beside the noisy ones (2 x 16 + 2 input channels: the tiny VAE groups frames by
2 in time, Wan2.1's by 4, so 36 there) and cross-attends to the image tokens as well as to the text.
"""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline
from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

from components.models.wan.tiny import LATENT_CHANNELS, tiny_parts, tiny_transformer

IMAGE_SIZE = 32
IMAGE_HIDDEN = 32
TIME_GROUP = 2  # the tiny VAE's scale_factor_temporal: the mask's channels


def _image_encoder(seed: int) -> CLIPVisionModel:
    torch.manual_seed(seed)
    return CLIPVisionModel(CLIPVisionConfig(
        hidden_size=IMAGE_HIDDEN, intermediate_size=2 * IMAGE_HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=8, projection_dim=IMAGE_HIDDEN,
    ))


def build_tiny_wan_i2v(resolution: int, seed: int) -> WanImageToVideoPipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    with torch.random.fork_rng(devices=[]):
        # image_dim: the CLIP states' width; added_kv_proj_dim: the attention's width (2 heads x 16), as Wan2.1-I2V's
        # 5120 is its 40 x 128
        transformer = tiny_transformer(seed, in_channels=2 * LATENT_CHANNELS + TIME_GROUP, image_dim=IMAGE_HIDDEN,
                                       added_kv_proj_dim=32)
        parts = tiny_parts(seed)
        image_encoder = _image_encoder(seed + 3)
    # CLIP's own preprocessing (bicubic resize of the shorter side, centre crop, OpenAI mean / std) at the toy size;
    # the PIL backend, which transformers falls back to for the released CLIPImageProcessor without torchvision
    processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                      crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    pipe = WanImageToVideoPipeline(transformer=transformer, image_encoder=image_encoder, image_processor=processor,
                                   **parts)
    for module in (transformer, parts["vae"], parts["text_encoder"], image_encoder):
        module.eval().requires_grad_(False)
    return pipe
