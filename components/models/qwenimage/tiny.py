"""A random-initialised, Qwen-Image-shaped diffusers pipeline built from config only (no files, no hub).

The real parts at toy size: the dual-stream MMDiT with 3-axis RoPE, a Qwen2.5-VL text encoder (2 layers,
vision tower of depth 1, which the text path never runs), the causal 3D VAE with per-channel latent
mean / std, and a byte-level BPE tokenizer trained on the pipeline's prompt template, so the template
prefix is the 34 tokens the pipeline drops, as with the real vocabulary. The VAE downsamples by 4, so a
32 px image is 4x4 = 16 tokens.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from components.models import tiny_tokenizers as tok

LATENT_CHANNELS = 16
TEXT_HIDDEN = 32
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
CORPUS = (TEMPLATE.format(""), "a photo of a red apple on a wooden table at night")


def tiny_text_encoder(tokenizer, seed: int, patch_size: int = 14) -> Qwen2_5_VLForConditionalGeneration:
    """``patch_size``: the vision tower's (the editing twin runs it on its input image)."""
    torch.manual_seed(seed)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in tok.QWEN_SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": TEXT_HIDDEN, "intermediate_size": 2 * TEXT_HIDDEN,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": special["<|endoftext|>"], "eos_token_id": special["<|im_end|>"],
            "pad_token_id": special["<|endoftext|>"],
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                       "out_hidden_size": TEXT_HIDDEN, "fullatt_block_indexes": [0], "patch_size": patch_size},
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_tiny_qwenimage(resolution: int, seed: int) -> QwenImagePipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    tokenizer = tok.qwen_tokenizer(CORPUS, vocab_size=600)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_transformer()
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLQwenImage(base_dim=16, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
                                     temperal_downsample=[False, False])
        text_encoder = tiny_text_encoder(tokenizer, seed + 2)
    pipe = QwenImagePipeline(transformer=transformer, scheduler=tiny_scheduler(), vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer)
    for module in (transformer, vae, text_encoder):
        module.eval().requires_grad_(False)
    return pipe


def tiny_transformer() -> QwenImageTransformer2DModel:
    """The dual-stream MMDiT at toy size (random weights from the current seed)."""
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN, axes_dims_rope=(4, 6, 6),
    )


def tiny_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's scheduler config: exponential dynamic shift with a terminal sigma."""
    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True,
    )
