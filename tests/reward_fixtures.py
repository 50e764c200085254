"""Rewards that misbehave on purpose, loaded by dotted path (`reward_fixtures:Hang`) in tests."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import numpy as np

from components.rewards.base import BatchedReward, PointwiseReward


class Hang(PointwiseReward):
    """Sleeps before answering, like a reward model that stalls."""

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds = seconds

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        time.sleep(self.seconds)
        return 1.0


class Boom(BatchedReward):
    """Raises for every input."""

    def score_batch(self, images, prompts, metadata) -> np.ndarray:
        raise RuntimeError("reward exploded")


class NanOdd(BatchedReward):
    """Mean pixel value, but NaN for samples whose prompt ends in an odd digit."""

    def score_batch(self, images, prompts, metadata) -> np.ndarray:
        values = images.reshape(len(images), -1).mean(axis=1) / 255.0
        odd = np.array([p[-1:].isdigit() and int(p[-1]) % 2 == 1 for p in prompts])
        return np.where(odd, np.nan, values)


class CountingMean(BatchedReward):
    """Mean pixel value of each image; counts its batch calls (to observe server-side batching)."""

    calls: ClassVar[int] = 0
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def score_batch(self, images, prompts, metadata) -> np.ndarray:
        with self._lock:
            type(self).calls += 1
        time.sleep(self.delay_s)
        return images.reshape(len(images), -1).mean(axis=1) / 255.0


class GroundTruthLength(PointwiseReward):
    """Length of metadata['ground_truth']: shows that per-sample metadata reaches the reward."""

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        return float(len(metadata["ground_truth"]))


class SlowToLoad(PointwiseReward):
    """Takes ``load_s`` to construct, like a large model."""

    def __init__(self, load_s: float = 1.0) -> None:
        time.sleep(load_s)

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        return 0.5


class FailsToLoad(PointwiseReward):
    def __init__(self) -> None:
        raise OSError("weights not found at /models/missing")

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        return 0.0


class PromptLength(PointwiseReward):
    """len(prompt): shows which prompt each sample was scored with."""

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        return float(len(prompt))


class Sleep(BatchedReward):
    """Takes ``seconds`` per call and scores 0: a stand-in for a reward model of known cost."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def score_batch(self, images, prompts, metadata) -> np.ndarray:
        time.sleep(self.seconds)
        return np.zeros(len(images))


class InputMean(PointwiseReward):
    """Scores an edit by its sample's input images: the first one's mean pixel plus 1000 per further image (a test
    reads which inputs reached which sample)."""

    name = "input_mean"
    inputs = True

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any], inputs: list[np.ndarray]) -> float:
        return float(inputs[0].astype(np.float64).mean()) + 1000 * (len(inputs) - 1)
