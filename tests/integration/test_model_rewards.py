"""CLIP-based rewards on a tiny random CLIP saved to disk, checked against the transformers model used
directly (one image and one prompt at a time) and against the aesthetic MLP written out by hand."""

from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

from components.errors import ConfigError, RewardError
from components.models.tiny_tokenizers import clip_tokenizer, clip_vocab_size
from components.rewards.arguments import AestheticArgs, ClipArgs
from components.rewards.clip_models import AestheticScore, ClipScore, PickScore
from components.rewards.registry import RewardSpec, build_reward
from components.trainer.config import TrainingJobConfig

PROJECTION_DIM = 16
PROMPTS = ["a red cube", "a cat wearing a very small hat", "a red cube"]  # a repeated prompt, as in a group
LINEARS = (0, 2, 4, 6, 7)  # indices of the Linear layers in LAION's MLP (the others are Dropout)


def save_tiny_clip(path) -> None:
    """A random CLIP (hidden 32, 2 layers, 32 px images, patch 8, projection 16) and its processor."""
    tokenizer = clip_tokenizer()
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    layers = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={**layers, **ids, "vocab_size": clip_vocab_size(), "max_position_embeddings": 77},
        vision_config={**layers, "image_size": 32, "patch_size": 8},
        projection_dim=PROJECTION_DIM,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(path)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)


def random_head() -> dict[str, torch.Tensor]:
    """A LAION-style aesthetic MLP state dict with random weights."""
    generator = torch.Generator().manual_seed(1)
    sizes = [PROJECTION_DIM, 1024, 128, 64, 16, 1]
    state = {}
    for index, (n_in, n_out) in zip(LINEARS, pairwise(sizes), strict=True):
        state[f"layers.{index}.weight"] = torch.randn(n_out, n_in, generator=generator) / n_in**0.5
        state[f"layers.{index}.bias"] = torch.randn(n_out, generator=generator)
    return state


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_clip")
    save_tiny_clip(path)
    return path


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    state = random_head()
    path = tmp_path_factory.mktemp("head") / "aesthetic.safetensors"
    save_file(state, path)
    return path, state


@pytest.fixture(scope="module")
def reference(clip_dir):
    """Unit-norm embeddings computed straight from the saved model, one input at a time."""
    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)

    @torch.no_grad()
    def embed(images, prompts):
        img = torch.cat([model.get_image_features(**processor(images=Image.fromarray(im), return_tensors="pt"))
                         .pooler_output for im in images])
        txt = torch.cat([model.get_text_features(**processor(text=p, return_tensors="pt")).pooler_output
                         for p in prompts])
        return F.normalize(img, dim=-1), F.normalize(txt, dim=-1)

    return embed, model.logit_scale.exp().item()


def _images(n=3, seed=0):
    # Not square and not 32 px, so the processor's resize and centre crop are exercised.
    return np.random.default_rng(seed).integers(0, 256, size=(n, 48, 64, 3), dtype=np.uint8)


def test_clip_score_is_the_cosine_of_the_embeddings(clip_dir, reference):
    images = _images()
    img, txt = reference[0](images, PROMPTS)
    out = build_reward(RewardSpec(name="clip_score", args={"model_path": str(clip_dir)}))(images, PROMPTS, [{}] * 3)
    assert out.errors == [None] * 3 and out.scores.shape == (3,)
    np.testing.assert_allclose(out.scores, (img * txt).sum(-1).numpy(), atol=1e-5)
    assert not torch.allclose(txt[0], txt[1])  # the prompt matters (pooling at the real end-of-text token)


def test_pickscore_is_the_scaled_cosine(clip_dir, reference):
    images = _images()
    img, txt = reference[0](images, PROMPTS)
    scores = PickScore(ClipArgs(model_path=str(clip_dir), device="cpu"))(images, PROMPTS, [{}] * 3).scores
    np.testing.assert_allclose(scores, reference[1] * (img * txt).sum(-1).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_aesthetic_is_the_mlp_on_the_normalised_image_embedding(clip_dir, head, reference, tmp_path, suffix):
    path, state = head
    if suffix == ".pt":  # the format of LAION's published checkpoints
        path = tmp_path / "aesthetic.pt"
        torch.save(state, path)
    images = _images()
    x = reference[0](images, PROMPTS)[0]
    for index in LINEARS:  # no activations between the layers, and Dropout is off in eval
        x = x @ state[f"layers.{index}.weight"].T + state[f"layers.{index}.bias"]
    reward = AestheticScore(AestheticArgs(model_path=str(clip_dir), head_path=str(path)))
    assert not reward.head.training
    scores = reward(images, ["ignored"] * 3, [{}] * 3).scores
    np.testing.assert_allclose(scores, x.squeeze(-1).numpy(), rtol=1e-5, atol=1e-5)


def test_each_score_depends_only_on_its_own_image(clip_dir, head):
    rewards = [ClipScore(ClipArgs(model_path=str(clip_dir))),
               AestheticScore(AestheticArgs(model_path=str(clip_dir), head_path=str(head[0])))]
    images = _images()
    changed = images.copy()
    changed[1] = _images(1, seed=7)[0]
    for reward in rewards:
        before, after = reward(images, PROMPTS, [{}] * 3).scores, reward(changed, PROMPTS, [{}] * 3).scores
        assert after[1] != before[1]
        np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])


def test_micro_batches_and_a_separate_processor_give_the_same_scores(clip_dir):
    images = _images(5)
    prompts = [*PROMPTS, "a dog", "a red cube"]
    whole = ClipScore(ClipArgs(model_path=str(clip_dir)))(images, prompts, [{}] * 5).scores
    split = ClipScore(ClipArgs(model_path=str(clip_dir), processor_path=str(clip_dir), max_batch_size=2))
    np.testing.assert_allclose(split(images, prompts, [{}] * 5).scores, whole, atol=1e-6)


def _build_error(name, **args) -> str:
    with pytest.raises(RewardError) as info:
        build_reward(RewardSpec(name=name, args=args))
    return str(info.value)


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "aesthetic"])
def test_missing_model_paths_are_clear_errors(name, tmp_path, head):
    extra = {"head_path": str(head[0])} if name == "aesthetic" else {}
    missing = tmp_path / "no_such_model"
    message = _build_error(name, model_path=str(missing), **extra)
    assert str(missing) in message and "does not exist" in message
    message = _build_error(name, model_path=str(tmp_path), **extra)  # exists, but holds no model
    assert str(tmp_path) in message and "CLIPModel" in message


def test_bad_arguments_are_clear_errors(clip_dir, tmp_path):
    # Types and bounds are refused when the config loads, by key path; what only the files can tell, when built.
    for args, message in [({}, "model_path: Field required"),
                          ({"model_path": str(clip_dir), "max_batch_size": 0},
                           "max_batch_size: Input should be greater than or equal to 1 (got 0)")]:
        with pytest.raises(ConfigError) as info:
            TrainingJobConfig.from_sections({"rewards": [{"name": "clip_score", "args": args}]}, "test")
        assert f"rewards.0.args.{message}" in str(info.value)
    assert "device" in _build_error("clip_score", model_path=str(clip_dir), device="tpu")
    wrong_size = tmp_path / "head.safetensors"
    save_file({"layers.0.weight": torch.zeros(1024, 8)}, wrong_size)
    message = _build_error("aesthetic", model_path=str(clip_dir), head_path=str(wrong_size))
    assert str(wrong_size) in message and "16-dim" in message
    assert "head_path" in _build_error("aesthetic", model_path=str(clip_dir), head_path=str(clip_dir))
