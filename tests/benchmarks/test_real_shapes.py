"""real_shapes' SD3.5 Large against what Stability AI publishes of it: an 8.1B-parameter MMDiT with Medium's text
encoders, VAE and scheduler; its FLUX.2 klein 4B against Black Forest Labs' and Qwen's figures; its Z-Image against
Tongyi-MAI's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shapes


def test_sd35_large_has_the_published_parameter_count_and_mediums_other_parts():
    assert real_shapes.transformer_param_count("sd35-large") == pytest.approx(8.1e9, rel=0.01)
    assert real_shapes.vae_param_count("sd35-large") == real_shapes.vae_param_count("sd35-medium")
    assert (real_shapes.text_encoder_param_counts("sd35-large", 1)
            == real_shapes.text_encoder_param_counts("sd35-medium", 1))
    pipe = real_shapes.BUILDERS["sd35-large"](device="meta", text_layers=1, transformer_layers=2)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    config = pipe.transformer.config
    assert (config.num_layers, config.num_attention_heads * config.attention_head_dim) == (2, 2432)
    assert tuple(config.dual_attention_layers) == () and config.qk_norm == "rms_norm"


def test_flux2_klein_4b_has_the_published_sizes_and_a_text_encoder_deep_enough_for_its_pipeline():
    # BFL: a 4B-parameter flow model (rounded); Qwen3-4B: 4.0B parameters (its LM head tied to the embedding)
    assert real_shapes.transformer_param_count("flux2-klein") == pytest.approx(4e9, rel=0.05)
    assert real_shapes.text_encoder_param_counts("flux2-klein")["text_encoder"] == pytest.approx(4.0e9, rel=0.01)
    pipe = real_shapes.BUILDERS["flux2-klein"](device="meta", text_layers=1, transformer_layers=5)
    assert type(pipe).__name__ == "Flux2KleinPipeline" and pipe.config.is_distilled
    config = pipe.transformer.config
    assert (config.num_layers, config.num_single_layers) == (1, 4)  # the real 5 : 20
    # the pipeline stacks Qwen3 hidden states 9, 18 and 27 into the transformer's text width
    assert pipe.text_encoder.config.num_hidden_layers >= 28
    assert config.joint_attention_dim == 3 * pipe.text_encoder.config.hidden_size


def test_z_image_has_the_published_sizes():
    # Tongyi-MAI/Z-Image on the hub: a "6B" model whose transformer weights are 12.3 GB in bf16 (6.15B parameters),
    # its text encoder 8.05 GB (Qwen3-4B, 4.02B, loaded as Qwen3Model: no LM head, tied anyway); FLUX.1's VAE
    assert real_shapes.transformer_param_count("z-image") == pytest.approx(6.15e9, rel=0.005)
    assert real_shapes.text_encoder_param_counts("z-image")["text_encoder"] == pytest.approx(4.02e9, rel=0.005)
    assert real_shapes.vae_param_count("z-image") == real_shapes.vae_param_count("flux1-dev")
    pipe = real_shapes.BUILDERS["z-image"](device="meta", text_layers=1, transformer_layers=2)
    assert type(pipe).__name__ == "ZImagePipeline"
    config = pipe.transformer.config
    assert (config.n_layers, config.n_refiner_layers, config.dim) == (2, 2, 3840)
    # the pipeline reads the second-to-last hidden state, and the transformer takes the encoder's width
    assert pipe.text_encoder.config.num_hidden_layers == 2
    assert config.cap_feat_dim == pipe.text_encoder.config.hidden_size


def test_wan21_1_3b_has_the_published_sizes():
    # Wan-AI/Wan2.1-T2V-1.3B: the transformer's bf16 weights are 2.84 GB (1.42B parameters), the UMT5-XXL encoder's
    # 11.4 GB (5.68B, models_t5_umt5-xxl-enc-bf16), the VAE's float32 Wan2.1_VAE.pth 508 MB (127M)
    assert real_shapes.transformer_param_count("wan21-1.3b") == pytest.approx(1.42e9, rel=0.005)
    assert real_shapes.text_encoder_param_counts("wan21-1.3b")["text_encoder"] == pytest.approx(5.68e9, rel=0.005)
    assert real_shapes.vae_param_count("wan21-1.3b") == pytest.approx(127e6, rel=0.01)
    pipe = real_shapes.BUILDERS["wan21-1.3b"](device="meta", text_layers=1, transformer_layers=2)
    assert type(pipe).__name__ == "WanPipeline"
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 8)
    config = pipe.transformer.config
    assert (config.num_layers, config.num_attention_heads * config.attention_head_dim) == (2, 1536)
    assert config.text_dim == pipe.text_encoder.config.d_model
