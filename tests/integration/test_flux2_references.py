"""FLUX.2 klein with reference images (the pipeline's ``image=``) on the tiny twin: the adapter's sampling equals
the pipeline's own call, its step log-prob equals a float64 transcription of the reference conventions, and the
count of references comes from the data within the model's limit."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from sde_reference import sde_transition

from components.dataset.input_images import model_input
from components.errors import DataError, ModelLoadError
from components.flow_rl.rollout import SamplerSettings, plan_steps, sample_rollout, step_log_prob
from components.flow_rl.sde import euler_step
from components.models.config import ModelConfig
from components.models.flux2.adapter import MAX_REFERENCES
from components.models.loading import load_model

G = 4.0  # the base model's CFG, as tiny-flux2-cpu.yaml samples
# the pipeline refuses reference images under 64 px a side (Flux2ImageProcessor.check_image_input)
PIPELINE_RESOLUTION = 64


def _references(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def _model(resolution: int, lora: bool = False):
    model = load_model(ModelConfig(kind="tiny-flux2", resolution=resolution), 0)
    if lora:
        from components.models.config import LoRAConfig

        params = model.add_lora(LoRAConfig(rank=4, alpha=8.0, target_modules=["attn.to_q", "attn.to_k",
                                                                              "attn.to_v", "attn.add_k_proj"]))
        with torch.no_grad():
            for p in params:  # the LoRA's B starts at zero: make it count
                p.add_(0.05)
    return model


@pytest.mark.parametrize("n", [1, 2])
def test_ode_sampling_with_references_matches_the_pipelines_own_call(n):
    """VAE encoding, patchify / pack, the references' ids, their place after the noisy tokens in both CFG passes,
    the velocity sliced off the noisy tokens, the schedule: as ``Flux2KleinPipeline(image=...)`` does."""
    r, steps, prompts = PIPELINE_RESOLUTION, 4, ["a cat", "a red apple on a table"]
    model = _model(r)
    refs = _references(n, r, seed=n)
    noise = torch.randn(2, *model.latent_shape(r), generator=torch.Generator().manual_seed(3))
    pil = [Image.fromarray(a) for a in refs]

    def served(images) -> np.ndarray:
        return model.pipeline(height=r, width=r, num_inference_steps=steps, latents=noise.clone(), output_type="np",
                              **model.pipeline_inputs(prompts, G, images)).images

    out = served([pil, pil])  # the pipeline takes one set of references for every prompt of a call
    model.check_input_images(n, "rows")
    cond = model.encode_prompts(prompts, model_input([refs, refs], r))
    assert cond.tensors["image_latents"].shape == (2, n * model.image_seq_len(r), model.transformer.config.in_channels)
    sigmas, x = model.sigmas(steps, r), noise
    with torch.no_grad():
        for i in range(steps):
            x = euler_step(model.predict_velocity(x, float(sigmas[i]), cond, G), float(sigmas[i]),
                           float(sigmas[i + 1]), x)
        ours = model.decode(x).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(ours, out, atol=2e-4)
    # and the references really act: without them (text-to-image) the images differ
    assert np.abs(served(None) - out).max() > 1e-3


def test_klein_step_log_prob_with_references_equals_a_float64_transcription():
    """Each prompt's own two references: the VAE posterior's mode, 2x2 patches as channel groups (c, i, j),
    normalised by the VAE's batch-norm statistics, packed row by row, ids (10 + 10 k, h, w, 0) for reference k,
    after the noisy tokens in the prompt's and in the empty negative's forward; the velocity of the noisy tokens;
    then the SDE step. Written out again in float64 and compared with what the rollout stored and step_log_prob
    scores."""
    r, steps, noise_level, n = 32, 4, 0.7, 2
    prompts = ["a cat", "a dog on a red sofa"]
    refs = [_references(n, r, seed=10), _references(n, r, seed=11)]
    model = _model(r, lora=True)
    model.check_input_images(n, "rows")
    pixels = model_input(refs, r)
    sde, train = plan_steps(steps, 0.99, None)
    st = SamplerSettings(steps, G, noise_level, "sde", r, sde, train)
    rollout = sample_rollout(model, prompts, 2, 4, st, torch.Generator().manual_seed(0),
                             embeds=model.encode_prompts(prompts, pixels))

    transformer = copy.deepcopy(model.transformer).double()
    vae = copy.deepcopy(model.pipeline.vae).double()
    text = {p: model.pipeline.encode_prompt([p], max_sequence_length=model.max_sequence_length)[0].double()
            for p in [*prompts, ""]}

    def grid_ids(t: int, h: int, w: int) -> torch.Tensor:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack([torch.full_like(rows, t), rows, cols, torch.zeros_like(rows)], -1).reshape(h * w, 4)

    def reference_tokens(images: list[np.ndarray]) -> torch.Tensor:
        x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).double() / 127.5 - 1
        with torch.no_grad():
            moments = vae.encoder(x)
            if vae.quant_conv is not None:
                moments = vae.quant_conv(moments)
        z = moments.chunk(2, dim=1)[0]  # the posterior's mode: its mean
        b, c, h, w = z.shape
        patches = torch.stack([z[:, :, i::2, j::2] for i in (0, 1) for j in (0, 1)], dim=2).reshape(b, 4 * c, h // 2,
                                                                                                    w // 2)
        mean, var = vae.bn.running_mean.double(), vae.bn.running_var.double()
        patches = (patches - mean[:, None, None]) / torch.sqrt(var[:, None, None] + vae.config.batch_norm_eps)
        return patches.permute(0, 2, 3, 1).reshape(1, -1, 4 * c)  # the references one after another

    tokens = [reference_tokens(images) for images in refs]
    side = r // 8  # 32 px / (VAE 4 x patch 2)

    def velocity(x: torch.Tensor, sigma: float, prompt: str, image: torch.Tensor, offset: int = 10) -> torch.Tensor:
        b, c, h, w = x.shape
        length = text[prompt].shape[1]
        ids = torch.cat([grid_ids(0, h, w), *(grid_ids(offset + offset * k, side, side)
                                              for k in range(image.shape[1] // side**2))])
        out = transformer(
            hidden_states=torch.cat([x.permute(0, 2, 3, 1).reshape(b, h * w, c), image.expand(b, -1, -1)], 1),
            timestep=torch.full((b,), sigma).double(), guidance=None,
            encoder_hidden_states=text[prompt].expand(b, -1, -1), img_ids=ids,
            txt_ids=torch.cat([torch.zeros(length, 3, dtype=torch.long), torch.arange(length)[:, None]], 1),
            return_dict=False,
        )[0]
        return out[:, :h * w].reshape(b, h, w, c).permute(0, 3, 1, 2)

    def transition(t: int, offset: int = 10, negative_refs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, log-prob) of stored step t."""
        s, s_next = (float(v) for v in (rollout.sigmas[t], rollout.sigmas_next[t]))
        x, prev = rollout.trajectory[:, t].double(), rollout.trajectory[:, t + 1].double()
        v = []
        with torch.no_grad():
            for i, k in enumerate(rollout.prompt_index.tolist()):
                image = tokens[k] if negative_refs else tokens[k][:, :0]
                cond = velocity(x[i:i + 1], s, rollout.prompts[k], tokens[k], offset)
                uncond = velocity(x[i:i + 1], s, "", image, offset)
                v.append(uncond + G * (cond - uncond))
        v = torch.cat(v)
        return sde_transition(x, prev, v, s, s_next, noise_level)

    for t in st.train_steps:
        log_prob, mean, _ = step_log_prob(model, rollout, torch.arange(4), t, st, G)
        expected_mean, expected = transition(t)
        np.testing.assert_allclose(mean.detach().double().numpy(), expected_mean.numpy(), atol=1e-5)
        np.testing.assert_allclose(log_prob.detach().double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rollout.log_probs[:, t].double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    # the comparison tells the conventions apart (each over 10 tolerances off): the references' time offsets, and
    # the negative carrying them
    t = st.train_steps[0]
    expected_mean = transition(t)[0]
    assert (transition(t, offset=0)[0] - expected_mean).abs().max() > 1e-4
    assert (transition(t, negative_refs=False)[0] - expected_mean).abs().max() > 1e-4


@pytest.mark.parametrize("count", range(MAX_REFERENCES + 1))
def test_the_reference_count_comes_from_the_data_within_klein_s_limit(count):
    model = _model(32)
    assert model.input_images == 0  # text-to-image until rows carry references
    model.check_input_images(count, "data/train.jsonl")
    assert model.input_images == count
    model.check_input_images(count, "data/train.jsonl")  # the same count again (the held-out rows)
    other = count + 1 if count < MAX_REFERENCES else count - 1
    with pytest.raises(ModelLoadError, match=rf"data/train\.jsonl: the rows carry {other} reference images each "
                                             rf"where others carry {count}; FLUX\.2 klein takes as many with every "
                                             "prompt of a run"):
        model.check_input_images(other, "data/train.jsonl")


def test_too_many_references_are_refused_naming_klein_s_limit():
    model = _model(32)
    with pytest.raises(ModelLoadError, match=rf"data/train\.jsonl: the rows carry {MAX_REFERENCES + 1} reference "
                                             rf"images each, but FLUX\.2 klein takes at most {MAX_REFERENCES}"):
        model.check_input_images(MAX_REFERENCES + 1, "data/train.jsonl")
    assert model.input_images == 0
    # without images the embedding is the text alone (the shared CFG negative), as before references existed
    assert set(model.encode_prompts(["a cat"]).tensors) == {"prompt_embeds"}


def test_the_pipeline_call_takes_one_set_of_references_for_all_its_prompts():
    model = _model(PIPELINE_RESOLUTION)
    a, b = (Image.fromarray(x) for x in _references(2, PIPELINE_RESOLUTION, seed=0))
    same = model.pipeline_inputs(["a cat", "a dog"], G, [[a, b], [a.copy(), b.copy()]])
    assert same["image"] == [a, b] and same["prompt"] == ["a cat", "a dog"]
    assert "image" not in model.pipeline_inputs(["a cat"], G, [[]])
    with pytest.raises(DataError, match="call it once per prompt when their references differ"):
        model.pipeline_inputs(["a cat", "a dog"], G, [[a], [b]])


def test_the_edit_recipe_guides_in_training_too():
    # its RayJob is validated with the other GPU recipes' (test_model_families.py)
    from pipeline.config import CONFIG_DIR, load_config

    config = load_config(CONFIG_DIR / "flux2-klein-edit.yaml")
    assert config.model.kind == "diffusers" and config.model.dtype == "bfloat16"
    # the base model guides, in training too, as Flow-Factory's klein-base recipe
    assert config.sampling.guidance_scale == 4.0 and config.train.train_cfg


def _edit_rows(folder) -> str:
    """Rows of an edit instruction and one input scene (a coloured square on grey, PNG) each, as a JSONL."""
    import json

    rng = np.random.default_rng(0)
    instructions = ["make the square red", "remove the square", "add a green circle", "make the square blue"]
    rows = []
    for i in range(16):
        scene = np.full((48, 48, 3), 90, dtype=np.uint8)
        x, y = rng.integers(4, 28, 2)
        scene[y:y + 16, x:x + 16] = rng.integers(0, 256, 3)
        Image.fromarray(scene).save(folder / f"scene{i}.png")
        rows.append(json.dumps({"prompt": instructions[i % 4], "images": [f"scene{i}.png"]}) + "\n")
    (folder / "rows.jsonl").write_text("".join(rows))
    return str(folder / "rows.jsonl")


@pytest.mark.slow
def test_the_tiny_edit_config_learns_with_references(tmp_path):
    """tiny-flux2-edit-cpu.yaml, every row with one input scene: the tiny-family criterion (last-3-epoch mean over
    the first epoch's mean + half its std) in half the config's epochs, every forward carrying the references."""
    import json

    from components.dataset.prepare import BUILTIN_DIR
    from components.trainer.loop import Trainer
    from pipeline.config import CONFIG_DIR, load_config

    path = CONFIG_DIR / "tiny-flux2-edit-cpu.yaml"
    overrides = [f"train.epochs={load_config(path).train.epochs // 2}", "tracking.sample_every=0"]
    if not (BUILTIN_DIR / "shapes-edit.jsonl").exists():  # the config's built-in set, until it ships
        overrides.append(f"data.path={_edit_rows(tmp_path)}")
    trainer = Trainer(load_config(path, overrides), tmp_path / "run", log=lambda _m: None)
    trainer.fit()
    assert trainer.model.input_images == 1  # the rows' references reached the model
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last3 = rows[0], [r["reward/mean"] for r in rows[-3:]]
    assert sum(last3) / 3 > first["reward/mean"] + first["reward/std"] / 2, (first, last3)
