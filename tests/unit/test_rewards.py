"""Rule rewards against independent computations, and per-sample failure handling."""

import io

import numpy as np
import pytest
from PIL import Image

from components.errors import RewardError
from components.rewards.base import PointwiseReward
from components.rewards.brightness import Brightness
from components.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from components.rewards.registry import RewardSpec, build_reward
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
    # A custom reward's arguments are checked where its class is imported: by its constructor's signature...
    with pytest.raises(RewardError, match=r"^rewards\.0\.args: .*'quality' \(reward 'reward_fixtures:Hang'\)$"):
        build_reward(RewardSpec(name="reward_fixtures:Hang", args={"quality": 3}), where="rewards.0")
    # ... or by its Args model, each key by its path (a built-in named by its import path has one)
    with pytest.raises(RewardError, match=r"^rewards\.0\.args\.min_confidence: Input should be less than or equal "
                                          r"to 1 \(got 2\) \(reward 'components\.rewards\.ocr:OcrReward'\)$"):
        build_reward(RewardSpec(name="components.rewards.ocr:OcrReward", args={"min_confidence": 2}),
                     where="rewards.0")


def test_reward_set_scores_and_combines_with_weights():
    rs = RewardSet([RewardSpec(name="brightness", weight=2.0), RewardSpec(name="jpeg_incompressibility", weight=-1.0)])
    images = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    images[1] = 255
    outs = rs.score(images, ["a", "b"], [{}, {}], [0, 0], list(rs.weights))
    np.testing.assert_allclose(outs["brightness"].scores, [0.0, 1.0])
    combined = combine(outs, rs.weights)
    np.testing.assert_allclose(combined, 2.0 * outs["brightness"].scores - outs["jpeg_incompressibility"].scores)


def test_identical_configs_share_one_instance_across_reward_sets():
    from components.rewards.registry import RewardCache

    cache = RewardCache()
    train = RewardSet([RewardSpec(name="jpeg_compressibility"),
                       RewardSpec(name="rank", args={"reward": {"name": "jpeg_compressibility"}})], cache=cache)
    evaluation = RewardSet([RewardSpec(name="jpeg_compressibility", label="jpeg_eval", weight=3.0)], cache=cache)
    shared = train.rewards["jpeg_compressibility"]
    assert evaluation.rewards["jpeg_eval"] is shared
    assert train.rewards["rank"].inner is shared  # the wrapper reuses it too
    other = RewardSet([RewardSpec(name="ocr", args={"min_confidence": 0.1})], cache=cache)
    assert other.rewards["ocr"] is not RewardSet([RewardSpec(name="ocr")], cache=cache).rewards["ocr"]


def test_dotted_path_rewards_and_bad_paths():
    from components.rewards.registry import reward_class

    assert reward_class("components.rewards.brightness:Brightness") is Brightness
    assert reward_class("components.rewards.brightness.Brightness") is Brightness
    with pytest.raises(RewardError, match="cannot import reward 'no_such_module:X'"):
        reward_class("no_such_module:X")
    with pytest.raises(RewardError, match=r"is not a subclass of components\.rewards\.base\.Reward"):
        reward_class("numpy:ndarray")


def test_batched_reward_isolates_the_failing_sample():
    from components.rewards.base import BatchedReward

    class PicksyMean(BatchedReward):
        def score_batch(self, images, prompts, metadata):
            if "bad" in prompts:
                raise ValueError("cannot score 'bad'")
            return images.reshape(len(images), -1).mean(axis=1)

    out = PicksyMean()(_images(), ["ok", "bad", "ok"], [{}] * 3)
    assert np.isnan(out.scores[1]) and "cannot score 'bad'" in out.errors[1]
    np.testing.assert_allclose(out.scores[[0, 2]], _images()[[0, 2]].reshape(2, -1).mean(axis=1))


def test_rewards_that_never_return_cannot_deadlock_scoring():
    """Far more concurrent batches than worker threads, each with a reward that outlives the test:
    every call must come back as a timeout, promptly, while the other reward still scores."""
    import concurrent.futures as cf
    import time

    specs = [RewardSpec(name="brightness"),
             RewardSpec(name="reward_fixtures:Hang", label="hang", args={"seconds": 60}, timeout_s=0.2)]
    rs = RewardSet(specs)
    images = _images(2)
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda _: rs.score(images, ["a", "b"], [{}, {}], [0, 0], ["brightness", "hang"]),
                             range(48)))
    elapsed = time.perf_counter() - started
    rs.close()
    assert all(o["hang"].errors == ["timed out after 0.2s"] * 2 for o in outs)
    assert all(o["brightness"].failed == 0 for o in outs)
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("name", ["../../etc/passwd", "/tmp/reward.py", "my rewards:X", "a:b:c", "pkg.:X"])
def test_a_name_that_is_no_import_path_is_refused_when_the_config_loads(name):
    from components.errors import ConfigError
    from pipeline.config import load_config

    # Before: the config loaded; train then died in importlib with a 57-line TypeError traceback.
    with pytest.raises(ConfigError, match=r"rewards\.0\.name: .*(neither a built-in|unknown reward)") as info:
        load_config(None, [f"rewards=[{{name: '{name}'}}]"])
    assert "\n" not in str(info.value)
    with pytest.raises(RewardError, match=r"^rewards\.0\.name: "):  # the trainer's resolution says the same
        build_reward(RewardSpec(name=name), where="rewards.0")


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("foo.bar:Baz", "cannot import reward 'foo.bar:Baz': No module named 'foo'"),
        ("os:system", "'os:system' is not a subclass of components.rewards.base.Reward"),
        ("components.rewards.brightness:Nope", "module components.rewards.brightness has no 'Nope'"),
        ("components.rewards.base:PointwiseReward", "is abstract (it does not implement score)"),
        ("broken_reward_module:Reward", "importing broken_reward_module raised RuntimeError: no GPU here"),
    ],
)
def test_validate_resolves_rewards_with_the_trainers_function(name, needle, tmp_path, monkeypatch):
    from pipeline.config import check_rewards, load_config

    (tmp_path / "broken_reward_module.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, [f"rewards=[{{name: '{name}'}}]"])  # the form is an import path: it loads
    with pytest.raises(RewardError) as validated:
        check_rewards(config)  # what `flowgrpo validate` runs
    with pytest.raises(RewardError) as trained:
        RewardSet(config.rewards)  # what the trainer builds
    message = str(validated.value)
    assert message == str(trained.value) and message.startswith("rewards.0.name: ")
    assert needle in message and "\n" not in message


def test_validate_resolves_what_a_wrapper_builds_and_leaves_a_servers_rewards_to_it():
    from pipeline.config import check_rewards, load_config

    config = load_config(None, ["rewards=[{name: rank, args: {reward: {name: 'os:system'}}}]"])
    with pytest.raises(RewardError, match=r"^rewards\.0\.args\.reward\.name: 'os:system' is not a subclass"):
        check_rewards(config)
    # Scored by the user's server (it may serve other names): only the evaluation rewards are resolved here.
    served = load_config(None, ["rewards=[{name: 'their.server:Reward'}]", "reward_server.url=http://rewards:8600",
                                "eval_rewards=[{name: 'os:system'}]", "eval.gate.metric='os:system'"])
    with pytest.raises(RewardError, match=r"^eval_rewards\.0\.name: 'os:system'"):
        check_rewards(served)
    check_rewards(load_config(None, ["rewards=[{name: 'their.server:Reward'}]", "reward_server.url=http://r:8600",
                                     "eval_rewards=[{name: brightness}]", "eval.gate.metric=brightness"]))
