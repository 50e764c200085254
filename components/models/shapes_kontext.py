"""The editing demo model: a small FLUX.1-Kontext pipeline that edits shapes scenes, its transformer shipped.

``FluxKontextPipeline`` with shapes-sd3's pretrained, frozen parts: its VAE (48 px -> 12 x 12 x 16 latents, 6 x 6
packed tokens), its first CLIP text encoder as FLUX's pooled encoder (a ``CLIPTextModel`` holding the same
``text_model`` weights: the pooled output is the final-norm state at the end token, width 32) and its T5 (width 64),
with shapes-sd3's tokenizers unchanged. Only the transformer is new: a ``FluxTransformer2DModel`` of width 64 without
guidance embedding, trained from a seed by ``components.models.shapes_edit_pretrain`` on the edit world
(``components.shapes.edits``); ``weights/shapes-kontext.safetensors`` holds it (docs/MODELS.md, "The editing
demo model: shapes-kontext").
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel

from components.models import shapes_sd3
from components.models.families import SHAPES_RESOLUTION as RESOLUTION
from components.models.sd3.tiny import LATENT_CHANNELS

WEIGHTS = Path(__file__).resolve().parent / "weights" / "shapes-kontext.safetensors"
DOUBLE_BLOCKS = 2  # joint text / image blocks
SINGLE_BLOCKS = 2  # single-stream blocks over text, noisy and input-image tokens
HEADS, HEAD_DIM = 4, 16
ROPE_AXES = (4, 6, 6)  # (input-image index, row, column): sums to HEAD_DIM


def build_architecture(seed: int, sd3_weights: Path = shapes_sd3.WEIGHTS) -> FluxKontextPipeline:
    """The pipeline with a transformer of random weights from ``seed`` and shapes-sd3's frozen VAE and encoders."""
    sd3 = shapes_sd3.load_shapes_sd3(RESOLUTION, 0, sd3_weights)
    clip = CLIPTextModel(sd3.text_encoder.config)
    # transformers 5 keeps CLIPTextModel's layers at its top level, CLIPTextModelWithProjection's under text_model
    prefix = "text_model."
    clip.load_state_dict({k[len(prefix):]: v for k, v in sd3.text_encoder.state_dict().items() if k.startswith(prefix)})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=DOUBLE_BLOCKS, num_single_layers=SINGLE_BLOCKS,
            attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
            joint_attention_dim=sd3.text_encoder_3.config.d_model, pooled_projection_dim=clip.config.hidden_size,
            guidance_embeds=False, axes_dims_rope=ROPE_AXES,
        )
    pipe = FluxKontextPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shapes_sd3.SCHEDULER_SHIFT),  # shapes-sd3's static shift
        vae=sd3.vae, text_encoder=clip, tokenizer=sd3.tokenizer,
        text_encoder_2=sd3.text_encoder_3, tokenizer_2=sd3.tokenizer_3,
    )
    for module in (clip, sd3.vae, sd3.text_encoder_3):
        module.eval().requires_grad_(False)
    return pipe


def load_shapes_kontext(resolution: int, seed: int, weights: Path = WEIGHTS) -> FluxKontextPipeline:
    """The pretrained editing pipeline (``seed`` is unused: the weights are fixed), in eval mode, float32."""
    tensors = shapes_sd3.demo_weights("shapes-kontext", resolution, weights, "components.models.shapes_edit_pretrain")
    pipe = build_architecture(0)
    pipe.transformer.load_state_dict(tensors)
    pipe.transformer.eval().requires_grad_(False)
    return pipe
