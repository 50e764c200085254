"""The demo model: a small SD3-shaped pipeline pretrained on drawn shapes, its weights shipped in the package.

Same classes as the real SD3 (MMDiT transformer, 16-channel KL VAE, two CLIP encoders and a T5 encoder),
larger than ``tiny-sd3`` where prompt following needs it: a 4-block transformer of width 64, text encoders
of width 32/64, and tokenizers that keep each word of the shapes grammar whole (16 text tokens, not 77
characters). ``components.models.shapes_pretrain`` trains it from a seed; ``weights/shapes-sd3.safetensors``
holds the result (docs/MODELS.md, "The demo model").
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from safetensors.torch import load_file

from components.errors import ModelLoadError
from components.models import tiny_tokenizers as tok
from components.models.families import SHAPES_RESOLUTION as RESOLUTION
from components.models.sd3.tiny import LATENT_CHANNELS, tiny_clip, tiny_t5, tiny_vae
from components.shapes.scenes import VOCABULARY

TEXT_LENGTH = 16  # tokens: the grammar's words are single tokens and its longest prompt has 7 words
CLIP_WIDTH = 32
T5_WIDTH = 2 * CLIP_WIDTH
VAE_BLOCKS = (16, 32, 32)  # downsample 4: 12x12x16 latents
SCHEDULER_SHIFT = 3.0
WEIGHTS = Path(__file__).resolve().parent / "weights" / "shapes-sd3.safetensors"
MODULES = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def build_architecture(seed: int, scaling_factor: float = 1.0, shift_factor: float = 0.0) -> StableDiffusion3Pipeline:
    """The untrained pipeline (random weights from ``seed``), in train mode for the pretraining script."""
    latent = RESOLUTION // 2 ** (len(VAE_BLOCKS) - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=latent, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
            num_layers=4, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=T5_WIDTH,
            caption_projection_dim=64, pooled_projection_dim=2 * 32, pos_embed_max_size=latent,
        )
        vae = tiny_vae(RESOLUTION, seed + 1, scaling_factor=scaling_factor, shift_factor=shift_factor,
                       blocks=VAE_BLOCKS, groups=8)
        text_encoder = tiny_clip(seed + 2, hidden=CLIP_WIDTH, max_length=TEXT_LENGTH, words=VOCABULARY)
        text_encoder_2 = tiny_clip(seed + 3, hidden=CLIP_WIDTH, max_length=TEXT_LENGTH, words=VOCABULARY)
        text_encoder_3 = tiny_t5(seed + 4, d_model=T5_WIDTH, words=VOCABULARY)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
        vae=vae,
        text_encoder=text_encoder, tokenizer=tok.clip_tokenizer(TEXT_LENGTH, VOCABULARY),
        text_encoder_2=text_encoder_2, tokenizer_2=tok.clip_tokenizer(TEXT_LENGTH, VOCABULARY),
        text_encoder_3=text_encoder_3, tokenizer_3=tok.t5_tokenizer(TEXT_LENGTH, VOCABULARY),
    )


def state_dict(pipe: StableDiffusion3Pipeline) -> dict[str, torch.Tensor]:
    """Every module's weights in one flat dict (``module.parameter``), plus the VAE's latent scaling."""
    tensors = {f"{name}.{key}": value.detach().clone()  # clone: T5 ties its input embedding to `shared`
               for name in MODULES for key, value in getattr(pipe, name).state_dict().items()}
    tensors["latent_scaling"] = torch.tensor([pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor])
    return tensors


def demo_weights(kind: str, resolution: int, weights: Path, pretrain_module: str) -> dict[str, torch.Tensor]:
    """A demo model's saved tensors, refused in one line at another resolution or when the file is missing."""
    if resolution != RESOLUTION:  # ModelConfig refuses it first; this guards direct callers
        raise ModelLoadError(f"the {kind} demo model was trained at {RESOLUTION} px, not {resolution}")
    if not weights.is_file():
        raise ModelLoadError(f"the {kind} weights are missing ({weights}); rebuild them with "
                             f"`python -m {pretrain_module}`")
    return load_file(str(weights))


def load_shapes_sd3(resolution: int, seed: int, weights: Path = WEIGHTS) -> StableDiffusion3Pipeline:
    """The pretrained demo pipeline (``seed`` is unused: the weights are fixed), in eval mode, float32."""
    tensors = demo_weights("shapes-sd3", resolution, weights, "components.models.shapes_pretrain")
    scaling, shift = tensors.pop("latent_scaling").tolist()
    pipe = build_architecture(0, scaling_factor=scaling, shift_factor=shift)
    for name in MODULES:
        prefix = f"{name}."
        module = getattr(pipe, name)
        module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        module.eval().requires_grad_(False)
    return pipe
