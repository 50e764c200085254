"""FLUX.1-Kontext on its tiny twin: the input image's latents enter every forward as FluxKontextPipeline puts them
(sampling equals the pipeline's own call, the step log-prob equals a float64 transcription), each row keeps its own
image, a saved LoRA reloads through the pipeline, a saved pipeline is recognised, and rows with another number of
input images are refused."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from components.dataset.input_images import model_input, square
from components.errors import ModelLoadError
from components.flow_rl.rollout import SamplerSettings, plan_steps, sample_rollout, step_log_prob
from components.flow_rl.sde import euler_step
from components.models.config import LoRAConfig, ModelConfig
from components.models.flux import kontext
from components.models.flux.kontext import FluxKontextModel
from components.models.flux.tiny import build_tiny_flux_kontext
from components.models.generate import generate
from components.models.loading import load_model
from pipeline.config import CONFIG_DIR, load_config

REPO = Path(__file__).resolve().parents[2]

R = 32  # px: the tiny VAE downsamples by 4, so 4 x 4 = 16 packed tokens, and as many for the input image
G = 2.5  # FLUX.1-Kontext-dev's embedded guidance (its model card, flow_grpo's counting_flux_kontext)
PROMPTS = ["make the square red", "add a small blue circle"]
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                     "ff.net.0.proj", "ff.net.2", "proj_mlp"])


def _raw_images(n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` uint8 input images of different non-square sizes (so the centre crop and the resize both act)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (40 + 2 * i, 48 - i, 3), dtype=np.uint8) for i in range(n)]


def _model(seed: int = 0, lora: bool = False) -> FluxKontextModel:
    model = load_model(ModelConfig(kind="tiny-flux-kontext", resolution=R), seed)
    if lora:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.add_lora(LORA):  # the LoRA's B starts at zero: make it count
                p.add_(0.05)
    return model


def _pipeline_images(model: FluxKontextModel, raw: list[np.ndarray], noise: torch.Tensor,
                     steps: int = 4) -> np.ndarray:
    """The pipeline's own __call__ on each prompt's squared input image (what the registered model serves)."""
    pil = [[Image.fromarray(square(image, R))] for image in raw]
    return model.pipeline(height=R, width=R, num_inference_steps=steps, latents=noise.clone(), output_type="np",
                          **model.pipeline_inputs(PROMPTS[:len(raw)], G, pil)).images


def test_ode_sampling_through_the_adapter_matches_the_pipelines_own_call():
    """VAE encoding (the posterior's mode, shifted and scaled), packing, the appended tokens and their ids, the
    noisy tokens' slice of the output, the schedule's shift from the noisy tokens alone, embedded guidance."""
    model, steps, raw = _model(), 4, _raw_images(2)
    noise = torch.randn(2, *model.latent_shape(R), generator=torch.Generator().manual_seed(3))
    served = _pipeline_images(model, raw, noise, steps)
    assert served.shape == (2, R, R, 3)  # the pipeline's preferred-size resize is off, its output area R x R
    sigmas = model.sigmas(steps, R)
    cond, x = model.encode_prompts(PROMPTS, model_input([[image] for image in raw], R)), noise
    with torch.no_grad():
        for i in range(steps):
            x = euler_step(model.predict_velocity(x, float(sigmas[i]), cond, G), float(sigmas[i]),
                           float(sigmas[i + 1]), x)
        ours = model.decode(x).permute(0, 2, 3, 1).numpy()
    assert torch.allclose(model.pipeline.scheduler.sigmas.float(), sigmas)
    np.testing.assert_allclose(ours, served, atol=2e-4)
    # the input image is not decoration: the pipeline edits another image into another picture
    other = _pipeline_images(model, _raw_images(2, seed=1), noise, steps)
    assert np.abs(other - served).max() > 1e-3


def _flux_sigmas_f64(num_steps: int, image_tokens: int, config) -> np.ndarray:
    """FLUX.1's schedule: linspace(1, 1/N, N) under the time shift exp(mu) / (exp(mu) + 1 / s - 1), mu linear in
    the image tokens between (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift); then 0."""
    slope = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
    mu = config.base_shift + slope * (image_tokens - config.base_image_seq_len)
    s = np.linspace(1.0, 1 / num_steps, num_steps)
    return np.append(np.exp(mu) / (np.exp(mu) + (1 / s - 1)), 0.0)


def test_step_log_prob_with_the_input_image_equals_a_float64_transcription():
    """The input image VAE-encoded (mode), shifted and scaled, packed into 2x2 tokens, appended to the noisy
    tokens with ids whose first coordinate is 1, the velocity read off the noisy tokens, then the SDE step's
    Gaussian log-prob: each written out again in float64 and compared with what the rollout stored and
    step_log_prob scores; the image tokens taken away, or given the noisy tokens' ids, move the mean far."""
    steps, noise_level = 4, 0.7
    model, raw = _model(lora=True), _raw_images(2)
    pixels = model_input([[image] for image in raw], R)
    sde, train = plan_steps(steps, 0.99, None)
    settings = SamplerSettings(steps, G, noise_level, "sde", R, sde, train)
    rollout = sample_rollout(model, PROMPTS, 2, 4, settings, torch.Generator().manual_seed(0),
                             embeds=model.encode_prompts(PROMPTS, pixels))
    grid = R // 8  # tokens per side: VAE factor 4, 2x2 patches
    sigmas = _flux_sigmas_f64(steps, grid * grid, model.pipeline.scheduler.config)
    np.testing.assert_allclose(model.sigmas(steps, R).numpy(), sigmas, rtol=1e-6, atol=1e-7)

    vae = copy.deepcopy(model.pipeline.vae).double()
    transformer = copy.deepcopy(model.transformer).double()
    with torch.no_grad():
        z = vae.encode(pixels[:, 0].double()).latent_dist.mode()
        z = (z - vae.config.shift_factor) * vae.config.scaling_factor
        b, c, h, w = z.shape  # 2x2 patches, channel-major within a token, tokens row-major
        image_tokens = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
        text = [model.pipeline.encode_prompt([p], None, max_sequence_length=model.max_sequence_length)
                for p in PROMPTS]
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    noisy_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).double()
    input_ids = noisy_ids.clone()
    input_ids[:, 0] = 1

    @torch.no_grad()
    def transition(i: int, t: int, with_image: bool = True, image_first: float = 1.0) -> tuple[float, torch.Tensor]:
        """(log-prob, mean) of stored step t of sample i."""
        k = int(rollout.prompt_index[i])
        x, x_next = rollout.trajectory[i:i + 1, t].double(), rollout.trajectory[i:i + 1, t + 1].double()
        s, s_next = sigmas[t], sigmas[t + 1]
        ids = input_ids.clone()
        ids[:, 0] = image_first
        tokens, img_ids = (torch.cat([x, image_tokens[k:k + 1]], 1), torch.cat([noisy_ids, ids])) if with_image \
            else (x, noisy_ids)
        embeds, pooled, _ = text[k]
        v = transformer(hidden_states=tokens, timestep=torch.tensor([s]).double(), guidance=torch.tensor([G]).double(),
                        encoder_hidden_states=embeds.double(), pooled_projections=pooled.double(),
                        txt_ids=torch.zeros(embeds.shape[1], 3).double(), img_ids=img_ids,
                        return_dict=False)[0][:, :x.shape[1]]
        std = noise_level * math.sqrt(s / (1 - (s_next if s == 1 else s)))
        dt = s_next - s
        mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
        noise_std = std * math.sqrt(-dt)
        lp = -((x_next - mean) ** 2) / (2 * noise_std**2) - math.log(noise_std) - 0.5 * math.log(2 * math.pi)
        return float(lp.mean()), mean[0]

    tol = 2e-5
    for i in range(len(rollout)):
        for t in range(len(settings.train_steps)):
            expected, mean = transition(i, t)
            with torch.no_grad():
                log_prob, our_mean, _ = step_log_prob(model, rollout, torch.tensor([i]), t, settings, G)
            assert abs(float(rollout.log_probs[i, t]) - expected) < tol, (i, t)
            assert abs(float(log_prob[0]) - expected) < tol, (i, t)
            assert (our_mean[0].double() - mean).abs().max() < tol, (i, t)
            wrong = [transition(i, t, with_image=False)[1], transition(i, t, image_first=0.0)[1]]
            assert all((m - mean).abs().max() > 100 * tol for m in wrong), (i, t)


def test_each_row_keeps_its_own_input_image_in_a_batch():
    """Two images give two velocities; a batch of rows (more than one VAE-encoder chunk of them) gives each row
    what it gives alone, encoding and velocity."""
    model = _model(lora=True)
    n = kontext.ENCODE_IMAGES + 1
    raw = _raw_images(n)
    prompts = [PROMPTS[i % 2] for i in range(n)]
    batch = model.encode_prompts(prompts, model_input([[image] for image in raw], R))
    x = torch.randn(n, *model.latent_shape(R), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = model.predict_velocity(x, 0.6, batch, G)
        for i in (0, n - 1):
            alone = model.encode_prompts([prompts[i]], model_input([[raw[i]]], R))
            torch.testing.assert_close(alone.tensors["image_latents"], batch.tensors["image_latents"][i:i + 1],
                                       rtol=0, atol=1e-6)
            torch.testing.assert_close(model.predict_velocity(x[i:i + 1], 0.6, alone, G), together[i:i + 1],
                                       rtol=1e-5, atol=1e-6)
        # rows 0 and 2: the same prompt and noise, different input images
        same_x = torch.cat([x[:1], x[:1]])
        v = model.predict_velocity(same_x, 0.6, batch.select(torch.tensor([0, 2])), G)
    assert (v[0] - v[1]).abs().max() > 1e-3


def test_saved_lora_reloads_through_the_pipelines_load_lora_weights_and_reproduces_edits(tmp_path):
    """The LoRA in FluxKontextPipeline's own format: reloaded with its load_lora_weights it edits as the trained
    model does (the evaluation's generate), and so does the registered pyfunc given the input image."""
    from types import SimpleNamespace

    import pandas as pd

    from components.registry.pyfunc_model import INPUT_COLUMN, LoRAImageModel
    from components.rewards.codec import decode_image_b64, encode_png_b64

    model, raw = _model(lora=True), _raw_images(2)
    kw = {"resolution": R, "num_steps": 4, "guidance_scale": G, "seed": 0,
          "images": [[square(image, R)] for image in raw]}
    trained = generate(model, PROMPTS, **kw)
    model.save_lora(tmp_path / "lora")
    fresh = _model()
    base = generate(fresh, PROMPTS, **kw)
    fresh.pipeline.load_lora_weights(str(tmp_path / "lora"))
    assert type(fresh.pipeline).__name__ == "FluxKontextPipeline"
    assert np.array_equal(generate(fresh, PROMPTS, **kw), trained)
    assert not np.array_equal(base, trained)

    (tmp_path / "model.json").write_text(json.dumps({"model": ModelConfig(kind="tiny-flux-kontext", resolution=R)
                                                     .model_dump(mode="json"), "seed": 0}))
    served = LoRAImageModel()
    served.load_context(SimpleNamespace(artifacts={"lora": str(tmp_path / "lora"),
                                                   "model": str(tmp_path / "model.json")}))
    frame = served.predict(None, pd.DataFrame({"prompt": PROMPTS, INPUT_COLUMN: [encode_png_b64(i) for i in raw]}),
                           params={"seed": 0, "num_inference_steps": 4, "guidance_scale": G})
    assert np.array_equal(np.stack([decode_image_b64(b, 4096) for b in frame["image_png_b64"]]), trained)


def test_diffusers_kind_detects_flux_kontext_from_model_index_and_loads_offline(tmp_path):
    build_tiny_flux_kontext(R, 3).save_pretrained(tmp_path / "pipe")
    assert json.loads((tmp_path / "pipe" / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    loaded = load_model(ModelConfig(kind="diffusers", path=str(tmp_path / "pipe"), resolution=R), seed=0)
    reference = _model(seed=3)
    assert type(loaded) is FluxKontextModel and loaded.guidance_mode == "embedded" and loaded.input_images == 1
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        ref, got = getattr(reference.pipeline, name).state_dict(), getattr(loaded.pipeline, name).state_dict()
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), name
    pixels = model_input([[_raw_images(1)[0]]], R)
    a, b = loaded.encode_prompts(["make it red"], pixels), reference.encode_prompts(["make it red"], pixels)
    assert a.tensors.keys() == b.tensors.keys() == {"prompt_embeds", "pooled_projections", "image_latents"}
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


@pytest.mark.parametrize("count", [0, 2])
def test_rows_without_exactly_one_input_image_are_refused(count):
    model = _model()
    model.check_input_images(1, "data.path rows")
    with pytest.raises(ModelLoadError, match=rf"data\.path rows: FluxKontextPipeline takes 1 input image\(s\) per "
                                             rf"prompt, but the rows carry {count}; give every row `images` with 1"):
        model.check_input_images(count, "data.path rows")


@pytest.mark.slow
def test_tiny_flux_kontext_config_learns(tmp_path):
    """The tiny families' criterion (test_model_families.py): last-3-epoch mean > first mean + first std / 2 in
    half the config's epochs, with an input image in every row (PNG files beside a JSONL; the shipped config reads
    the built-in shapes editing set)."""
    rng = np.random.default_rng(0)
    rows = []
    for i, prompt in enumerate(["make the square red", "add a small blue circle", "remove the triangle",
                                "make the background white", "turn the circle green", "add a yellow square",
                                "make the triangle bigger", "remove the blue square"]):
        Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(tmp_path / f"in{i}.png")
        rows.append(json.dumps({"prompt": prompt, "images": [f"in{i}.png"]}))
    (tmp_path / "edits.jsonl").write_text("\n".join(rows) + "\n")
    config = CONFIG_DIR / "tiny-flux-kontext-cpu.yaml"
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "--config", str(config), "--output",
                           str(tmp_path / "run"), f"train.epochs={load_config(config).train.epochs // 2}",
                           f"data.path={tmp_path / 'edits.jsonl'}"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last3 = metrics[0], [r["reward/mean"] for r in metrics[-3:]]
    assert sum(last3) / 3 > first["reward/mean"] + first["reward/std"] / 2, (first, last3)
    assert "LEARNED" in proc.stdout
