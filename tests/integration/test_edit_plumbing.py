"""The trainer's side of editing on the tiny FLUX.1-Kontext: rows with input images reach the adapter, the prompt
cache keys them by prompt and image, and a family refuses rows with the wrong number of images before training."""

import numpy as np
import pytest
import torch
from PIL import Image

from components.dataset.input_images import model_input
from components.dataset.prepared import PromptRow
from components.errors import ModelLoadError
from components.flow_rl.prompt_cache import PromptEncoder
from components.models.config import ModelConfig
from components.models.loading import load_model
from components.trainer.samples import sample_grid


def _quiet(_msg: str) -> None:
    pass


def _rows(tmp_path, n: int = 3) -> list[PromptRow]:
    rows = []
    for i in range(n):
        path = tmp_path / f"in{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(path)
        rows.append(PromptRow("make it red", {}, (str(path),)))
    return rows


@pytest.mark.parametrize("offload", [False, True])
def test_rows_of_one_prompt_are_encoded_with_their_own_input_image(tmp_path, offload):
    model = load_model(ModelConfig(kind="tiny-flux-kontext", resolution=32), 0)
    rows = _rows(tmp_path)
    images = [np.asarray(Image.open(r.images[0])) for r in rows]
    # before the encoder, which releases the text encoders once every row is cached
    direct = model.encode_prompts(["make it red"] * 3, model_input([[images[2]], [images[0]], [images[2]]], 32))
    encoder = PromptEncoder(model, rows, resolution=32, offload=offload, cache_gib=1.0, log=_quiet)
    embeds = encoder([rows[2], rows[0], rows[2]])
    for key in direct.tensors:
        assert torch.equal(embeds.tensors[key], direct.tensors[key]), key
    latents = embeds.tensors["image_latents"]
    assert torch.equal(latents[0], latents[2]) and not torch.equal(latents[0], latents[1])


def test_a_family_refuses_rows_with_the_wrong_number_of_input_images(tmp_path):
    text_model = load_model(ModelConfig(kind="tiny-flux", resolution=32), 0)
    with pytest.raises(ModelLoadError, match=r"carry 1 input image.*FluxPipeline makes images from text alone"):
        PromptEncoder(text_model, _rows(tmp_path, 1), resolution=32, offload=False, cache_gib=1.0, log=_quiet)
    edit_model = load_model(ModelConfig(kind="tiny-flux-kontext", resolution=32), 0)
    with pytest.raises(ModelLoadError, match=r"FluxKontextPipeline takes 1 input image.*carry 0"):
        PromptEncoder(edit_model, [PromptRow("a cat")], resolution=32, offload=False, cache_gib=1.0, log=_quiet)


def test_the_cfg_negative_rows_carry_each_rows_image_conditioning(tmp_path):
    model = load_model(ModelConfig(kind="tiny-flux-kontext", resolution=32), 0)
    rows = _rows(tmp_path, 2)
    cond = PromptEncoder(model, rows, resolution=32, offload=False, cache_gib=1.0, log=_quiet)(rows)
    negative = model.negative_for(cond)
    assert torch.equal(negative.tensors["image_latents"], cond.tensors["image_latents"])
    text = model.negative_embeddings()
    assert torch.equal(negative.tensors["prompt_embeds"][1], text.tensors["prompt_embeds"][0])


def test_a_sample_grid_shows_each_input_left_of_its_sample():
    samples = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    inputs = np.full((2, 8, 8, 3), 255, dtype=np.uint8)
    inputs[1, :, :, 0] = 0
    grid = sample_grid(samples, ["a", "b"], [0.5, 0.5], inputs=inputs)
    plain = sample_grid(samples, ["a", "b"], [0.5, 0.5])
    assert grid.shape[1] == 2 * plain.shape[1]  # each tile twice as wide
    tile = grid.shape[1] // 2  # 2 tiles a row: the first tile is [input | sample]
    assert (grid[10, :tile // 2] == 255).all() and (grid[10, tile // 2:tile] == 0).all()


def test_a_trained_edit_lora_reloads_and_the_registered_model_edits_the_given_image(tmp_path):
    """The LoRA of an editing run, loaded by the pipeline's own load_lora_weights, makes the images the trainer's
    model makes from the same input; the registered pyfunc takes the input as input_image_b64 and serves them."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from components.dataset.input_images import square
    from components.models.generate import generate
    from components.registry.pyfunc_model import LoRAImageModel
    from components.rewards.codec import decode_image_b64, encode_png_b64
    from components.trainer.loop import Trainer
    from pipeline.config import CONFIG_DIR, load_config

    rows = _rows(tmp_path, 2)
    # the images beside the file, named relative to it (an absolute path needs data.allow_external_images)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": r.prompt, "images": [Path(r.images[0]).name]})
                                                 + "\n" for r in rows))
    config = load_config(CONFIG_DIR / "tiny-flux-cpu.yaml", [
        "model.kind=tiny-flux-kontext", "data.prompts=null", f"data.path={tmp_path / 'rows.jsonl'}", "train.epochs=1",
        "sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=8",
        "train.batch_size_per_worker=8", "sampling.num_steps=4", "train.learning_rate=0.05"])
    trainer = Trainer(config, tmp_path / "run", log=_quiet)
    trainer.fit()
    source = np.asarray(Image.open(rows[1].images[0]))
    shown = square(source, 32)
    kw = {"resolution": 32, "num_steps": 4, "guidance_scale": 3.5, "seed": 0}
    trained = generate(trainer.model, ["make it red"], images=[[shown]], **kw)
    fresh = load_model(config.model, config.seed)
    base = generate(fresh, ["make it red"], images=[[shown]], **kw)
    fresh.pipeline.load_lora_weights(str(tmp_path / "run" / "lora"))
    assert np.array_equal(generate(fresh, ["make it red"], images=[[shown]], **kw), trained)
    assert not np.array_equal(base, trained)
    other = generate(fresh, ["make it red"], images=[[square(np.asarray(Image.open(rows[0].images[0])), 32)]], **kw)
    assert not np.array_equal(other, trained)  # the input image shapes the edit

    (tmp_path / "model.json").write_text(json.dumps({"model": config.model.model_dump(mode="json"),
                                                     "seed": config.seed}))
    served = LoRAImageModel()
    served.load_context(SimpleNamespace(artifacts={"lora": str(tmp_path / "run" / "lora"),
                                                   "model": str(tmp_path / "model.json")}))
    frame = served.predict(None, {"prompt": ["make it red"], "input_image_b64": [encode_png_b64(source)]},
                           params={"seed": 0, "num_inference_steps": 4, "guidance_scale": 3.5})
    assert np.array_equal(decode_image_b64(frame["image_png_b64"][0], 4096)[None], trained)
    with pytest.raises(ValueError, match="input_image_b64 is missing on row 1"):
        served.predict(None, {"prompt": ["a", "b"], "input_image_b64": [encode_png_b64(source), None]})


def test_generate_samples_runs_of_one_prompt_and_input_in_one_call_each():
    """Pipelines that take one prompt and one set of input images per call (Qwen-Image-Edit, Wan2.1 I2V, FLUX.2
    klein's references) are called once per run of rows sharing both: each run's images are what a call of that run
    alone, from the same generator state, makes."""
    from components.models.generate import _runs, generate

    a, b = np.zeros((32, 32, 3), np.uint8), np.full((32, 32, 3), 200, np.uint8)
    assert _runs(["x", "x", "y", "y", "y"], [[a], [a], [a], [b], [b]]) == [(0, 2), (2, 3), (3, 5)]
    assert _runs(["x", "y"], None) == [(0, 2)]
    model = load_model(ModelConfig(kind="tiny-flux-kontext", resolution=32), 0)
    kw = {"resolution": 32, "num_steps": 2, "guidance_scale": 3.5, "seed": 3}
    both = generate(model, ["make it red", "make it red", "add a dot"], images=[[a], [a], [b]], **kw)
    first = generate(model, ["make it red", "make it red"], images=[[a], [a]], **kw)
    assert both.shape == (3, 32, 32, 3) and np.array_equal(both[:2], first)
    assert not np.array_equal(both[2], first[0])
