"""Rewards that score edits against their input images: each sample gets its own inputs, in this process, per
group, per video frame, and a reward that does not ask for them is called as before."""

import numpy as np
import pytest
from reward_fixtures import InputMean

from components.rewards.base import BatchedReward, Inputs
from components.rewards.registry import RewardSpec
from components.rewards.scoring import BackgroundScoring, RewardSet, call_reward


def _const(value: int, size: int = 4) -> np.ndarray:
    return np.full((size, size, 3), value, dtype=np.uint8)


class InputBatch(BatchedReward):
    name = "input_batch"
    inputs = True

    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list, inputs: Inputs) -> np.ndarray:
        return np.array([float(row[0][0, 0, 0]) for row in inputs])


class ThreeArguments(BatchedReward):
    """A reward written before input images existed: ``score_batch`` takes three arguments."""

    name = "three"

    def score_batch(self, images, prompts, metadata) -> np.ndarray:
        return images.reshape(len(images), -1).mean(axis=1)


def test_each_sample_is_scored_with_its_own_input_images():
    images = np.zeros((3, 4, 4, 3), dtype=np.uint8)
    inputs = [[_const(10)], [_const(20), _const(0)], [_const(30)]]
    out = InputMean()(images, ["a", "b", "c"], [{}] * 3, inputs=inputs)
    assert out.scores.tolist() == [10, 1020, 30]
    assert InputBatch()(images, ["a", "b", "c"], [{}] * 3, inputs=inputs).scores.tolist() == [10, 20, 30]


def test_a_reward_that_asks_for_inputs_fails_clearly_without_them_and_one_that_does_not_is_untouched():
    images = np.full((2, 4, 4, 3), 7, dtype=np.uint8)
    out = call_reward(InputMean(), images, ["a", "b"], [{}, {}], [0, 1])
    assert out.failed == 2 and "scores edits against their input images, but none were given" in out.errors[0]
    assert call_reward(ThreeArguments(), images, ["a", "b"], [{}, {}], [0, 1],
                       inputs=[[_const(1)], [_const(2)]]).scores.tolist() == [7, 7]


def test_a_groupwise_split_and_video_frames_keep_each_samples_inputs():
    from components.rewards.base import GroupwiseReward, RewardOutput

    class GroupInputs(GroupwiseReward):
        name = "group_inputs"
        inputs = True

        def __call__(self, images, prompts, metadata, inputs=None):
            base = min(int(row[0][0, 0, 0]) for row in inputs)  # depends on the group's inputs only
            return RewardOutput.from_scores([int(row[0][0, 0, 0]) - base for row in inputs])

    images = np.zeros((4, 4, 4, 3), dtype=np.uint8)
    inputs = [[_const(v)] for v in (5, 9, 100, 101)]
    out = call_reward(GroupInputs(), images, list("abcd"), [{}] * 4, [0, 0, 1, 1], inputs=inputs)
    assert out.scores.tolist() == [0, 4, 0, 1]
    videos = np.zeros((2, 3, 4, 4, 3), dtype=np.uint8)
    frames = call_reward(InputMean(), videos, ["a", "b"], [{}, {}], [0, 1], inputs=[[_const(40)], [_const(60)]])
    assert frames.scores.tolist() == [40, 60]


@pytest.mark.parametrize("keys", [["input_mean"], ["input_mean", "brightness"]])
def test_the_reward_set_and_background_scoring_carry_inputs_batch_by_batch(keys):
    specs = [RewardSpec(name="reward_fixtures:InputMean", label="input_mean"), RewardSpec(name="brightness")]
    rewards = RewardSet([s for s in specs if s.key in keys])
    try:
        scoring = BackgroundScoring(rewards, max_in_flight=2)
        for batch in range(3):
            n = 2
            scoring.submit(np.zeros((n, 4, 4, 3), dtype=np.uint8), ["p"] * n, [{}] * n, [batch] * n,
                           [[_const(10 * batch + i)] for i in range(n)])
        out = scoring.finish()
    finally:
        rewards.close()
    assert out["input_mean"].scores.tolist() == [0, 1, 10, 11, 20, 21]
