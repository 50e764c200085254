"""Diffusers pipelines at the REAL architecture shapes of SD3.5 Medium, FLUX.1-dev (and FLUX.1-Kontext-dev, the same
model editing an input image), Qwen-Image, FLUX.2 klein 4B, Z-Image, Wan2.1 T2V 1.3B and Wan2.1 I2V 14B 480P, random
weights.

Built from config only (no files, no hub), after the tiny pipelines of ``components/models/<family>/tiny*.py``:
fixed seeds, eval mode, ``requires_grad`` off. ``device="meta"`` builds every module without memory.

Real (the published ``config.json`` values): the transformer (every width, head and block count unless
``transformer_layers`` reduces the depth), the VAE, the scheduler, and the text encoders' widths (hidden, MLP,
heads, projections). Reduced, so a CPU can run them: the text encoders' depth (``text_layers``, default 2; the
Qwen2.5-VL vision tower, which the text path never runs, too) and their vocabularies, which are the offline tiny
tokenizers' (CLIP, T5, Qwen; Wan's UMT5 reads the tiny T5's) instead of 49408 / 32128 / 152064 (UMT5 256384)
tokens. ``text_encoder_param_counts`` gives the real-size counts, from meta builds at real depth and vocabulary,
for memory estimates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import cache, partial

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import (
    CLIPImageProcessorPil,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from components.models import tiny_tokenizers as tok
from components.models.flux2.tiny import klein_tokenizer
from components.models.qwenimage.tiny import CORPUS as QWEN_CORPUS
from components.models.zimage.tiny import zimage_tokenizer

FAMILIES = ("sd35-medium", "sd35-large", "flux1-dev", "qwen-image", "flux2-klein", "z-image", "wan21-1.3b",
            "flux1-kontext", "wan21-i2v-14b", "flux2-klein-base", "qwen-image-edit")
# FLUX.2-klein-base-4B: the distilled 4B's shapes, guided with CFG (is_distilled false in its model_index.json)
KLEIN_SHAPES = ("flux2-klein", "flux2-klein-base")
# Qwen-Image-Edit-2509: Qwen-Image's transformer, VAE and text encoder (the same configs), in its edit pipeline
QWEN_IMAGE_FAMILIES = ("qwen-image", "qwen-image-edit")

# --- the published configs (checked against public copies of each config.json; where, in each comment) ---

# stabilityai/stable-diffusion-3.5-medium transformer/config.json (as copied in Comfy-Org SD3.5 loaders, mflux ports)
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
# stabilityai/stable-diffusion-3.5-large transformer/config.json (diffusers' SD3.5 blog: MMDiT with QK norm and no
# dual-attention blocks; 38 blocks of width 38 x 64 = 2432, as the tt-metal and sglang ports): 8.06 B parameters
SD35_LARGE_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
    pos_embed_max_size=192, dual_attention_layers=(), qk_norm="rms_norm",
)
# black-forest-labs/FLUX.1-dev transformer/config.json (BFL flux-dev params, e.g. hpcaitech/Open-Sora t2i2v.py)
FLUX1_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# Qwen/Qwen-Image transformer/config.json (as in aigc-apps/VideoX-Fun comfyui/qwenimage/nodes.py)
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
# The 16-channel KL VAE of SD3.x and FLUX.1 (same architecture, different normalisation)
_KL_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", norm_num_groups=32, sample_size=1024, force_upcast=True, use_quant_conv=False,
    use_post_quant_conv=False,
)
SD3_VAE = {**_KL_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
FLUX1_VAE = {**_KL_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
# Qwen/Qwen-Image vae/config.json (AutoencoderKLQwenImage: the Wan 2.1 causal 3D VAE)
QWEN_IMAGE_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0,
    latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                  -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                 1.6382, 1.1253, 2.8251, 1.916],
)
# CLIP ViT-L/14 text tower (SD3 text_encoder, with projection; FLUX.1 text_encoder, without);
# Stability-AI/sd3.5 sd3_infer.py, kohya-ss/sd-scripts library/flux_utils.py
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5)
# OpenCLIP ViT-bigG/14 text tower (SD3 text_encoder_2)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, projection_dim=1280, hidden_act="gelu", layer_norm_eps=1e-5)
# google/t5-v1_1-xxl encoder (SD3 text_encoder_3, FLUX.1 text_encoder_2; kohya-ss/sd-scripts flux_utils.py);
# dropout 0.1 in the file, 0 here (eval mode either way)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
              layer_norm_epsilon=1e-6, dropout_rate=0.0, tie_word_embeddings=False)
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct)
QWEN25_VL_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                      rms_norm_eps=1e-6, hidden_act="silu",
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
QWEN25_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, tokens_per_second=2, hidden_act="silu")
QWEN25_VL_SPECIAL = {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                     "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}
# scheduler/scheduler_config.json of each (FLUX.1-dev's: ostris/ai-toolkit toolkit/sampler.py)
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
FLUX1_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                           max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192,
                            max_shift=0.9, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                            use_dynamic_shifting=True)

# FLUX.2 [klein] 4B transformer/config.json: diffusers scripts/convert_flux2_to_diffusers.py (commit 207bae7a),
# get_flux2_transformer_config("klein-4b"); the base and distilled 4B share it (9B: 8 + 24 blocks, 32 heads, joint
# dim 12288). That script builds the VAE as AutoencoderKLFlux2() (the class defaults: 32 latent channels, 2x2 patches
# batch-normalised) and gives FLUX.2 pipelines FLUX.1-dev's scheduler config; klein computes the shift's mu itself.
FLUX2_KLEIN_4B_TRANSFORMER = dict(
    patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000, eps=1e-6, guidance_embeds=False,
)
# Qwen/Qwen3-4B config.json, klein 4B's text_encoder (Qwen3ForCausalLM; width 2560 x the 3 stacked layers = 7680)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
KLEIN_TEXT_LAYERS = 28  # the klein pipeline stacks hidden states 9, 18 and 27: a shallower encoder cannot run

# Tongyi-MAI/Z-Image transformer/config.json (Z-Image-Turbo's is the same; as copied with "_diffusers_version":
# "0.36.0.dev0" in public loaders, and equal to ZImageTransformer2DModel's defaults in diffusers 0.42.1 but for
# axes_lens, 1536 there): 30 single-stream blocks of width 3840 plus 2 noise and 2 caption refiners, 6.15 B
ZIMAGE_TRANSFORMER = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
    n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
    axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512),
)
# Tongyi-MAI/Z-Image scheduler/scheduler_config.json (Z-Image-Turbo's: shift 3.0); its VAE is FLUX.1's (FLUX1_VAE)
# and its text_encoder Qwen3-4B (QWEN3_4B) loaded as Qwen3Model, without the LM head
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, use_dynamic_shifting=False, shift=6.0)

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (the Wan team's t2v_1_3B config: dim 1536 = 12 heads x
# 128, FFN 8960, 30 blocks, (1, 2, 2) patches, UMT5-XXL's 4096-wide states; as in mlx-examples' Wan2.1 port)
WAN21_1_3B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
# Its vae/config.json is AutoencoderKLWan's defaults (base_dim 96, z_dim 16, time 4x and space 8x compression), its
# text_encoder google/umt5-xxl's encoder (T5-XXL's widths, 256384 tokens). Its scheduler is UniPC under flow_shift 3;
# the adapter steps Euler under the same shift (components/models/wan/adapter.py), so that is the scheduler built here.
UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6)
WAN_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json (the Wan team's i2v_14B config: dim 5120 = 40 heads x
# 128, FFN 13824, 40 blocks; 36 input channels = 16 noisy + 4 mask + 16 first-frame latents; image cross-attention
# keys / values from the 1280-wide CLIP states projected to 5120). Its VAE, text encoder and scheduler are the 1.3B's.
WAN21_I2V_14B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=36, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, image_dim=1280, added_kv_proj_dim=5120, rope_max_seq_len=1024,
)
# Its image_encoder/config.json: the ViT-H/14 vision tower of open-clip-xlm-roberta-large-vit-huge-14 as
# CLIPVisionModel (224 px, 257 tokens of 1280; the pipeline reads the penultimate layer's states); its image_processor
# CLIPImageProcessor's defaults (224 px, bicubic, OpenAI mean / std)
CLIP_VIT_H_14 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                     image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu", layer_norm_eps=1e-5)

REAL_VOCAB = {"clip": 49408, "t5": 32128, "qwen": 152064, "qwen3": 151936, "umt5": 256384}
QWEN_TOKENIZER_VOCAB = 600  # BPE size of the tiny Qwen tokenizer (as qwenimage/tiny.py), plus the special tokens


def describe() -> str:
    """What is real and what is reduced in these builders, for benchmark output."""
    return (
        "real-shape pipelines, random weights: transformer, VAE and scheduler at the published configs "
        "(SD3.5 Medium and Large, FLUX.1-dev and Kontext-dev, Qwen-Image, FLUX.2 klein 4B, Z-Image, Wan2.1 T2V "
        "1.3B, Wan2.1 I2V 14B); text encoders (and Wan I2V's image encoder) "
        f"at real width but reduced depth (text_layers; klein's Qwen3 at least {KLEIN_TEXT_LAYERS}) and "
        f"tiny offline vocabularies (CLIP {tok.clip_vocab_size()}, T5 {tok.t5_vocab_size()}, "
        f"Qwen ~{QWEN_TOKENIZER_VOCAB + len(tok.QWEN_SPECIAL_TOKENS)} tokens instead of "
        f"{REAL_VOCAB['clip']} / {REAL_VOCAB['t5']} / {REAL_VOCAB['qwen']}); memory figures count the text "
        "encoders at their real size"
    )


# --- building helpers ---

def _device(device: torch.device | str) -> torch.device:
    return torch.device(device)


@contextlib.contextmanager
def _building(device: torch.device, seed: int) -> Iterator[None]:
    """Construct modules under ``seed``; on the meta device when asked (no memory), else on CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device.type == "meta":
            with torch.device("meta"):
                yield
        else:
            yield


def _finish(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Frozen, eval mode, in ``dtype`` on ``device`` (plain ``nn.Module.to``: diffusers' warns on every cast)."""
    torch.nn.Module.to(module, device=None if device.type == "meta" else device, dtype=dtype)
    return module.eval().requires_grad_(False)


def _depth(real: int, reduced: int | None) -> int:
    return real if reduced is None else max(1, min(real, reduced))


def clip_text_encoder(layers: int | None, projection: bool, big: bool = False,
                      vocab_size: int | None = None) -> CLIPTextModel | CLIPTextModelWithProjection:
    """CLIP-L (or CLIP-G with ``big``) at real width; ``vocab_size`` None = the tiny tokenizer's (its ids)."""
    base = CLIP_G if big else CLIP_L
    vocab = vocab_size or tok.clip_vocab_size()
    ids = {} if vocab_size else dict(bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    config = CLIPTextConfig(**{**base, "vocab_size": vocab, "num_hidden_layers": _depth(base["num_hidden_layers"],
                                                                                          layers)}, **ids)
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def t5_text_encoder(layers: int | None, vocab_size: int | None = None) -> T5EncoderModel:
    """The T5-XXL encoder at real width; ``vocab_size`` None = the tiny tokenizer's."""
    config = T5Config(**{**T5_XXL, "vocab_size": vocab_size or tok.t5_vocab_size(),
                         "num_layers": _depth(T5_XXL["num_layers"], layers)},
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5EncoderModel(config)


def qwen3_text_encoder(layers: int | None, vocab_size: int, pad_token_id: int | None = None,
                       eos_token_id: int | None = None) -> Qwen3ForCausalLM:
    """Qwen3-4B at real width: ``layers`` deep but never under the ``KLEIN_TEXT_LAYERS`` the klein pipeline reads
    (None = real depth)."""
    depth = _depth(QWEN3_4B["num_hidden_layers"], None if layers is None else max(layers, KLEIN_TEXT_LAYERS))
    return Qwen3ForCausalLM(Qwen3Config(**{**QWEN3_4B, "vocab_size": vocab_size, "num_hidden_layers": depth},
                                        pad_token_id=pad_token_id, eos_token_id=eos_token_id))


def qwen_text_encoder(layers: int | None, special: dict[str, int], vocab_size: int) -> (
        Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL-7B at real width: ``layers`` language-model layers (and vision blocks, None = real depth)."""
    depth = _depth(QWEN25_VL_VISION["depth"], layers)
    full = [i for i in QWEN25_VL_VISION["fullatt_block_indexes"] if i < depth] or [depth - 1]
    config = Qwen2_5_VLConfig(
        text_config={**QWEN25_VL_TEXT, "vocab_size": vocab_size,
                     "num_hidden_layers": _depth(QWEN25_VL_TEXT["num_hidden_layers"], layers),
                     "bos_token_id": special["<|endoftext|>"], "eos_token_id": special["<|im_end|>"],
                     "pad_token_id": special["<|endoftext|>"]},
        vision_config={**QWEN25_VL_VISION, "depth": depth, "fullatt_block_indexes": full},
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _flux_blocks(total: int | None, real: dict = FLUX1_DEV_TRANSFORMER) -> tuple[int, int]:
    """(double, single) blocks: the real ones (FLUX.1-dev 19 + 38), or ``total`` split in the real ratio, at least
    one of each."""
    real_double, real_single = real["num_layers"], real["num_single_layers"]
    if total is None:
        return real_double, real_single
    double = max(1, min(real_double, round(total * real_double / (real_double + real_single))))
    return double, max(1, min(real_single, total - double))


SD35_TRANSFORMERS = {"sd35-medium": SD35_MEDIUM_TRANSFORMER, "sd35-large": SD35_LARGE_TRANSFORMER}
FLUX1_FAMILIES = ("flux1-dev", "flux1-kontext")  # one transformer shape


def transformer_config(family: str, transformer_layers: int | None = None) -> dict:
    """The family's transformer config, its depth reduced to ``transformer_layers`` when given.

    SD3.5: the first ``n`` blocks (dual attention where the real model has it). FLUX.1 / FLUX.2 klein: ``n`` blocks
    in all, double and single in the real 1:2 / 1:4 ratio, at least one of each. Qwen-Image: ``n`` blocks.
    """
    if family in SD35_TRANSFORMERS:
        real = SD35_TRANSFORMERS[family]
        n = _depth(real["num_layers"], transformer_layers)
        dual = tuple(i for i in real["dual_attention_layers"] if i < n)
        return {**real, "num_layers": n, "dual_attention_layers": dual}
    if family in FLUX1_FAMILIES:
        double, single = _flux_blocks(transformer_layers)
        return {**FLUX1_DEV_TRANSFORMER, "num_layers": double, "num_single_layers": single}
    if family in QWEN_IMAGE_FAMILIES:
        return {**QWEN_IMAGE_TRANSFORMER, "num_layers": _depth(QWEN_IMAGE_TRANSFORMER["num_layers"],
                                                               transformer_layers)}
    if family in KLEIN_SHAPES:
        double, single = _flux_blocks(transformer_layers, FLUX2_KLEIN_4B_TRANSFORMER)
        return {**FLUX2_KLEIN_4B_TRANSFORMER, "num_layers": double, "num_single_layers": single}
    if family == "wan21-1.3b":
        return {**WAN21_1_3B_TRANSFORMER, "num_layers": _depth(WAN21_1_3B_TRANSFORMER["num_layers"],
                                                               transformer_layers)}
    if family == "wan21-i2v-14b":
        return {**WAN21_I2V_14B_TRANSFORMER, "num_layers": _depth(WAN21_I2V_14B_TRANSFORMER["num_layers"],
                                                                  transformer_layers)}
    if family == "z-image":  # the refiners stay: every forward runs them
        return {**ZIMAGE_TRANSFORMER, "n_layers": _depth(ZIMAGE_TRANSFORMER["n_layers"], transformer_layers)}
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


_TRANSFORMER_CLASSES = {"sd35-medium": SD3Transformer2DModel, "sd35-large": SD3Transformer2DModel,
                        "flux1-dev": FluxTransformer2DModel, "flux1-kontext": FluxTransformer2DModel,
                        "qwen-image": QwenImageTransformer2DModel, "flux2-klein": Flux2Transformer2DModel,
                        "z-image": ZImageTransformer2DModel, "wan21-1.3b": WanTransformer3DModel,
                        "wan21-i2v-14b": WanTransformer3DModel, "flux2-klein-base": Flux2Transformer2DModel,
                        "qwen-image-edit": QwenImageTransformer2DModel}


def build_transformer(family: str, device: torch.device | str = "meta", dtype: torch.dtype = torch.bfloat16,
                      transformer_layers: int | None = None, seed: int = 0) -> torch.nn.Module:
    """The family's transformer alone (frozen, eval mode)."""
    device = _device(device)
    with _building(device, seed):
        model = _TRANSFORMER_CLASSES[family](**transformer_config(family, transformer_layers))
    return _finish(model, device, dtype)


def build_vae(family: str, device: torch.device | str = "meta", dtype: torch.dtype = torch.bfloat16,
              seed: int = 1) -> AutoencoderKL | AutoencoderKLQwenImage | AutoencoderKLFlux2:
    """The family's VAE alone (frozen, eval mode)."""
    device = _device(device)
    with _building(device, seed):
        if family in QWEN_IMAGE_FAMILIES:
            vae = AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)
        elif family in KLEIN_SHAPES:
            vae = AutoencoderKLFlux2()
        elif family in ("wan21-1.3b", "wan21-i2v-14b"):
            vae = AutoencoderKLWan()
        else:
            vae = AutoencoderKL(**(SD3_VAE if family in SD35_TRANSFORMERS else FLUX1_VAE))
    return _finish(vae, device, dtype)


# --- the pipelines ---

def sd35(family: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
         text_layers: int | None = 2, transformer_layers: int | None = None, max_sequence_length: int = 256,
         seed: int = 0) -> StableDiffusion3Pipeline:
    """A ``StableDiffusion3Pipeline`` shaped like Stable Diffusion 3.5 Medium (``family="sd35-medium"``: MMDiT-X,
    CLIP-L, CLIP-G, T5-XXL) or Large (``"sd35-large"``: its MMDiT, the same text encoders, VAE and scheduler)."""
    device = _device(device)
    transformer = build_transformer(family, device, dtype, transformer_layers, seed)
    vae = build_vae(family, device, dtype, seed + 1)
    encoders = []
    for i, make in enumerate((lambda: clip_text_encoder(text_layers, projection=True),
                              lambda: clip_text_encoder(text_layers, projection=True, big=True),
                              lambda: t5_text_encoder(text_layers))):
        with _building(device, seed + 2 + i):
            encoders.append(_finish(make(), device, dtype))
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER), vae=vae,
        text_encoder=encoders[0], tokenizer=tok.clip_tokenizer(),
        text_encoder_2=encoders[1], tokenizer_2=tok.clip_tokenizer(),
        text_encoder_3=encoders[2], tokenizer_3=tok.t5_tokenizer(max_sequence_length),
    )


def flux1_dev(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, text_layers: int | None = 2,
              transformer_layers: int | None = None, max_sequence_length: int = 512, seed: int = 0,
              pipeline_class: type = FluxPipeline) -> FluxPipeline:
    """A ``FluxPipeline`` shaped like FLUX.1-dev (19 double + 38 single blocks, guidance embedding, CLIP-L, T5-XXL).

    ``transformer_layers`` counts double and single blocks together (see ``transformer_config``).
    ``pipeline_class``: ``FluxKontextPipeline`` for FLUX.1-Kontext-dev, whose transformer, VAE and text encoders
    have FLUX.1-dev's shapes (BFL's flux ``util.py``: the ``flux-dev-kontext`` spec's params are ``flux-dev``'s).
    """
    device = _device(device)
    transformer = build_transformer("flux1-dev", device, dtype, transformer_layers, seed)
    vae = build_vae("flux1-dev", device, dtype, seed + 1)
    with _building(device, seed + 2):
        clip = _finish(clip_text_encoder(text_layers, projection=False), device, dtype)
    with _building(device, seed + 3):
        t5 = _finish(t5_text_encoder(text_layers), device, dtype)
    return pipeline_class(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**FLUX1_DEV_SCHEDULER), vae=vae,
        text_encoder=clip, tokenizer=tok.clip_tokenizer(),
        text_encoder_2=t5, tokenizer_2=tok.t5_tokenizer(max_sequence_length),
    )


def qwen_image(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, text_layers: int | None = 2,
               transformer_layers: int | None = None, seed: int = 0) -> QwenImagePipeline:
    """A ``QwenImagePipeline`` shaped like Qwen-Image (60-block MMDiT, 3D VAE, Qwen2.5-VL-7B text encoder).

    The tokenizer is the tiny Qwen BPE trained on the pipeline's prompt template, so the template prefix is the
    34 tokens the pipeline drops, as with the real vocabulary.
    """
    return QwenImagePipeline(**_qwen_image_parts(tok.qwen_tokenizer(QWEN_CORPUS, vocab_size=QWEN_TOKENIZER_VOCAB),
                                                 _device(device), dtype, text_layers, transformer_layers, seed))


def _qwen_image_parts(tokenizer, device: torch.device, dtype: torch.dtype, text_layers: int | None,
                      transformer_layers: int | None, seed: int) -> dict:
    """Qwen-Image's transformer, VAE, scheduler and Qwen2.5-VL text encoder (sized to ``tokenizer``), both
    Qwen-Image pipelines' parts."""
    transformer = build_transformer("qwen-image", device, dtype, transformer_layers, seed)
    vae = build_vae("qwen-image", device, dtype, seed + 1)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in tok.QWEN_SPECIAL_TOKENS}
    with _building(device, seed + 2):
        text_encoder = _finish(qwen_text_encoder(text_layers, special, len(tokenizer)), device, dtype)
    return {"transformer": transformer, "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
            "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer}


def qwen_image_edit(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                    text_layers: int | None = 2, transformer_layers: int | None = None,
                    seed: int = 0) -> QwenImageEditPlusPipeline:
    """A ``QwenImageEditPlusPipeline`` shaped like Qwen-Image-Edit-2509: Qwen-Image's parts (``qwen_image``) with
    a processor for the input image (Qwen2.5-VL's 14 px patches, merged 2x2)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from components.models.qwenimage.edit import ImageQwen2VLProcessor
    from components.models.qwenimage.tiny_edit import CORPUS as EDIT_CORPUS

    tokenizer = tok.qwen_tokenizer(EDIT_CORPUS, vocab_size=QWEN_TOKENIZER_VOCAB + 100)
    processor = ImageQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)
    return QwenImageEditPlusPipeline(processor=processor, **_qwen_image_parts(
        tokenizer, _device(device), dtype, text_layers, transformer_layers, seed))


def flux2_klein(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, text_layers: int | None = 2,
                transformer_layers: int | None = None, max_sequence_length: int = 512,
                seed: int = 0, is_distilled: bool = True) -> Flux2KleinPipeline:
    """A ``Flux2KleinPipeline`` shaped like FLUX.2 [klein] 4B, step-distilled (5 double + 20 single blocks, the
    FLUX.2 VAE, Qwen3-4B, whose depth stays at least ``KLEIN_TEXT_LAYERS``). The tokenizer is the tiny klein one,
    every prompt padded to ``max_sequence_length`` tokens. ``is_distilled`` false: klein base 4B (CFG).

    ``transformer_layers`` counts double and single blocks together (see ``transformer_config``).
    """
    return _qwen3_pipeline("flux2-klein", Flux2KleinPipeline, klein_tokenizer(), qwen3_text_encoder,
                           FLUX1_DEV_SCHEDULER, _device(device), dtype, text_layers, transformer_layers,
                           max_sequence_length, seed, is_distilled=is_distilled)


def zimage_text_encoder(layers: int | None, vocab_size: int, pad_token_id: int | None = None,
                        eos_token_id: int | None = None) -> Qwen3Model:
    """Z-Image's Qwen3-4B (no LM head) at real width: ``layers`` deep, at least 2 (the pipeline reads the
    second-to-last hidden state; None = real depth)."""
    depth = _depth(QWEN3_4B["num_hidden_layers"], None if layers is None else max(layers, 2))
    return Qwen3Model(Qwen3Config(**{**QWEN3_4B, "vocab_size": vocab_size, "num_hidden_layers": depth},
                                  pad_token_id=pad_token_id, eos_token_id=eos_token_id))


def z_image(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, text_layers: int | None = 2,
            transformer_layers: int | None = None, max_sequence_length: int = 512, seed: int = 0) -> ZImagePipeline:
    """A ``ZImagePipeline`` shaped like Z-Image (6B single-stream DiT, FLUX.1's VAE, Qwen3-4B). The tokenizer is
    the tiny Qwen BPE with Qwen3's chat template, its limit ``max_sequence_length`` tokens."""
    return _qwen3_pipeline("z-image", ZImagePipeline, zimage_tokenizer(), zimage_text_encoder, ZIMAGE_SCHEDULER,
                           _device(device), dtype, text_layers, transformer_layers, max_sequence_length, seed)


def _qwen3_pipeline(family: str, pipeline_class: type, tokenizer, text_encoder, scheduler: dict, device: torch.device,
                    dtype: torch.dtype, text_layers: int | None, transformer_layers: int | None,
                    max_sequence_length: int, seed: int, **extra):
    """A pipeline of a Qwen3-conditioned family: its transformer and VAE at real shape, ``text_encoder(layers,
    vocab, pad id, eos id)`` at real width, the tokenizer limited to ``max_sequence_length`` tokens."""
    tokenizer.model_max_length = max_sequence_length
    transformer = build_transformer(family, device, dtype, transformer_layers, seed)
    vae = build_vae(family, device, dtype, seed + 1)
    with _building(device, seed + 2):
        encoder = _finish(text_encoder(text_layers, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id),
                          device, dtype)
    return pipeline_class(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**scheduler), vae=vae,
                          text_encoder=encoder, tokenizer=tokenizer, **extra)


def umt5_text_encoder(layers: int | None, vocab_size: int | None = None) -> UMT5EncoderModel:
    """The UMT5-XXL encoder at real width; ``vocab_size`` None = the tiny T5 tokenizer's."""
    config = UMT5Config(**{**UMT5_XXL, "vocab_size": vocab_size or tok.t5_vocab_size(),
                           "num_layers": _depth(UMT5_XXL["num_layers"], layers)},
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return UMT5EncoderModel(config)


def wan21_1_3b(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, text_layers: int | None = 2,
               transformer_layers: int | None = None, max_sequence_length: int = 512, seed: int = 0) -> WanPipeline:
    """A ``WanPipeline`` shaped like Wan2.1 T2V 1.3B (video DiT, causal 3D VAE, UMT5-XXL); the tokenizer is the tiny
    character-level T5, its limit ``max_sequence_length`` tokens (umt5-xxl's: 512)."""
    device = _device(device)
    transformer = build_transformer("wan21-1.3b", device, dtype, transformer_layers, seed)
    vae = build_vae("wan21-1.3b", device, dtype, seed + 1)
    with _building(device, seed + 2):
        text_encoder = _finish(umt5_text_encoder(text_layers), device, dtype)
    return WanPipeline(tokenizer=tok.t5_tokenizer(max_sequence_length), text_encoder=text_encoder,
                       transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER))


def clip_image_encoder(layers: int | None) -> CLIPVisionModel:
    """Wan2.1-I2V's ViT-H/14 image encoder at real width; ``layers`` deep, at least 2 (the pipeline reads the
    penultimate layer's states; None = real depth)."""
    depth = _depth(CLIP_VIT_H_14["num_hidden_layers"], None if layers is None else max(layers, 2))
    return CLIPVisionModel(CLIPVisionConfig(**{**CLIP_VIT_H_14, "num_hidden_layers": depth}))


def wan21_i2v_14b(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, text_layers: int | None = 2,
                  transformer_layers: int | None = None, max_sequence_length: int = 512,
                  seed: int = 0) -> WanImageToVideoPipeline:
    """A ``WanImageToVideoPipeline`` shaped like Wan2.1 I2V 14B 480P (the 14B video DiT with image cross-attention,
    the causal 3D VAE, UMT5-XXL, the ViT-H/14 image encoder, ``text_layers`` deep too); the tokenizer is the tiny
    character-level T5."""
    device = _device(device)
    transformer = build_transformer("wan21-i2v-14b", device, dtype, transformer_layers, seed)
    vae = build_vae("wan21-i2v-14b", device, dtype, seed + 1)
    with _building(device, seed + 2):
        text_encoder = _finish(umt5_text_encoder(text_layers), device, dtype)
    with _building(device, seed + 3):
        image_encoder = _finish(clip_image_encoder(text_layers), device, dtype)
    return WanImageToVideoPipeline(
        tokenizer=tok.t5_tokenizer(max_sequence_length), text_encoder=text_encoder, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER), image_encoder=image_encoder,
        image_processor=CLIPImageProcessorPil())


BUILDERS: dict[str, Callable[..., object]] = {"sd35-medium": partial(sd35, "sd35-medium"),
                                              "sd35-large": partial(sd35, "sd35-large"),
                                              "flux1-dev": flux1_dev, "qwen-image": qwen_image,
                                              "flux2-klein": flux2_klein, "z-image": z_image,
                                              "wan21-1.3b": wan21_1_3b, "wan21-i2v-14b": wan21_i2v_14b,
                                              "flux1-kontext": partial(flux1_dev, pipeline_class=FluxKontextPipeline),
                                              "flux2-klein-base": partial(flux2_klein, is_distilled=False),
                                              "qwen-image-edit": qwen_image_edit}


# --- real sizes, from meta builds ---

def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _meta(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.device("meta"):
        return make()


@cache
def transformer_param_count(family: str) -> int:
    """Parameters of the family's real transformer (buffers, e.g. SD3's positional table, not included)."""
    return _count(build_transformer(family, "meta"))


@cache
def transformer_buffer_count(family: str) -> int:
    """Elements of the real transformer's buffers (SD3.5: the positional table, 384 x 384 for Medium, 192 x 192 for
    Large; none for the others)."""
    return sum(b.numel() for b in build_transformer(family, "meta").buffers())


@cache
def vae_param_count(family: str) -> int:
    """Parameters of the family's real VAE."""
    return _count(build_vae(family, "meta"))


@cache
def sd35_medium_text_encoders(layers: int | None = None) -> dict[str, int]:
    """Parameter counts of SD3.5 Medium's text encoders (CLIP-L, CLIP-G with projections, T5-XXL encoder) at real
    width and vocabulary; ``layers`` deep (None = real depth)."""
    return {
        "text_encoder": _count(_meta(lambda: clip_text_encoder(layers, True, vocab_size=REAL_VOCAB["clip"]))),
        "text_encoder_2": _count(_meta(lambda: clip_text_encoder(layers, True, True, REAL_VOCAB["clip"]))),
        "text_encoder_3": _count(_meta(lambda: t5_text_encoder(layers, REAL_VOCAB["t5"]))),
    }


@cache
def flux1_dev_text_encoders(layers: int | None = None) -> dict[str, int]:
    """Parameter counts of FLUX.1-dev's text encoders (CLIP-L without projection, T5-XXL encoder) at real width
    and vocabulary; ``layers`` deep (None = real depth)."""
    return {
        "text_encoder": _count(_meta(lambda: clip_text_encoder(layers, False, vocab_size=REAL_VOCAB["clip"]))),
        "text_encoder_2": _count(_meta(lambda: t5_text_encoder(layers, REAL_VOCAB["t5"]))),
    }


@cache
def qwen_image_text_encoders(layers: int | None = None) -> dict[str, int]:
    """Parameter count of Qwen-Image's text encoder: all of Qwen2.5-VL-7B, as the pipeline loads it, at real width
    and vocabulary; ``layers`` deep (None = real depth).

    The pipeline holds the whole ``Qwen2_5_VLForConditionalGeneration`` (vision tower and LM head included)
    although encoding a prompt runs only the language model; ``qwen_image_text_encoder_parts`` splits it.
    """
    return {"text_encoder": sum(qwen_image_text_encoder_parts(layers).values())}


@cache
def qwen_image_text_encoder_parts(layers: int | None = None) -> dict[str, int]:
    """Qwen2.5-VL-7B's parameters by part: language model, LM head, vision tower."""
    model = _meta(lambda: qwen_text_encoder(layers, QWEN25_VL_SPECIAL, REAL_VOCAB["qwen"]))
    return {"language_model": _count(model.model.language_model), "lm_head": _count(model.lm_head),
            "vision_tower": _count(model.model.visual)}


@cache
def flux2_klein_text_encoders(layers: int | None = None) -> dict[str, int]:
    """Parameter count of FLUX.2 klein 4B's text encoder (Qwen3-4B, its LM head tied to the embedding) at real
    width and vocabulary; ``layers`` deep, at least ``KLEIN_TEXT_LAYERS`` (None = real depth)."""
    return {"text_encoder": _count(_meta(lambda: qwen3_text_encoder(layers, REAL_VOCAB["qwen3"])))}


@cache
def z_image_text_encoders(layers: int | None = None) -> dict[str, int]:
    """Parameter count of Z-Image's text encoder (Qwen3-4B as ``Qwen3Model``) at real width and vocabulary;
    ``layers`` deep (None = real depth)."""
    return {"text_encoder": _count(_meta(lambda: zimage_text_encoder(layers, REAL_VOCAB["qwen3"])))}


@cache
def wan21_text_encoders(layers: int | None = None) -> dict[str, int]:
    """Parameter count of Wan2.1's text encoder (the UMT5-XXL encoder) at real width and vocabulary; ``layers`` deep
    (None = real depth)."""
    return {"text_encoder": _count(_meta(lambda: umt5_text_encoder(layers, REAL_VOCAB["umt5"])))}


@cache
def wan21_i2v_encoders(layers: int | None = None) -> dict[str, int]:
    """Wan2.1 I2V's encoders that run once per prompt and are offloaded with the text encoder: UMT5-XXL and the
    ViT-H/14 image encoder, real size or ``layers`` deep."""
    return {**wan21_text_encoders(layers), "image_encoder": _count(_meta(lambda: clip_image_encoder(layers)))}


def text_encoder_param_counts(family: str, layers: int | None = None) -> dict[str, int]:
    """Parameter counts of the family's text encoders, by pipeline component name: real, or ``layers`` deep at
    real width and vocabulary."""
    counts = {"sd35-medium": sd35_medium_text_encoders, "sd35-large": sd35_medium_text_encoders,
              "flux1-dev": flux1_dev_text_encoders, "flux1-kontext": flux1_dev_text_encoders,
              "qwen-image": qwen_image_text_encoders, "flux2-klein": flux2_klein_text_encoders,
              "z-image": z_image_text_encoders, "wan21-1.3b": wan21_text_encoders,
              "wan21-i2v-14b": wan21_i2v_encoders, "flux2-klein-base": flux2_klein_text_encoders,
              "qwen-image-edit": qwen_image_text_encoders}
    if family not in counts:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return counts[family](layers)
