"""A random-initialised, SD3-shaped diffusers pipeline built from config only (no files, no hub).

Shapes are chosen so a CPU samples a batch in well under a second while every
component of the real model is present: an MMDiT transformer with joint
attention, a 16-channel VAE, two CLIP text encoders with projections and a T5
encoder. The VAE downsamples by 4 (not 8) so a 32 px image has an 8x8 latent,
enough tokens for LoRA to change what the decoder shows.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from components.models import tiny_tokenizers as tok

LATENT_CHANNELS = 16
VAE_BLOCKS = (32, 32, 64)  # downsample factor 2 ** (len - 1) = 4
CLIP_HIDDEN = 16
CLIP_PROJECTION = 32
T5_DIM = 2 * CLIP_HIDDEN  # SD3 pads the concatenated CLIP states to the T5 width
T5_MAX_LENGTH = 32


def tiny_clip(seed: int, projection: bool = True, hidden: int = CLIP_HIDDEN, max_length: int = tok.CLIP_MAX_LENGTH,
              words: tuple[str, ...] = ()) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A 2-layer CLIP text encoder over the character-level vocabulary (FLUX takes the plain pooled one)."""
    torch.manual_seed(seed)
    bos, eos = tok.clip_bos_eos()
    config = CLIPTextConfig(
        vocab_size=tok.clip_vocab_size(words), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=max_length,
        projection_dim=CLIP_PROJECTION, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def tiny_t5(seed: int, d_model: int = T5_DIM, words: tuple[str, ...] = ()) -> T5EncoderModel:
    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(
        vocab_size=tok.t5_vocab_size(words), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    ))


def tiny_vae(resolution: int, seed: int, scaling_factor: float, shift_factor: float,
             blocks: tuple[int, ...] = VAE_BLOCKS, groups: int = 16) -> AutoencoderKL:
    """A 16-channel KL VAE that downsamples by 4 (SD3 and FLUX share the architecture, not the scaling)."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        block_out_channels=blocks, layers_per_block=1, norm_num_groups=groups, sample_size=resolution,
        scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    )


def build_tiny_sd3(resolution: int, seed: int) -> StableDiffusion3Pipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    latent = resolution // 2 ** (len(VAE_BLOCKS) - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=latent, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
            num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=T5_DIM,
            caption_projection_dim=32, pooled_projection_dim=2 * CLIP_PROJECTION, pos_embed_max_size=latent,
        )
        vae = tiny_vae(resolution, seed + 1, scaling_factor=1.5305, shift_factor=0.0609)
        text_encoder = tiny_clip(seed + 2)
        text_encoder_2 = tiny_clip(seed + 3)
        text_encoder_3 = tiny_t5(seed + 4)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder, tokenizer=tok.clip_tokenizer(),
        text_encoder_2=text_encoder_2, tokenizer_2=tok.clip_tokenizer(),
        text_encoder_3=text_encoder_3, tokenizer_3=tok.t5_tokenizer(T5_MAX_LENGTH),
    )
    for module in (transformer, vae, text_encoder, text_encoder_2, text_encoder_3):
        module.eval().requires_grad_(False)
    return pipe
