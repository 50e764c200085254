"""Model weights from object storage: pipelines and reward models load from s3:// URIs on a real SeaweedFS."""

from pathlib import Path

import numpy as np
import pytest
import torch

from components import storage
from components.errors import FlowGRPOError
from components.models.config import ModelConfig
from components.models.loading import load_model
from components.models.sd3.tiny import build_tiny_sd3
from components.rewards.registry import RewardSpec, build_reward
from pipeline.services.seaweed import running_seaweed


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as s3:
        yield s3


@pytest.fixture(autouse=True)
def s3_env(seaweed, monkeypatch, tmp_path):
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FLOWGRPO_CACHE_DIR", str(tmp_path / "cache"))
    return seaweed


def test_diffusers_pipeline_loads_from_s3(seaweed, tmp_path):
    build_tiny_sd3(32, 5).save_pretrained(tmp_path / "pipe")
    uri = f"s3://{seaweed.bucket}/models/tiny-sd3"
    storage.upload_dir(tmp_path / "pipe", uri)
    loaded = load_model(ModelConfig(kind="diffusers", path=uri), seed=0)
    reference = build_tiny_sd3(32, 5).transformer.state_dict()
    got = loaded.transformer.state_dict()
    assert all(torch.equal(reference[k], got[k]) for k in reference)


def test_reward_weights_load_from_s3_once_and_score_like_local(seaweed, tmp_path):
    from test_model_rewards import save_tiny_clip

    save_tiny_clip(tmp_path / "clip")
    uri = f"s3://{seaweed.bucket}/rewards/clip"
    storage.upload_dir(tmp_path / "clip", uri)
    images = np.random.default_rng(0).integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    prompts, meta = ["a cat", "a dog"], [{}, {}]
    local = build_reward(RewardSpec(name="clip_score", args={"model_path": str(tmp_path / "clip")}))
    remote = build_reward(RewardSpec(name="clip_score", args={"model_path": uri}))
    np.testing.assert_allclose(remote(images, prompts, meta).scores, local(images, prompts, meta).scores)

    storage.delete_prefix(uri)  # a second build reads the cached copy, not the store
    again = build_reward(RewardSpec(name="clip_score", args={"model_path": uri}))
    np.testing.assert_allclose(again(images, prompts, meta).scores, local(images, prompts, meta).scores)
    cached = list(Path(storage.local_copy(uri)).parent.parent.iterdir())
    assert len(cached) == 1 and not any(".flowgrpo-tmp" in p.name for p in cached)


def test_missing_s3_model_is_a_clear_error(seaweed):
    uri = f"s3://{seaweed.bucket}/models/nothing-here"
    with pytest.raises(FlowGRPOError, match="models/nothing-here: no object or folder of objects there"):
        load_model(ModelConfig(kind="diffusers", path=uri), seed=0)
    with pytest.raises(FlowGRPOError, match="nothing-here"):
        build_reward(RewardSpec(name="clip_score", args={"model_path": uri}))


def test_single_object_is_cached_under_its_own_name(seaweed, tmp_path):
    uri = f"s3://{seaweed.bucket}/heads/aesthetic.safetensors"
    storage.put_bytes(b"weights", uri)
    path = storage.local_copy(uri)
    assert path.name == "aesthetic.safetensors" and path.read_bytes() == b"weights"
    assert storage.local_copy(uri) == path  # the same cached copy
    assert storage.local_copy(str(tmp_path)) == tmp_path  # local paths pass through
