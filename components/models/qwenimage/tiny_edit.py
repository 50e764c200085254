"""A random-initialised Qwen-Image-Edit-2509-shaped diffusers pipeline (``QwenImageEditPlusPipeline``) built from
config only (no files, no hub).

The tiny Qwen-Image's transformer, scheduler and Qwen2.5-VL text encoder (``tiny.py``), here with the vision
tower the edit pipeline runs on its input image, a ``Qwen2VLProcessor`` built in memory, and a BPE tokenizer trained
on the edit prompt template, so the template's system prefix is the 64 tokens the pipeline drops, as with the real
vocabulary. The pipeline encodes its input image at its own sizes whatever the output's (the VAE at 1024x1024, the
vision tower at 384x384); so that this costs a CPU test little, the VAE downsamples by 32 (1024 px: 16x16 = 256
tokens beside a 128 px output's 2x2; 16x gave 1024, which made a forward on a loaded CPU ~10x dearer) from 4
channels at full size (its 1M pixels then cost ~1.2 s, not 2.6 s with 16, ~3 s in float64, not 11 s), and the
vision patches are 32 px (384 px: 36 image tokens in the text).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLQwenImage, QwenImageEditPlusPipeline
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from components.models import tiny_tokenizers as tok
from components.models.qwenimage.edit import ImageQwen2VLProcessor
from components.models.qwenimage.tiny import LATENT_CHANNELS, tiny_scheduler, tiny_text_encoder, tiny_transformer

TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
            "background), then explain how the user's text instruction should alter or modify the image. Generate a "
            "new image that meets the user's requirements while maintaining consistency with the original input "
            "where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
CORPUS = (TEMPLATE.format("Picture 1: "), "make the red apple on the wooden table green")
VISION_PATCH = 32


def build_tiny_qwenimage_edit(resolution: int, seed: int) -> QwenImageEditPlusPipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    tokenizer = tok.qwen_tokenizer(CORPUS, vocab_size=700)
    processor = ImageQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=VISION_PATCH, merge_size=2, temporal_patch_size=2),
        tokenizer=tokenizer,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_transformer()
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLQwenImage(base_dim=4, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 4, 4, 4, 4], num_res_blocks=1,
                                     temperal_downsample=[False] * 5)
        text_encoder = tiny_text_encoder(tokenizer, seed + 2, patch_size=VISION_PATCH)
    pipe = QwenImageEditPlusPipeline(transformer=transformer, scheduler=tiny_scheduler(), vae=vae,
                                     text_encoder=text_encoder, tokenizer=tokenizer, processor=processor)
    # saved, the folder names the processor as the hub's does (the loader reads it as ImageQwen2VLProcessor)
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    for module in (transformer, vae, text_encoder):
        module.eval().requires_grad_(False)
    return pipe
