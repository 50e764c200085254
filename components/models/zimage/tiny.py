"""A random-initialised, Z-Image-shaped diffusers pipeline built from config only (no files, no hub).

The real parts at toy size: the single-stream DiT (noise and caption refiners, then joint blocks over image and
caption tokens, 3-axis RoPE, the transformer's own 2x2 patching), a Qwen3 text encoder read at its
second-to-last hidden state, FLUX.1's 16-channel VAE scaling, and a byte-level BPE tokenizer with Qwen3's chat
template (the pipeline wraps each prompt in it). The VAE downsamples by 4, so a 32 px image is an 8x8 latent,
4x4 = 16 image tokens.
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from components.models import tiny_tokenizers as tok
from components.models.sd3.tiny import LATENT_CHANNELS, tiny_vae

TEXT_HIDDEN = 32
# What Qwen3's template renders for one user message with add_generation_prompt and enable_thinking (the
# pipeline's call): no system turn, no <think> block.
CHAT_TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{%- if enable_thinking is defined and enable_thinking is false %}"
                 "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
CORPUS = ("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n", "a photo of a red apple on a wooden table at night")


def zimage_tokenizer():
    """The tiny Qwen BPE with the chat template the pipeline applies."""
    tokenizer = tok.qwen_tokenizer(CORPUS, vocab_size=600)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _text_encoder(tokenizer, seed: int) -> Qwen3Model:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen3Model(config)


def build_tiny_zimage(resolution: int, seed: int) -> ZImagePipeline:
    """Build the tiny pipeline; the same seed gives the same weights, in eval mode, float32."""
    tokenizer = zimage_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            in_channels=LATENT_CHANNELS, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
            cap_feat_dim=TEXT_HIDDEN, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
        )
        # the pad tokens are zeros at init; random ones make the padding of captions and images matter
        for pad in (transformer.x_pad_token, transformer.cap_pad_token):
            torch.nn.init.normal_(pad, std=0.02)
        vae = tiny_vae(resolution, seed + 1, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE values
        text_encoder = _text_encoder(tokenizer, seed + 2)
    # Z-Image (base)'s scheduler config: a fixed shift of 6, no resolution-dependent shift
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer)
    for module in (transformer, vae, text_encoder):
        module.eval().requires_grad_(False)
    return pipe
