"""Rule rewards against independent computations, and per-sample failure handling."""

import io

import numpy as np
import pytest
from PIL import Image

from components.errors import RewardError
from components.rewards.base import PointwiseReward
from components.rewards.brightness import Brightness
from components.rewards.config import RewardSpec
from components.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from components.rewards.registry import build_reward
from components.rewards.scoring import RewardSet, combine


def _images(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 16, 16, 3), dtype=np.uint8)


def test_jpeg_rewards_are_the_encoded_size():
    imgs = _images()
    imgs[0] = 128  # a flat image compresses far better than noise
    sizes = []
    for im in imgs:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, "JPEG", quality=95)
        sizes.append(len(buf.getvalue()) / 1000)
    comp = JpegCompressibility()(imgs, ["p"] * 3, [{}] * 3)
    incomp = JpegIncompressibility()(imgs, ["p"] * 3, [{}] * 3)
    np.testing.assert_allclose(comp.scores, [-s / 500 for s in sizes])
    np.testing.assert_allclose(incomp.scores, sizes)
    assert comp.scores[0] > comp.scores[1]


def test_brightness_is_mean_luma():
    imgs = np.zeros((3, 4, 4, 3), dtype=np.uint8)
    imgs[1] = 255
    imgs[2, ..., 0] = 255  # pure red: luma 0.299
    out = Brightness()(imgs, ["p"] * 3, [{}] * 3)
    np.testing.assert_allclose(out.scores, [0.0, 1.0, 0.299])
    assert out.errors == [None, None, None]


def test_one_failing_sample_does_not_fail_the_batch():
    class Fragile(PointwiseReward):
        name = "fragile"

        def score(self, image, prompt, metadata):
            if prompt == "bad":
                raise RuntimeError("boom")
            return float("inf") if prompt == "inf" else 1.0

    out = Fragile()(_images(), ["ok", "bad", "inf"], [{}] * 3)
    assert out.scores[0] == 1.0 and np.isnan(out.scores[1:]).all()
    assert out.failed == 2 and "boom" in out.errors[1] and "non-finite" in out.errors[2]


def test_registry_errors_name_the_key():
    with pytest.raises(RewardError, match=r"rewards\.0\.name: unknown reward 'shiny'.*brightness"):
        build_reward(RewardSpec(name="shiny"), where="rewards.0")
    with pytest.raises(RewardError, match=r"rewards\.0\.args: .*'quality'"):
        build_reward(RewardSpec(name="brightness", args={"quality": 3}), where="rewards.0")


def test_reward_set_scores_and_combines_with_weights():
    rs = RewardSet([RewardSpec(name="brightness", weight=2.0), RewardSpec(name="jpeg_incompressibility", weight=-1.0)])
    images = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    images[1] = 255
    outs = rs.score(images, ["a", "b"], [{}, {}], [0, 0], list(rs.weights))
    np.testing.assert_allclose(outs["brightness"].scores, [0.0, 1.0])
    combined = combine(outs, rs.weights)
    np.testing.assert_allclose(combined, 2.0 * outs["brightness"].scores - outs["jpeg_incompressibility"].scores)
