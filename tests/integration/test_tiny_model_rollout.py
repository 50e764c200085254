"""The tiny SD3 model and rollouts: determinism, eval mode, and exact re-scoring (ratio 1)."""

import numpy as np
import pytest
import torch
from rescoring import assert_rescoring_is_exact

from components.flow_rl.rollout import SamplerSettings, plan_steps, sample_rollout
from components.models.config import LoRAConfig, ModelConfig
from components.models.loading import load_model
from components.models.sd3.tiny import build_tiny_sd3

MODULES = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def _state(pipe):
    return {f"{m}.{k}": v for m in MODULES for k, v in getattr(pipe, m).state_dict().items()}


def test_tiny_pipeline_is_deterministic_per_seed_and_in_eval_mode():
    a, b, c = build_tiny_sd3(32, 0), build_tiny_sd3(32, 0), build_tiny_sd3(32, 1)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    for m in MODULES:
        assert not any(mod.training for mod in getattr(a, m).modules()), m


def _model(seed=0):
    model = load_model(ModelConfig(), seed)
    torch.manual_seed(seed)
    params = model.add_lora(LoRAConfig())
    return model, params


def _settings(num_steps=4, guidance=1.0, sde_type="sde", window=None):
    sde, train = plan_steps(num_steps, 0.99 if window is None else 1.0, window)
    return SamplerSettings(num_steps, guidance, 0.7, sde_type, 32, sde, train)


def test_plan_steps():
    assert plan_steps(10, 0.99, None) == (tuple(range(10)), tuple(range(9)))
    assert plan_steps(10, 0.5, None) == (tuple(range(10)), tuple(range(5)))
    assert plan_steps(10, 0.99, (3, 2)) == ((3, 4), (3, 4))


def test_same_seed_gives_the_same_trajectory():
    st = _settings()
    runs = []
    for _ in range(2):
        model, _ = _model()
        runs.append(sample_rollout(model, ["a cat", "a dog"], 4, 8, st, torch.Generator().manual_seed(5)))
    a, b = runs
    assert torch.equal(a.trajectory, b.trajectory) and torch.equal(a.log_probs, b.log_probs)
    assert np.array_equal(a.images, b.images)
    model, _ = _model()
    c = sample_rollout(model, ["a cat", "a dog"], 4, 8, st, torch.Generator().manual_seed(6))
    assert not torch.equal(a.trajectory, c.trajectory)


@pytest.mark.parametrize(
    ("guidance", "sde_type", "window"),
    [(1.0, "sde", None), (3.0, "sde", None), (1.0, "cps", None), (1.0, "sde", (1, 2))],
)
def test_rescoring_a_stored_trajectory_gives_ratio_exactly_one(guidance, sde_type, window):
    model, params = _model()
    st = _settings(guidance=guidance, sde_type=sde_type, window=window)
    rollout = sample_rollout(model, ["a cat", "a dog"], 4, 8, st, torch.Generator().manual_seed(0))
    assert rollout.log_probs.shape == (8, len(st.train_steps))
    assert_rescoring_is_exact(model, params, rollout, st, guidance)


def test_window_stores_only_window_steps_and_uses_ode_elsewhere():
    model, _ = _model()
    st = _settings(num_steps=6, window=(2, 2))
    rollout = sample_rollout(model, ["a cat"], 4, 4, st, torch.Generator().manual_seed(0))
    sigmas = model.sigmas(6, 32)
    assert torch.equal(rollout.sigmas, sigmas[2:4]) and torch.equal(rollout.sigmas_next, sigmas[3:5])
    assert rollout.trajectory.shape[1] == 3 and rollout.log_probs.shape == (4, 2)


def test_cfg_changes_the_velocity():
    model, _ = _model()
    emb = model.encode_prompts(["a red apple"])
    x = torch.randn(1, *model.latent_shape(32), generator=torch.Generator().manual_seed(0))
    v1 = model.predict_velocity(x, 0.5, emb, 1.0)
    v3 = model.predict_velocity(x, 0.5, emb, 3.0)
    uncond = model.predict_velocity(x, 0.5, model.negative_embeddings(), 1.0)
    torch.testing.assert_close(v3, uncond + 3.0 * (v1 - uncond), rtol=1e-4, atol=1e-5)


def test_missing_model_path_is_a_clear_error(tmp_path):
    from components.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"model\.path: .*nowhere is not a directory"):
        load_model(ModelConfig(kind="diffusers", path=str(tmp_path / "nowhere")), 0)
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match=r"no model_index\.json"):
        load_model(ModelConfig(kind="diffusers", path=str(tmp_path / "m")), 0)


def test_diffusers_kind_loads_a_saved_pipeline_offline(tmp_path):
    build_tiny_sd3(32, 3).save_pretrained(tmp_path / "pipe")
    loaded = load_model(ModelConfig(kind="diffusers", path=str(tmp_path / "pipe")), seed=0)
    reference = build_tiny_sd3(32, 3)
    for m in MODULES:
        ref = getattr(reference, m).state_dict()
        got = getattr(loaded.pipeline, m).state_dict()
        assert all(torch.equal(ref[k], got[k]) for k in ref), m
    assert not loaded.transformer.training
    emb_loaded = loaded.encode_prompts(["a red apple"])
    emb_ref = load_model(ModelConfig(), seed=3).encode_prompts(["a red apple"])
    assert all(torch.equal(emb_loaded.tensors[k].float(), emb_ref.tensors[k].float()) for k in emb_ref.tensors)


def test_diffusers_kind_rejects_other_pipelines(tmp_path):
    from components.errors import ModelLoadError

    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    with pytest.raises(ModelLoadError, match="holds a StableDiffusionXLPipeline; supported pipelines: ") as err:
        load_model(ModelConfig(kind="diffusers", path=str(tmp_path)), 0)
    supported = str(err.value).split("supported pipelines: ", 1)[1].split(", ")
    assert {"StableDiffusion3Pipeline", "FluxPipeline", "FluxKontextPipeline", "QwenImagePipeline",
            "QwenImageEditPlusPipeline", "ZImagePipeline", "Flux2KleinPipeline", "WanPipeline",
            "WanImageToVideoPipeline"} <= set(supported)
    assert "StableDiffusionXLPipeline" not in supported
