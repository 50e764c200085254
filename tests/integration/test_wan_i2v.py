"""The Wan2.1 image-to-video adapter on its tiny twin: sampling as WanImageToVideoPipeline.__call__ samples from
the same image, the step log-prob with the image conditioning against a float64 transcription, the LoRA round trip
through the pipeline's load_lora_weights, loading a saved pipeline, and refusals."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers.pipelines.wan import pipeline_wan_i2v
from PIL import Image

from components.dataset.input_images import model_input
from components.errors import DataError, ModelLoadError
from components.flow_rl.rollout import SamplerSettings, plan_steps, sample_rollout, step_log_prob
from components.flow_rl.sde import euler_step
from components.models.config import ModelConfig
from components.models.loading import load_model
from components.models.wan.i2v import WanImageToVideoModel
from components.models.wan.tiny_i2v import build_tiny_wan_i2v
from pipeline.config import CONFIG_DIR, load_config

REPO = Path(__file__).resolve().parents[2]
FRAMES, G, RES = 5, 4.0, 32
LONG_PROMPT = "a dog on a red sofa in a sunny room with a green plant, a wooden floor and a small blue book"
MODULES = ("transformer", "vae", "text_encoder", "image_encoder")


def _model(seed: int = 0):
    config = load_config(CONFIG_DIR / "tiny-wan-i2v-cpu.yaml", [f"seed={seed}"])
    model = load_model(config.model, seed)
    torch.manual_seed(seed)
    return model, model.add_lora(config.model.lora), config


def _image(seed: int, size: int = RES) -> np.ndarray:
    """A smooth random picture (uint8 (size, size, 3)): blocks of colour, so the VAE sees structure."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(blocks).resize((size, size), Image.BILINEAR))


def _state(pipe) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}": v for m in MODULES for k, v in getattr(pipe, m).state_dict().items()}


@pytest.fixture
def identity_ftfy(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers 0.42.1's WanImageToVideoPipeline cleans prompts with ftfy unconditionally; ftfy.fix_text leaves the
    plain-ASCII prompts here as they are."""
    monkeypatch.setattr(pipeline_wan_i2v, "ftfy", SimpleNamespace(fix_text=lambda text: text), raising=False)


def test_tiny_wan_i2v_is_deterministic_per_seed_and_takes_the_image_beside_the_latents():
    a, b, c = _state(build_tiny_wan_i2v(RES, 0)), _state(build_tiny_wan_i2v(RES, 0)), _state(build_tiny_wan_i2v(RES, 1))
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], c[k]) for k in a)
    model, _, _ = _model()
    assert model.input_images == 1 and model.latent_shape(RES) == (16, 3, 8, 8)
    assert model.transformer.config.in_channels == 16 + 2 + 16  # noisy latents, mask (time groups of 2), condition
    with pytest.raises(ModelLoadError, match=r"takes 1 input image\(s\) per prompt, but the rows carry 0"):
        model.check_input_images(0, "data.path")


def test_ode_sampling_through_the_adapter_matches_the_i2v_pipelines_own_call(identity_ftfy):
    """CLIP image tokens, the first frame's VAE latents after the time-grouped mask, CFG whose negative pass keeps
    both, the schedule and the VAE's un-normalisation as WanImageToVideoPipeline.__call__ does them."""
    model, _, _ = _model()
    steps, prompts = 4, ["a cat", "a red apple on a table"]
    pixels = _image(0)
    pil = Image.fromarray(pixels)
    noise = torch.randn(2, *model.latent_shape(RES), generator=torch.Generator().manual_seed(3))

    def call(**inputs) -> np.ndarray:
        return model.pipeline(height=RES, width=RES, num_inference_steps=steps, latents=noise.clone(),
                              output_type="np", **inputs).frames

    served = call(**model.pipeline_inputs(prompts, G, [[pil], [pil]]))
    # the pipeline's own text path gives what the adapter hands it as embeddings
    own_text = call(prompt=prompts, image=pil, **model.pipeline_call_kwargs(G))
    np.testing.assert_allclose(served, own_text, atol=1e-6)

    sigmas = model.sigmas(steps, RES)
    cond = model.encode_prompts(prompts, model_input([[pixels], [pixels]], RES))
    x = noise
    with torch.no_grad():
        for i in range(steps):
            x = euler_step(model.predict_velocity(x, float(sigmas[i]), cond, G), float(sigmas[i]),
                           float(sigmas[i + 1]), x)
        ours = model.decode(x)
    assert ours.shape == (2, FRAMES, 3, RES, RES)
    np.testing.assert_allclose(ours.permute(0, 1, 3, 4, 2).numpy(), served, atol=2e-4)
    # each part counts: guidance, and the image (another one makes other videos from the same noise)
    assert np.abs(call(**model.pipeline_inputs(prompts, 1.0, [[pil], [pil]])) - served).max() > 1e-3
    other = Image.fromarray(_image(1))
    assert np.abs(call(**model.pipeline_inputs(prompts, G, [[other], [other]])) - served).max() > 1e-3


def test_the_negative_rows_carry_the_image_and_the_pipeline_takes_one_image_per_call():
    model, _, _ = _model()
    cond = model.encode_prompts(["a cat", "a dog"], model_input([[_image(0)], [_image(1)]], RES))
    negative = model.negative_for(cond)
    for key in ("image_embeds", "condition"):
        assert torch.equal(negative.tensors[key], cond.tensors[key])
    assert torch.equal(negative.tensors["prompt_embeds"][1], model.negative_embeddings().tensors["prompt_embeds"][0])
    assert not torch.equal(cond.tensors["image_embeds"][0], cond.tensors["image_embeds"][1])
    # encoded one at a time or in a batch: the same rows (the pipeline encodes one image per call)
    alone = model.encode_prompts(["a dog"], model_input([[_image(1)]], RES))
    for key, value in alone.tensors.items():
        torch.testing.assert_close(value[0], cond.tensors[key][1], atol=1e-5, rtol=1e-5)
    two = [[Image.fromarray(_image(0))], [Image.fromarray(_image(1))]]
    with pytest.raises(DataError, match="one input image per call"):
        model.pipeline_inputs(["a cat", "a dog"], G, two)


def test_step_log_prob_with_the_image_conditioning_equals_a_float64_transcription():
    """The CLIP penultimate states of the processed image, the first frame + zeros VAE-encoded and normalised, the
    mask (ones on latent frame 0, one channel per frame of the VAE's time group), concatenated channel-wise to the
    noisy latents; CFG against the empty prompt with the same image conditioning; the SDE step and the
    log-density averaged over C, T, H and W: each written out again in float64."""
    model, params, _ = _model()
    with torch.no_grad():
        for p in params:  # the LoRA's B starts at zero: make it count
            p.add_(0.05)
    steps, noise_level = 4, 0.7
    sde, train = plan_steps(steps, 0.99, None)
    st = SamplerSettings(steps, G, noise_level, "sde", RES, sde, train)
    prompts, images = ["a cat", LONG_PROMPT], [_image(0), _image(1)]
    embeds = model.encode_prompts(prompts, model_input([[im] for im in images], RES))
    rollout = sample_rollout(model, prompts, 2, 4, st, torch.Generator().manual_seed(0), embeds=embeds)

    pipe = model.pipeline
    transformer = copy.deepcopy(model.transformer).double()
    vae, clip = copy.deepcopy(pipe.vae).double(), copy.deepcopy(pipe.image_encoder).double()
    text = {p: pipe.text_encoder(**{k: v for k, v in pipe.tokenizer(
        p, padding="max_length", max_length=model.max_sequence_length, truncation=True, return_tensors="pt").items()}
    ).last_hidden_state.double() for p in [*prompts, ""]}
    for p, t in text.items():  # the pipeline zeroes the states past the prompt's tokens
        length = int(pipe.tokenizer(p, return_tensors="pt").attention_mask.sum())
        t[:, length:] = 0

    def image_tokens(image: np.ndarray) -> torch.Tensor:
        """CLIP preprocessing: bicubic resize (no-op at 32 px), centre crop, [0, 1], OpenAI mean / std."""
        mean = torch.tensor([0.48145466, 0.4578275, 0.40821073], dtype=torch.float64).view(1, 3, 1, 1)
        std = torch.tensor([0.26862954, 0.26130258, 0.27577711], dtype=torch.float64).view(1, 3, 1, 1)
        x = torch.from_numpy(image.copy()).double().permute(2, 0, 1)[None] / 255
        return clip(pixel_values=(x - mean) / std, output_hidden_states=True).hidden_states[-2]

    def condition(image: np.ndarray) -> torch.Tensor:
        first = torch.from_numpy(image.copy()).double().permute(2, 0, 1)[None, :, None] / 127.5 - 1
        video = torch.cat([first, torch.zeros(1, 3, FRAMES - 1, RES, RES, dtype=torch.float64)], dim=2)
        z = vae.encode(video).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float64).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, dtype=torch.float64).view(1, 16, 1, 1, 1)
        mask = torch.zeros(1, 2, *z.shape[2:], dtype=torch.float64)
        mask[:, :, 0] = 1
        return torch.cat([mask, (z - mean) / std], dim=1)

    with torch.no_grad():
        conditions = [(image_tokens(im), condition(im)) for im in images]

    @torch.no_grad()
    def v_of(prompt: str, image: int, x: torch.Tensor, sigma: float, with_image: bool = True) -> torch.Tensor:
        tokens, cond = conditions[image] if with_image else (conditions[image][0] * 0, conditions[image][1] * 0)
        return transformer(hidden_states=torch.cat([x, cond], dim=1), timestep=torch.full((1,), 1000 * sigma).double(),
                           encoder_hidden_states=text[prompt], encoder_hidden_states_image=tokens,
                           return_dict=False)[0]

    def transition(t: int, uncond_image: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, log-prob) of stored step t; ``uncond_image`` false: a negative pass without the image."""
        sigma, sigma_next = rollout.levels[t]
        x, prev = rollout.trajectory[:, t].double(), rollout.trajectory[:, t + 1].double()
        rows = [(rollout.prompts[int(k)], int(k)) for k in rollout.prompt_index]
        cond = torch.cat([v_of(p, k, x[i:i + 1], sigma) for i, (p, k) in enumerate(rows)])
        uncond = torch.cat([v_of("", k, x[i:i + 1], sigma, uncond_image) for i, (_, k) in enumerate(rows)])
        v = uncond + G * (cond - uncond)
        dt = sigma_next - sigma
        std = noise_level * math.sqrt(sigma / (1 - (sigma_next if sigma == 1 else sigma)))
        mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        density = torch.distributions.Normal(mean, std * math.sqrt(-dt)).log_prob(prev)
        return mean, density.mean(dim=(1, 2, 3, 4))

    tol = 2e-5
    for t in range(len(st.train_steps)):
        mean, expected = transition(t)
        with torch.no_grad():
            log_prob, our_mean, _ = step_log_prob(model, rollout, torch.arange(4), t, st, G)
        assert (our_mean.double() - mean).abs().max() < tol, t
        np.testing.assert_allclose(log_prob.double().numpy(), expected.numpy(), rtol=tol, atol=tol)
        np.testing.assert_allclose(rollout.log_probs[:, t].double().numpy(), expected.numpy(), rtol=tol, atol=tol)
        # the comparison tells a negative pass without the image apart
        assert (transition(t, uncond_image=False)[0] - mean).abs().max() > 100 * tol, t


def test_saved_lora_reloads_through_the_i2v_pipelines_load_lora_weights_and_reproduces_frames(tmp_path):
    """Through ``generate`` (the pipeline's own call with the input image), as evaluation and the registered model
    sample; the pyfunc rebuilds the model and serves the same frames for an ``input_image_b64`` column."""
    from components.models.generate import generate

    model, params, config = _model()
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model.save_lora(tmp_path / "lora")
    image, prompts = _image(0), ["a cat on a sofa"] * 2
    kw = {"resolution": RES, "num_steps": 4, "guidance_scale": G, "seed": 0, "images": [[image]] * 2}
    trained = generate(model, prompts, **kw)
    fresh = load_model(config.model, config.seed)
    base = generate(fresh, prompts, **kw)
    fresh.pipeline.load_lora_weights(str(tmp_path / "lora"))
    reloaded = generate(fresh, prompts, **kw)
    assert trained.shape == (2, FRAMES, RES, RES, 3)
    np.testing.assert_array_equal(trained, reloaded)
    assert np.abs(base.astype(int) - reloaded).max() > 2

    import base64
    import io

    import pandas as pd

    from components.registry.pyfunc_model import LoRAImageModel
    from components.rewards.codec import encode_png_b64

    (tmp_path / "model.json").write_text(json.dumps({"model": config.model.model_dump(mode="json"),
                                                     "seed": config.seed}))
    served = LoRAImageModel()
    served.load_context(SimpleNamespace(artifacts={"lora": str(tmp_path / "lora"),
                                                   "model": str(tmp_path / "model.json")}))
    frame = served.predict(None, pd.DataFrame({"prompt": prompts, "input_image_b64": [encode_png_b64(image)] * 2}),
                           params={"seed": 0, "num_inference_steps": 4, "guidance_scale": G})
    for encoded, video in zip(frame["video_webp_b64"], trained, strict=True):
        with Image.open(io.BytesIO(base64.b64decode(encoded))) as im:
            frames = []
            for i in range(im.n_frames):
                im.seek(i)
                frames.append(np.asarray(im.convert("RGB")))
        np.testing.assert_array_equal(np.stack(frames), video)


def test_diffusers_kind_detects_wan_image_to_video_and_loads_it_offline(tmp_path):
    build_tiny_wan_i2v(RES, 3).save_pretrained(tmp_path / "i2v")
    index_file = tmp_path / "i2v" / "model_index.json"
    assert json.loads(index_file.read_text())["_class_name"] == "WanImageToVideoPipeline"
    config = ModelConfig(kind="diffusers", path=str(tmp_path / "i2v"), num_frames=FRAMES)
    loaded = load_model(config, seed=0)
    reference = load_model(ModelConfig(kind="tiny-wan-i2v", num_frames=FRAMES), seed=3)
    assert type(loaded) is WanImageToVideoModel and loaded.guidance_mode == "cfg"
    ref, got = _state(reference.pipeline), _state(loaded.pipeline)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    images = model_input([[_image(0)]], RES)
    a, b = loaded.encode_prompts(["a red apple"], images), reference.encode_prompts(["a red apple"], images)
    assert a.tensors.keys() == {"prompt_embeds", "image_embeds", "condition"}
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)

    index = json.loads(index_file.read_text())
    index["expand_timesteps"] = True  # Wan2.2 TI2V 5B: the first frame replaces the latents instead
    index_file.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"Wan2\.2 TI2V pipeline"):
        load_model(config, seed=0)


@pytest.mark.slow
def test_tiny_wan_i2v_config_learns_from_rows_with_input_images(tmp_path):
    """The tiny configs' acceptance criterion (last-3-epoch mean > first mean + first std / 2) in 14 of the config's
    40 epochs, on 8 rows whose input images are PNG files beside the JSONL."""
    rows = []
    for i, prompt in enumerate(["a red ball rolls", "a blue square spins", "a green triangle falls",
                                "a yellow circle grows", "a white star fades", "a purple cross slides",
                                "an orange ring bounces", "a black dot drifts"]):
        Image.fromarray(_image(i, 48)).save(tmp_path / f"image-{i}.png")
        rows.append({"prompt": prompt, "images": f"image-{i}.png"})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "--config",
                           str(CONFIG_DIR / "tiny-wan-i2v-cpu.yaml"), "--output", str(tmp_path / "run"),
                           "train.epochs=14", "data.prompts=null", f"data.path={tmp_path / 'rows.jsonl'}"],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last3 = metrics[0], [r["reward/mean"] for r in metrics[-3:]]
    assert sum(last3) / 3 > first["reward/mean"] + first["reward/std"] / 2, (first, last3)
    assert "LEARNED" in proc.stdout


def test_the_14b_recipe_shards_and_its_real_shape_pipeline_has_the_published_sizes():
    # its RayJob is validated with the other GPU recipes' (test_model_families.py)
    sys.path.insert(0, str(REPO / "tests" / "benchmarks"))
    import real_shapes

    config = load_config(CONFIG_DIR / "wan21-i2v-14b-480p.yaml")
    assert config.train.sharding == "fsdp" and config.model.offload_text_encoders
    # Wan-AI/Wan2.1-I2V-14B-480P: the transformer's bf16 shards are 32.8 GB (16.4B parameters), the ViT-H/14 image
    # encoder 0.63B, UMT5-XXL 5.68B
    assert real_shapes.transformer_param_count("wan21-i2v-14b") == pytest.approx(16.39e9, rel=0.005)
    counts = real_shapes.text_encoder_param_counts("wan21-i2v-14b")
    assert counts["image_encoder"] == pytest.approx(0.631e9, rel=0.005)
    assert counts["text_encoder"] == pytest.approx(5.68e9, rel=0.005)
    pipe = real_shapes.BUILDERS["wan21-i2v-14b"](device="meta", text_layers=1, transformer_layers=2)
    model = WanImageToVideoModel(pipe, torch.device("cpu"), torch.bfloat16, num_frames=config.model.num_frames)
    assert model.latent_shape(480) == (16, 2, 60, 60) and pipe.transformer.config.in_channels == 16 + 4 + 16
    assert pipe.image_encoder.config.num_hidden_layers == 2  # the pipeline reads the penultimate layer
