"""A random-initialised, Wan2.1-shaped text-to-video diffusers pipeline built from config only (no files, no hub).

The real parts at toy size: the video DiT (3D RoPE, (1, 2, 2) patches, self-attention over every frame's tokens,
cross-attention to the text), a UMT5 text encoder with a character-level tokenizer, and the causal 3D VAE with
Wan's per-channel latent mean / std. The VAE downsamples space by 4 and time by 2 (Wan2.1: 8 and 4), so 5 frames
of 32 px are 3 latent frames of 8x8, 3 x 4 x 4 = 48 video tokens.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from components.models import tiny_tokenizers as tok

LATENT_CHANNELS = 16  # Wan2.1's z_dim: the VAE's latents_mean / latents_std have 16 entries
TEXT_HIDDEN = 32
TOKENIZER_MAX_LENGTH = 512  # umt5-xxl's tokenizer limit
FLOW_SHIFT = 3.0  # Wan2.1 at 480p (the WanPipeline docstring's flow_shift)


def _text_encoder(seed: int) -> UMT5EncoderModel:
    torch.manual_seed(seed)
    return UMT5EncoderModel(UMT5Config(
        vocab_size=tok.t5_vocab_size(), d_model=TEXT_HIDDEN, d_kv=16, d_ff=2 * TEXT_HIDDEN, num_layers=2,
        num_heads=2, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))


def tiny_transformer(seed: int, **changes) -> WanTransformer3DModel:
    """The tiny video DiT; ``changes`` override its config (image-to-video: input channels, image cross-attention)."""
    torch.manual_seed(seed)
    return WanTransformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": LATENT_CHANNELS,
        "out_channels": LATENT_CHANNELS, "text_dim": TEXT_HIDDEN, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
        "rope_max_seq_len": 64, **changes})


def tiny_vae(seed: int) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=16, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True], scale_factor_temporal=2, scale_factor_spatial=4)


def tiny_parts(seed: int) -> dict:
    """The parts both tiny Wan pipelines share: tokenizer, text encoder, VAE and scheduler."""
    return {"tokenizer": tok.t5_tokenizer(TOKENIZER_MAX_LENGTH), "text_encoder": _text_encoder(seed + 2),
            "vae": tiny_vae(seed + 1),
            # Euler under Wan2.1's 480p shift: the schedule the shared SDE sampler steps (the released pipelines
            # ship UniPC)
            "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FLOW_SHIFT)}


def build_tiny_wan(resolution: int, seed: int) -> WanPipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    with torch.random.fork_rng(devices=[]):
        transformer = tiny_transformer(seed)
        parts = tiny_parts(seed)
    pipe = WanPipeline(transformer=transformer, **parts)
    for module in (transformer, parts["vae"], parts["text_encoder"]):
        module.eval().requires_grad_(False)
    return pipe
