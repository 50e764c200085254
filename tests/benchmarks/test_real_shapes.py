"""real_shapes' SD3.5 Large against what Stability AI publishes of it: an 8.1B-parameter MMDiT with Medium's text
encoders, VAE and scheduler."""

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
