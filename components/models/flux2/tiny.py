"""A random-initialised, FLUX.2 [klein] base-shaped diffusers pipeline built from config only (no files, no hub).

The real parts at toy size: double- and single-stream blocks with 4-axis RoPE and no guidance embedding, the
FLUX.2 VAE (2x2 patchified latents normalised by its batch-norm statistics, here random rather than the
untrained identity, so decoding must undo them), and a Qwen3 causal LM deep enough for the three hidden layers
the pipeline stacks (9, 18, 27), behind a byte-level BPE tokenizer with Qwen3's chat template. The base model
(``is_distilled`` false) guides with CFG. The VAE downsamples by 4, so a 32 px image is 4x4 = 16 tokens.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from components.models import tiny_tokenizers as tok
from components.models.sd3.tiny import VAE_BLOCKS
from components.models.zimage.tiny import CHAT_TEMPLATE

LATENT_CHANNELS = 8  # FLUX.2's VAE has 32; the transformer sees 4 x this per token
TEXT_HIDDEN = 16
TEXT_LAYERS = 28  # the pipeline stacks hidden states 9, 18 and 27 (Qwen3-4B has 36 layers)
TEXT_MAX_LENGTH = 64  # every prompt is padded to this many tokens (the real tokenizer allows 512)
CORPUS = ("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
          "a photo of a red apple on a wooden table at night")


def klein_tokenizer():
    """The tiny Qwen BPE with Qwen3's chat template, which the pipeline renders with thinking off."""
    tokenizer = tok.qwen_tokenizer(CORPUS, vocab_size=600)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = TEXT_MAX_LENGTH
    return tokenizer


def _text_encoder(tokenizer, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen3ForCausalLM(config)


def _vae(resolution: int, seed: int) -> AutoencoderKLFlux2:
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        latent_channels=LATENT_CHANNELS, down_block_types=("DownEncoderBlock2D",) * len(VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_BLOCKS), block_out_channels=VAE_BLOCKS,
        layers_per_block=1, norm_num_groups=16, sample_size=resolution,
    )
    vae.bn.running_mean.normal_(0.0, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def build_tiny_flux2(resolution: int, seed: int) -> Flux2KleinPipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    tokenizer = klein_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=3 * TEXT_HIDDEN, axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        )
        vae = _vae(resolution, seed + 1)
        text_encoder = _text_encoder(tokenizer, seed + 2)
    # FLUX.1-dev's scheduler config, which diffusers' FLUX.2 conversion gives the pipelines; klein computes the
    # dynamic shift's mu itself (compute_empirical_mu), so only use_dynamic_shifting and the shift type matter
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = Flux2KleinPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, is_distilled=False)
    for module in (transformer, vae, text_encoder):
        module.eval().requires_grad_(False)
    return pipe
