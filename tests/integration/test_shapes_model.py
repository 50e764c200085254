"""The shapes-sd3 demo model: its pretraining is deterministic from the seed, the shipped weights are what the
script's defaults make, and they follow prompts well above chance but not perfectly (room for RL)."""

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch
from safetensors import safe_open

from components.dataset.prepare import BUILTIN_DIR
from components.errors import ModelLoadError
from components.models import shapes_pretrain as sp
from components.models.config import ModelConfig
from components.models.loading import load_model
from components.models.shapes_sd3 import TEXT_LENGTH, WEIGHTS, build_architecture, load_shapes_sd3
from components.rewards.arguments import GenEvalShapesArgs
from components.rewards.geneval_shapes import GenEvalShapes
from components.shapes.scenes import VOCABULARY, parse_prompt

BUILTIN = BUILTIN_DIR / "shapes.jsonl"
TINY_RUN = dict(scenes=64, vae_steps=3, vae_batch=4, flow_steps=3, flow_batch=4, warmup=2)


def _pretrain(seed: int) -> dict[str, torch.Tensor]:
    pipe, log = sp.pretrain(sp.PretrainConfig(seed=seed, **TINY_RUN), lambda *_: None)
    assert len(log["flow_loss"]) == 1 and np.isfinite(log["flow_loss"][0][1])
    return {name: getattr(pipe, name).state_dict() for name in ("transformer", "vae", "text_encoder_3")}


def test_pretraining_gives_the_same_weights_from_the_same_seed_and_others_from_another():
    first, again, other = _pretrain(0), _pretrain(0), _pretrain(1)
    for name, weights in first.items():
        for key, value in weights.items():
            assert torch.equal(value, again[name][key]), f"{name}.{key} differs between two runs of seed 0"
    assert not torch.equal(first["transformer"]["proj_out.weight"], other["transformer"]["proj_out.weight"])


def test_the_shipped_weights_are_what_the_scripts_defaults_make():
    """`python -m components.models.shapes_pretrain` with no arguments rebuilds the committed file: the recipe
    recorded beside it (and inside it) is the script's default one."""
    log = json.loads(WEIGHTS.with_suffix(".json").read_text())
    assert log["config"] == asdict(sp.PretrainConfig())
    with safe_open(str(WEIGHTS), "pt") as f:
        assert json.loads(f.metadata()["pretrain"]) == log["config"]
    assert log["flow_loss"][-1][1] < log["flow_loss"][0][1] / 2  # it learned


def test_the_shipped_model_draws_the_shapes_it_is_asked_for_imperfectly():
    """Scored by the GenEval-style reward on prompts of the built-in set, against the untrained architecture."""
    model = load_model(ModelConfig(kind="shapes-sd3", resolution=48, device="cpu"), seed=0)
    prompts = ["two red circles and a blue square", "a yellow triangle", "three green squares", "a blue circle",
               "two yellow squares and a red triangle", "four blue circles", "a green triangle and a red square",
               "a red circle"]
    for prompt in prompts:
        parse_prompt(prompt)

    def scores(pipe) -> tuple[float, float]:
        images = pipe(prompt=prompts * 2, num_inference_steps=20, guidance_scale=1.0, height=48, width=48,
                      generator=torch.Generator().manual_seed(0), output_type="np", max_sequence_length=16).images
        images = (images * 255).round().astype(np.uint8)
        partial = GenEvalShapes(GenEvalShapesArgs(mode="partial"))(images, prompts * 2, [{}] * len(images)).scores
        strict = GenEvalShapes(GenEvalShapesArgs(mode="strict"))(images, prompts * 2, [{}] * len(images)).scores
        return float(partial.mean()), float(strict.mean())

    partial, strict = scores(model.pipeline)
    untrained = build_architecture(0)
    untrained.set_progress_bar_config(disable=True)
    random_partial, _ = scores(untrained.to(torch.float32))
    assert partial > 0.12 and partial > random_partial + 0.1, (partial, random_partial)
    assert strict < 0.95, "the demo model should leave RL something to improve"


def test_the_shapes_model_is_loaded_only_at_its_resolution(tmp_path):
    with pytest.raises(ModelLoadError, match="trained at 48 px, not 32"):
        load_shapes_sd3(32, 0)
    with pytest.raises(ModelLoadError, match="weights are missing"):
        load_shapes_sd3(48, 0, tmp_path / "none.safetensors")


def test_each_word_of_the_grammar_is_one_token_and_every_prompt_fits():
    pipe = build_architecture(0)
    longest = max((json.loads(line)["prompt"] for line in BUILTIN.read_text().splitlines()), key=len)
    words = longest.split()
    clip = pipe.tokenizer(longest)["input_ids"]
    t5 = pipe.tokenizer_3(longest)["input_ids"]
    assert len(clip) == len(words) + 2 <= TEXT_LENGTH and len(t5) == len(words) + 1 <= TEXT_LENGTH
    for word in VOCABULARY:
        assert len(pipe.tokenizer_2(word)["input_ids"]) == 3 and len(pipe.tokenizer_3(word)["input_ids"]) == 2, word
    assert len(pipe.tokenizer_3("a purple hexagon")["input_ids"]) > 4  # other words still spell out, char by char
