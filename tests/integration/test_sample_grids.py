"""The sample grids show the same held-out scenes at every logged epoch: the test split's first prompts, ODE-sampled
from one fixed noise, so epoch 0 (the base model) beside the last epoch shows only what training changed; and the
held-out reward of those images is the per-epoch curve in metrics.jsonl."""

import json

import numpy as np
import pytest
from PIL import Image

from components.dataset.prepare import prepare_dataset
from components.dataset.prepared import read_split
from components.models.generate import generate, load_with_lora
from components.rewards.brightness import Brightness
from components.trainer.loop import showcase_seed
from components.trainer.samples import tile_size
from components.trainer.training_run import train
from pipeline.config import TINY_CONFIG, load_config

PROMPTS = [f"a photo of object number {i}" for i in range(20)]


def _tiles(path, n: int, size: int) -> list[np.ndarray]:
    """The images of a grid, scaled back down (tiles are nearest-neighbour upscales by an integer factor)."""
    grid = np.asarray(Image.open(path).convert("RGB"))
    t = tile_size(size)
    cols = int(np.ceil(np.sqrt(n)))
    tile_h = grid.shape[0] // int(np.ceil(n / cols))
    step = t // size
    return [grid[(i // cols) * tile_h:(i // cols) * tile_h + t:step, (i % cols) * t:(i % cols) * t + t:step]
            for i in range(n)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grids")
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    prepare_dataset(str(tmp / "prompts.jsonl"), str(tmp / "ds"), kind="generic", test_fraction=0.25, seed=3)
    config = load_config(TINY_CONFIG, ["data.prompts=null", f"data.path={tmp / 'ds'}", "train.epochs=4",
                                       "tracking.sample_every=2", "tracking.sample_images=4"])
    result = train(config, tmp / "out", log=lambda _: None)
    return config, result, tmp


def test_grids_show_the_held_out_prompts_from_one_noise_base_first(run):
    config, result, tmp = run
    test_rows, _ = read_split(str(tmp / "ds"), "test")
    prompts = [r.prompt for r in test_rows][:4]
    assert not set(prompts) & {r.prompt for r in read_split(str(tmp / "ds"), "train")[0]}
    grids = sorted(p.name for p in (tmp / "out" / "samples").iterdir())
    assert grids == ["epoch-000000.png", "epoch-000002.png", "epoch-000004.png"]
    kw = {"resolution": config.model.resolution, "num_steps": config.sampling.eval_num_steps,
          "guidance_scale": config.sampling.guidance_scale, "seed": showcase_seed(config.seed)}
    # the diffusers pipeline's own sampler, from the same seed: the base model at epoch 0, the LoRA at the end
    base = generate(load_with_lora(config.model, config.seed, None), prompts, **kw)
    lora = generate(load_with_lora(config.model, config.seed, result.lora_dir), prompts, **kw)
    assert not np.array_equal(base, lora)
    for name, expected in (("epoch-000000.png", base), ("epoch-000004.png", lora)):
        tiles = _tiles(tmp / "out" / "samples" / name, 4, config.model.resolution)
        for tile, image in zip(tiles, expected, strict=True):
            assert np.array_equal(tile, image), name


def test_the_held_out_reward_of_those_images_is_in_the_metrics(run):
    config, result, tmp = run
    rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    prompts = [r.prompt for r in read_split(str(tmp / "ds"), "test")[0]][:4]
    kw = {"resolution": config.model.resolution, "num_steps": config.sampling.eval_num_steps,
          "guidance_scale": config.sampling.guidance_scale, "seed": showcase_seed(config.seed)}
    brightness = Brightness()

    def mean_brightness(lora_dir) -> float:
        images = generate(load_with_lora(config.model, config.seed, lora_dir), prompts, **kw)
        return float(np.mean([brightness.score(image, "", {}) for image in images]))

    assert rows[0]["heldout/brightness/base"] == pytest.approx(mean_brightness(None), abs=1e-12)
    assert rows[3]["heldout/brightness/mean"] == pytest.approx(mean_brightness(result.lora_dir), abs=1e-12)
    # sampled at epochs 2 and 4 only; the base value only in the first row
    assert [r["epoch"] for r in rows if "heldout/brightness/mean" in r] == [2, 4]
    assert [r["epoch"] for r in rows if "heldout/brightness/base" in r] == [1]
    summary = result.learning_summary()
    assert summary["heldout/brightness/base"] == rows[0]["heldout/brightness/base"]
    assert summary["heldout/brightness/last"] == rows[3]["heldout/brightness/mean"]
