"""FLUX.1 and Qwen-Image adapters on their tiny models: the pipeline's own semantics (schedule, packing,
guidance, decoding), exact re-scoring, diffusers-format LoRA round trips, loading saved pipelines, and
guidance settings a family cannot honour rejected before training."""

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rescoring import assert_rescoring_is_exact
from sde_reference import sde_transition
from tiny_families import recipe, text_twins

from components.errors import ConfigError
from components.flow_rl.rollout import SamplerSettings, plan_steps, sample_rollout, step_log_prob
from components.flow_rl.sde import euler_step
from components.models.config import LoRAConfig, ModelConfig
from components.models.families import load, tiny_twins
from components.models.generate import generate
from components.models.loading import load_model
from components.trainer.loop import Trainer
from pipeline.config import CONFIG_DIR, load_config

REPO = Path(__file__).resolve().parents[2]
# every family's text-to-image tiny twin but SD3's, the default model (test_tiny_model_rollout.py)
KINDS = [kind for kind in text_twins(video=False) if kind != "tiny-sd3"]
# the family's guidance and negative prompt as its recipe uses them: FLUX embeds 3.5, Qwen-Image runs true CFG at 4
# against " ", FLUX.2 klein (base) CFG at 4 against the empty prompt, Z-Image CFG at 4 (its pipeline's
# guidance_scale 3)
RECIPES = {kind: load_config(recipe(kind)) for kind in KINDS}
GUIDANCE = {kind: config.sampling.guidance_scale for kind, config in RECIPES.items()}
NEGATIVE = {kind: config.model.negative_prompt for kind, config in RECIPES.items()}
LONG_PROMPT = "a dog on a red sofa in a sunny room with a green plant, a wooden floor and a small blue book"
SMALL = ["train.epochs=1", "sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=8",
         "train.batch_size_per_worker=4", "sampling.num_steps=4", "train.checkpoint_every=1"]


def _quiet(_msg: str) -> None:
    pass


def _config(kind: str, *overrides: str):
    return load_config(recipe(kind), [*SMALL, *overrides])


def _model(kind: str, seed: int = 0):
    config = _config(kind, f"seed={seed}")
    model = load_model(config.model, seed)
    torch.manual_seed(seed)
    return model, model.add_lora(config.model.lora)


def _build(kind: str, seed: int):
    """The tiny twin's pipeline at 32 px, by its registered builder."""
    return load(tiny_twins()[kind].builder)(32, seed)


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _state(pipe):
    return {f"{name}.{k}": v for name, m in _modules(pipe).items() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_pipeline_is_deterministic_per_seed_and_in_eval_mode(kind):
    a, b, c = _build(kind, 0), _build(kind, 0), _build(kind, 1)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert type(a).__name__ == tiny_twins()[kind].pipeline
    for name, m in _modules(a).items():
        assert not any(mod.training for mod in m.modules()), name


def test_tiny_qwen_tokenizer_puts_the_template_prefix_in_the_34_tokens_the_pipeline_drops():
    pipe = _build("tiny-qwenimage", 0)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer.encode(prefix)) == pipe.prompt_template_encode_start_idx == 34
    # so a prompt's embedding has one row per prompt token plus the template's 5-token suffix
    embeds, _ = pipe.encode_prompt(["a cat"], device="cpu")
    suffix = "<|im_end|>\n<|im_start|>assistant\n"
    assert embeds.shape[1] == len(pipe.tokenizer.encode("a cat" + suffix))


@pytest.mark.parametrize("kind", KINDS)
def test_ode_sampling_through_the_adapter_matches_the_pipelines_own_call(kind):
    """Schedule, packing, guidance (embedded / true CFG with norm rescale) and decoding as diffusers does."""
    model, _ = _model(kind)
    steps, g, prompts = 4, GUIDANCE[kind], ["a cat", "a red apple on a table"]
    noise = torch.randn(2, *model.latent_shape(32), generator=torch.Generator().manual_seed(3))
    out = model.pipeline(height=32, width=32, num_inference_steps=steps, latents=noise.clone(), output_type="np",
                         **model.pipeline_inputs(prompts, g))
    sigmas = model.sigmas(steps, 32)
    assert torch.allclose(model.pipeline.scheduler.sigmas.float(), sigmas)
    cond, x = model.encode_prompts(prompts), noise
    with torch.no_grad():
        for i in range(steps):
            x = euler_step(model.predict_velocity(x, float(sigmas[i]), cond, g), float(sigmas[i]),
                           float(sigmas[i + 1]), x)
        ours = model.decode(x).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(ours, out.images, atol=2e-4)
    # and the guidance really acts: without it the images differ
    unguided = model.pipeline(height=32, width=32, num_inference_steps=steps, latents=noise.clone(), output_type="np",
                              **model.pipeline_inputs(prompts, 1.0)).images
    assert np.abs(unguided - out.images).max() > 1e-3


def test_flux_guidance_is_embedded_in_one_forward_and_kept_in_training():
    model, _ = _model("tiny-flux")
    emb = model.encode_prompts(["a red apple"])
    x = torch.randn(1, *model.latent_shape(32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.predict_velocity(x, 0.5, emb, 3.5)
        direct = model.transformer(
            hidden_states=x, timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
            encoder_hidden_states=emb.tensors["prompt_embeds"], pooled_projections=emb.tensors["pooled_projections"],
            txt_ids=torch.zeros(emb.tensors["prompt_embeds"].shape[1], 3),
            img_ids=model.pipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32), return_dict=False,
        )[0]
        v1 = model.predict_velocity(x, 0.5, emb, 1.0)
    assert torch.equal(v, direct)
    assert not torch.allclose(v, v1)
    assert model.training_guidance_scale(3.5, train_cfg=False) == 3.5


def test_qwen_true_cfg_is_the_norm_rescaled_combination_of_two_forwards():
    model, _ = _model("tiny-qwenimage")
    emb = model.encode_prompts(["a red apple on a wooden table"])
    x = torch.randn(1, *model.latent_shape(32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        guided = model.predict_velocity(x, 0.5, emb, 4.0)
        cond = model.predict_velocity(x, 0.5, emb, 1.0)
        uncond = model.predict_velocity(x, 0.5, model.encode_prompts([" "]), 1.0)
    mix = uncond + 4.0 * (cond - uncond)
    expected = mix * cond.norm(dim=-1, keepdim=True) / mix.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(guided, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(guided, mix, atol=1e-4)  # the rescale is not a no-op
    assert model.training_guidance_scale(4.0, train_cfg=False) == 1.0


def _klein_sigmas_f64(num_steps: int, image_tokens: int) -> np.ndarray:
    """FLUX.2's schedule as BFL's reference get_schedule writes it: linspace(1, 0, N + 1) under the time shift
    exp(mu) / (exp(mu) + 1 / t - 1), mu interpolated in the step count between fits for 10 and 200 steps."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    m_10, m_200 = a1 * image_tokens + b1, a2 * image_tokens + b2
    mu = m_200 if image_tokens > 4300 else m_200 + (num_steps - 200) * (m_200 - m_10) / 190
    t = np.linspace(1.0, 0.0, num_steps + 1)
    with np.errstate(divide="ignore"):
        return np.exp(mu) / (np.exp(mu) + 1 / t - 1)


def _sde_rollout_with_lora(kind: str, prompts: list[str], guidance: float, steps: int, noise_level: float):
    """A 4-image SDE rollout (2 per prompt, every step trained) of the tiny ``kind`` with a LoRA that counts."""
    model, params = _model(kind)
    with torch.no_grad():
        for p in params:  # the LoRA's B starts at zero: make it count
            p.add_(0.05)
    sde, train = plan_steps(steps, 0.99, None)
    st = SamplerSettings(steps, guidance, noise_level, "sde", 32, sde, train)
    return model, st, sample_rollout(model, prompts, 2, 4, st, torch.Generator().manual_seed(0))


def test_flux2_klein_step_log_prob_equals_a_float64_transcription_of_its_conventions():
    """Schedule (empirical mu), timestep = sigma, row-major 2x2-patch tokens with (0, h, w, 0) / (0, 0, 0, l) RoPE
    ids, plain CFG against the empty prompt, then the SDE step: each written out again in float64 and compared
    with what the adapter's rollout stored and step_log_prob scores."""
    g, steps, noise_level = 4.0, 4, 0.7
    prompts = ["a cat", "a dog on a red sofa"]
    model, st, rollout = _sde_rollout_with_lora("tiny-flux2", prompts, g, steps, noise_level)
    sigmas = _klein_sigmas_f64(steps, image_tokens=(32 // 8) ** 2)  # 32 px / (VAE 4 x patch 2), squared
    np.testing.assert_allclose(model.sigmas(steps, 32).numpy(), sigmas, rtol=1e-6, atol=1e-7)

    transformer = copy.deepcopy(model.transformer).double()
    text = {p: model.pipeline.encode_prompt([p], max_sequence_length=model.max_sequence_length)[0].double()
            for p in [*prompts, ""]}

    def velocity(x: torch.Tensor, sigma: float, prompt: str) -> torch.Tensor:
        b, c, h, w = x.shape
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        zero, length = torch.zeros_like(rows), text[prompt].shape[1]
        out = transformer(
            hidden_states=x.permute(0, 2, 3, 1).reshape(b, h * w, c), timestep=torch.full((b,), sigma).double(),
            guidance=None, encoder_hidden_states=text[prompt].expand(b, -1, -1),
            img_ids=torch.stack([zero, rows, cols, zero], -1).reshape(h * w, 4),
            txt_ids=torch.cat([torch.zeros(length, 3, dtype=torch.long), torch.arange(length)[:, None]], 1),
            return_dict=False,
        )[0]
        return out.reshape(b, h, w, c).permute(0, 3, 1, 2)

    def transition(t: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, log-prob) of stored step t."""
        s, s_next = sigmas[t], sigmas[t + 1]
        x, prev = rollout.trajectory[:, t].double(), rollout.trajectory[:, t + 1].double()
        with torch.no_grad():
            v = torch.cat([velocity(x[i:i + 1], s, rollout.prompts[int(k)])
                           for i, k in enumerate(rollout.prompt_index)])
            uncond = velocity(x, s, "")
        v = uncond + scale * (v - uncond)
        return sde_transition(x, prev, v, s, s_next, noise_level)

    for t in st.train_steps:
        log_prob, mean, _ = step_log_prob(model, rollout, torch.arange(4), t, st, g)
        expected_mean, expected = transition(t, g)
        np.testing.assert_allclose(mean.detach().double().numpy(), expected_mean.numpy(), atol=1e-5)
        np.testing.assert_allclose(log_prob.detach().double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rollout.log_probs[:, t].double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
        # the comparison tells the guidance apart: without CFG the transcribed mean is 100 tolerances off
        assert (transition(t, 1.0)[0] - expected_mean).abs().max() > 1e-3


def test_klein_pipeline_serves_the_negative_prompt_the_adapter_guides_against():
    """The pipeline's own negative is always the empty prompt; another must reach its __call__ (what a registered
    model serves) as the adapter's embeddings, so served images are the trained model's."""
    model = load_model(ModelConfig(kind="tiny-flux2", negative_prompt="a dark blurry photo"), 0)
    prompts, steps, g = ["a cat", "a red apple on a table"], 4, 4.0
    noise = torch.randn(2, *model.latent_shape(32), generator=torch.Generator().manual_seed(3))
    served = model.pipeline(height=32, width=32, num_inference_steps=steps, latents=noise.clone(), output_type="np",
                            **model.pipeline_inputs(prompts, g)).images
    sigmas, cond, x = model.sigmas(steps, 32), model.encode_prompts(prompts), noise
    with torch.no_grad():
        for i in range(steps):
            x = euler_step(model.predict_velocity(x, float(sigmas[i]), cond, g), float(sigmas[i]),
                           float(sigmas[i + 1]), x)
        np.testing.assert_allclose(model.decode(x).permute(0, 2, 3, 1).numpy(), served, atol=2e-4)
    plain = model.pipeline(height=32, width=32, num_inference_steps=steps, latents=noise.clone(), output_type="np",
                           prompt=prompts, **model.pipeline_call_kwargs(g)).images
    assert np.abs(plain - served).max() > 1e-3  # the empty prompt's guidance is another


def test_a_loaded_distilled_klein_rejects_guidance_before_training(tmp_path):
    _build("tiny-flux2", 0).save_pretrained(tmp_path / "klein")
    index_file = tmp_path / "klein" / "model_index.json"
    index = json.loads(index_file.read_text())
    assert index["is_distilled"] is False
    base = [f"model.path={tmp_path / 'klein'}", "model.kind=diffusers"]
    assert load_model(ModelConfig(kind="diffusers", path=str(tmp_path / "klein")), 0).guidance_mode == "cfg"
    index["is_distilled"] = True  # FLUX.2-klein-4B / 9B: step-distilled, their pipeline ignores the scale
    index_file.write_text(json.dumps(index))
    assert load_model(ModelConfig(kind="diffusers", path=str(tmp_path / "klein")), 0).guidance_mode == "none"
    with pytest.raises(ConfigError, match=r"train\.train_cfg must be false for Flux2KleinPipeline"):
        Trainer(_config("tiny-flux2", *base), tmp_path / "run1", log=_quiet)
    with pytest.raises(ConfigError, match=r"sampling\.guidance_scale must be 1 for Flux2KleinPipeline"):
        Trainer(_config("tiny-flux2", *base, "train.train_cfg=false"), tmp_path / "run2", log=_quiet)
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()

@pytest.mark.parametrize(
    ("kind", "guidance", "sde_type", "window"),
    [(kind, GUIDANCE[kind], "sde", None) for kind in KINDS] + [(kind, 1.0, "cps", (1, 2)) for kind in KINDS],
)
def test_rescoring_a_stored_trajectory_gives_ratio_exactly_one(kind, guidance, sde_type, window):
    model, params = _model(kind)
    sde, train = plan_steps(4, 0.99 if window is None else 1.0, window)
    st = SamplerSettings(4, guidance, 0.7, sde_type, 32, sde, train)
    # prompts of different token lengths, so Qwen's padded text mask is exercised, and Z-Image's captions pad to
    # different multiples of 32 tokens (sub-batches then differ in how its transformer would pad them)
    rollout = sample_rollout(model, ["a cat", LONG_PROMPT], 4, 8, st, torch.Generator().manual_seed(0))
    train_guidance = model.training_guidance_scale(guidance, train_cfg=guidance > 1)
    assert_rescoring_is_exact(model, params, rollout, st, train_guidance)


@pytest.mark.parametrize("kind", KINDS)
def test_saved_lora_reloads_through_the_pipelines_load_lora_weights_and_reproduces_images(kind, tmp_path):
    config = _config(kind, "train.learning_rate=0.05")
    trainer = Trainer(config, tmp_path, log=_quiet)
    trainer.fit()
    kw = {"resolution": 32, "num_steps": 4, "guidance_scale": GUIDANCE[kind], "seed": 0}
    trained = generate(trainer.model, ["a cat on a sofa"] * 2, **kw)
    fresh = load_model(config.model, config.seed)
    base = generate(fresh, ["a cat on a sofa"] * 2, **kw)
    fresh.pipeline.load_lora_weights(str(tmp_path / "lora"))
    assert type(fresh.pipeline).__name__ == tiny_twins()[kind].pipeline
    reloaded = generate(fresh, ["a cat on a sofa"] * 2, **kw)
    assert np.array_equal(trained, reloaded)
    assert not np.array_equal(base, reloaded)

    # the registered pyfunc rebuilds the same family from model.json and serves the same images
    from types import SimpleNamespace

    from components.registry.pyfunc_model import LoRAImageModel
    from components.rewards.codec import decode_image_b64

    (tmp_path / "model.json").write_text(json.dumps({"model": config.model.model_dump(mode="json"),
                                                     "seed": config.seed}))
    served = LoRAImageModel()
    served.load_context(SimpleNamespace(artifacts={"lora": str(tmp_path / "lora"),
                                                   "model": str(tmp_path / "model.json")}))
    assert type(served.model.pipeline).__name__ == tiny_twins()[kind].pipeline
    frame = served.predict(None, {"prompt": ["a cat on a sofa"] * 2},
                           params={"seed": 0, "num_inference_steps": 4, "guidance_scale": GUIDANCE[kind]})
    assert np.array_equal(np.stack([decode_image_b64(b, 4096) for b in frame["image_png_b64"]]), trained)


@pytest.mark.parametrize("kind", KINDS)
def test_diffusers_kind_detects_the_family_from_model_index_and_loads_offline(kind, tmp_path):
    _build(kind, 3).save_pretrained(tmp_path / "pipe")
    pipeline = tiny_twins()[kind].pipeline
    assert json.loads((tmp_path / "pipe" / "model_index.json").read_text())["_class_name"] == pipeline
    loaded = load_model(ModelConfig(kind="diffusers", path=str(tmp_path / "pipe"),
                                    negative_prompt=NEGATIVE[kind]), seed=0)
    reference = load_model(ModelConfig(kind=kind, negative_prompt=NEGATIVE[kind]), seed=3)
    assert type(loaded) is type(reference) and type(loaded.pipeline).__name__ == pipeline
    assert loaded.guidance_mode == reference.guidance_mode
    ref, got = _state(reference.pipeline), _state(loaded.pipeline)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    a, b = loaded.encode_prompts(["a red apple"]), reference.encode_prompts(["a red apple"])
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_zimage_embeddings_are_the_pipelines_per_prompt_lists_right_padded():
    """The pipeline encodes each prompt to a list entry of its own length; the adapter keeps them as rows, padded
    with zeros, the mask giving each length, and leaves the caller's list alone (the pipeline templates the list
    it is given in place)."""
    model, _ = _model("tiny-zimage")
    prompts = ["a cat", LONG_PROMPT]
    given = list(prompts)
    emb = model.encode_prompts(given)
    assert given == prompts
    entries = model.pipeline.encode_prompt(list(prompts), device="cpu", do_classifier_free_guidance=False)[0]
    mask = emb.tensors["prompt_embeds_mask"]
    assert mask.sum(1).tolist() == [len(e) for e in entries]
    for row, entry, trimmed in zip(emb.tensors["prompt_embeds"], entries, map(model.trim_embedding, emb.rows()),
                                   strict=True):
        assert torch.equal(row[:len(entry)], entry) and not row[len(entry):].any()
        assert torch.equal(trimmed.tensors["prompt_embeds"][0], entry)
    # Qwen3's chat template for one user turn, no system turn and no <think> block (enable_thinking=True)
    templated = "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    assert len(entries[0]) == len(model.pipeline.tokenizer(templated).input_ids)
    # the transformer pads captions to multiples of 32 tokens: these two pad to different lengths
    assert len(entries[0]) <= 32 < len(entries[1])


def test_zimage_velocity_of_a_sample_does_not_depend_on_the_batch_it_is_in():
    """Z-Image's transformer pads a batch's sequences to the longest under an attention mask; the adapter runs
    captions of different padded lengths (multiples of 32 tokens) in separate forwards, so re-scoring a sample in
    a micro-batch of other prompts than it was sampled with computes exactly what sampling did."""
    model, _ = _model("tiny-zimage")
    emb = model.encode_prompts(["a cat", LONG_PROMPT, "a dog", "an apple on a table"])
    assert emb.tensors["prompt_embeds_mask"].sum(1).tolist()[1] > 32 >= max(
        emb.tensors["prompt_embeds_mask"].sum(1).tolist()[::2])
    x = torch.randn(4, *model.latent_shape(32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for g in (1.0, 4.0):
            full = model.predict_velocity(x, 0.6, emb, g)
            for rows in ([2, 0], [3, 0, 2]):  # the short captions alone: nothing to pad them to
                idx = torch.tensor(rows)
                assert torch.equal(model.predict_velocity(x[idx], 0.6, emb.select(idx), g), full[idx]), (g, rows)


def test_zimage_step_log_prob_equals_a_float64_transcription_of_its_conventions():
    """Schedule (linspace under the fixed shift 6), timestep 1 - sigma, the negated output, the pipeline's guidance
    pos + (w - 1)(pos - neg), lists of one image and one caption of its own length, then the SDE step: each
    written out again in float64 and compared with what the rollout stored and step_log_prob scores; each
    convention gotten wrong moves the step's mean far beyond the tolerance."""
    g, steps, noise_level = 4.0, 4, 0.7
    prompts = ["a cat", LONG_PROMPT]
    model, st, rollout = _sde_rollout_with_lora("tiny-zimage", prompts, g, steps, noise_level)
    base = np.linspace(1.0, 1 / steps, steps)
    np.testing.assert_allclose(model.sigmas(steps, 32).numpy(), [*(6 * base / (1 + 5 * base)), 0.0], rtol=1e-6)

    transformer = copy.deepcopy(model.transformer).double()
    text = {p: model.pipeline.encode_prompt([p], device="cpu", do_classifier_free_guidance=False)[0][0].double()
            for p in [*prompts, ""]}

    @torch.no_grad()
    def transcribed(i: int, t: int, timestep, cfg_scale: float, sign: float) -> tuple[float, torch.Tensor]:
        """(log-prob, mean) of the stored step t of sample i."""
        x, x_next = rollout.trajectory[i, t].double(), rollout.trajectory[i, t + 1].double()
        sigma, sigma_next = rollout.levels[t]

        def out(prompt: str) -> torch.Tensor:
            time = torch.tensor([timestep(sigma)], dtype=torch.float64)
            return transformer([x[:, None]], time, [text[prompt]], return_dict=False)[0][0][:, 0]

        pos, neg = out(prompts[rollout.prompt_index[i]]), out("")
        v = sign * (pos + cfg_scale * (pos - neg))
        dt = sigma_next - sigma
        std = noise_level * math.sqrt(sigma / (1 - (sigma_next if sigma == 1 else sigma)))
        mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        noise_std = std * math.sqrt(-dt)
        lp = -((x_next - mean) ** 2) / (2 * noise_std**2) - math.log(noise_std) - 0.5 * math.log(2 * math.pi)
        return float(lp.mean()), mean

    tol = 2e-5
    for i in range(len(rollout)):
        for t in range(len(st.train_steps)):
            expected, mean = transcribed(i, t, lambda s: 1 - s, g - 1, -1.0)
            with torch.no_grad():
                log_prob, our_mean, _ = step_log_prob(model, rollout, torch.tensor([i]), t, st, g)
            assert abs(float(rollout.log_probs[i, t]) - expected) < tol, (i, t)
            assert abs(float(log_prob[0]) - expected) < tol, (i, t)
            assert (our_mean[0].double() - mean).abs().max() < tol, (i, t)
            wrong = [transcribed(i, t, lambda s: s, g - 1, -1.0),  # timestep sigma
                     transcribed(i, t, lambda s: 1 - s, g, -1.0),  # the pipeline's scale taken for ours
                     transcribed(i, t, lambda s: 1 - s, g - 1, 1.0)]  # the output not negated
            assert all((m - mean).abs().max() > 100 * tol for _, m in wrong), (i, t)


def test_lora_targets_of_another_family_are_named_in_the_error():
    model = load_model(ModelConfig(kind="tiny-qwenimage"), 0)
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: ff\.net\.0\.proj, ff\.net\.2 match no "
                                         r"module of the QwenImageTransformer2DModel"):
        model.add_lora(LoRAConfig())  # the default targets are SD3's, with ff.*


@pytest.mark.parametrize(
    ("path", "overrides", "key"),
    [
        ("tiny-flux-cpu.yaml", ["train.train_cfg=true"], "train.train_cfg must be false for tiny-flux"),
        ("tiny-flux-cpu.yaml", ["model.negative_prompt=blurry"], "model.negative_prompt must be empty for tiny-flux"),
        ("flux1-dev-pickscore.yaml", ["model.kind=tiny-flux", "model.path=null", "train.train_cfg=true"],
         "train.train_cfg must be false"),
        ("tiny-qwenimage-cpu.yaml", ["sampling.guidance_scale=1", "train.train_cfg=false"],
         "model.negative_prompt is set but sampling.guidance_scale is 1"),
        ("tiny-cpu.yaml", ["model.negative_prompt=blurry"], "model.negative_prompt is set but sampling.guidance"),
        ("tiny-zimage-cpu.yaml", ["sampling.guidance_scale=1", "train.train_cfg=false", "model.negative_prompt=blurry"],
         "model.negative_prompt is set but sampling.guidance_scale is 1"),
    ],
)
def test_guidance_settings_a_family_cannot_honour_are_rejected_by_the_config(path, overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(CONFIG_DIR / path, overrides)


def test_a_loaded_flux_rejects_train_cfg_and_a_schnell_like_one_rejects_guidance_before_training(tmp_path):
    dev = _build("tiny-flux", 0)
    dev.save_pretrained(tmp_path / "dev")
    base = [f"model.path={tmp_path / 'dev'}", "model.kind=diffusers"]
    with pytest.raises(ConfigError, match=r"train\.train_cfg must be false for FluxPipeline"):
        Trainer(_config("tiny-flux", *base, "train.train_cfg=true"), tmp_path / "run1", log=_quiet)
    index = json.loads((tmp_path / "dev" / "transformer" / "config.json").read_text())
    index["guidance_embeds"] = False  # FLUX.1-schnell: distilled without a guidance input
    (tmp_path / "dev" / "transformer" / "config.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"sampling\.guidance_scale must be 1 for FluxPipeline"):
        Trainer(_config("tiny-flux", *base), tmp_path / "run2", log=_quiet)
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()


@pytest.mark.parametrize("path", ["flux1-dev-pickscore.yaml", "qwenimage-ocr.yaml", "flux2-klein-pickscore.yaml",
                                  "zimage-pickscore.yaml", "wan21-t2v-1.3b-pickscore.yaml",
                                  "flux1-kontext-edit.yaml", "qwenimage-edit-2509.yaml", "flux2-klein-edit.yaml",
                                  "wan21-i2v-14b-480p.yaml"])
def test_gpu_configs_give_valid_rayjobs_for_a_gpu_pool(path):
    sys.path.insert(0, str(REPO / "tests"))
    import rayjob_schema

    from components.launch.kubernetes.rayjob_manifest import build_rayjob
    from components.trainer.loop import check_world_size

    config = load_config(CONFIG_DIR / path)
    manifest = build_rayjob(config, run_id="run-1", output="s3://flowgrpo/runs/t", parent_run_id=None)
    assert rayjob_schema.errors(manifest) == []
    (group,) = manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert str(limits["nvidia.com/gpu"]) == "1" and group["replicas"] == 8
    assert config.model.kind == "diffusers" and config.model.dtype == "bfloat16"
    check_world_size(config, config.cluster.workers.training_workers)  # the global batch shards evenly


FEWER_EPOCHS = {"tiny-qwenimage": 14, "tiny-zimage": 8}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_family_config_learns(kind, tmp_path):
    """The acceptance criterion of the SD3 config: last-3-epoch mean > first mean + first std / 2, in half the
    config's epochs; Qwen-Image in 14 of 40 and Z-Image in 8 of 20, which pass it by epochs 9 and 5 (1.1 and 1.5
    first-epoch stds up at 14 and 8)."""
    config = recipe(kind)
    epochs = FEWER_EPOCHS.get(kind, load_config(config).train.epochs // 2)
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "--config", str(config), "--output",
                           str(tmp_path), f"train.epochs={epochs}"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last3 = rows[0], [r["reward/mean"] for r in rows[-3:]]
    assert sum(last3) / 3 > first["reward/mean"] + first["reward/std"] / 2, (first, last3)
    assert "LEARNED" in proc.stdout
